"""quant/kld.py's statistics against numpy on small hand-made distributions.

No model: logits are written by hand or drawn from a seeded generator, the
accumulator is fed through the same LogSoftmax the evaluator uses, and every
figure is recomputed here from the full softmax with plain numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgellm.errors import EvalError
from quant.kld import BaseLogProbs, KLDAccumulator, covariance, mean_and_uncertainty, median, percentile
from quant.perplexity import LogSoftmax


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def noisy_pair(seed: int, n: int, V: int, *, scale: float, noise: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded base logits (n x V, `scale` wide), a "quantized" copy with `noise` added, and n targets."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal((n, V)) * scale).astype(np.float32)
    quant = (base + rng.standard_normal((n, V)) * noise).astype(np.float32)
    return base, quant, rng.integers(0, V, n)


def run(
    base_logits: np.ndarray, q_logits: np.ndarray, targets: np.ndarray, *, k: int, m: int = 0, chunk: int | None = None
) -> KLDAccumulator:
    """Base pass then quantized pass, `chunk` rows at a time, as quant/evaluate.py feeds them."""
    n, V = base_logits.shape
    chunk = chunk or n
    base = BaseLogProbs(n, V, k=k, m=m)
    sm = LogSoftmax()
    for r0 in range(0, n, chunk):
        rows = slice(r0, r0 + chunk)
        nll, _ = sm.nll(base_logits[rows], targets[rows])
        base.add_chunk(r0, base_logits[rows], targets[rows], nll, sm, seed=r0)
    acc = KLDAccumulator(base)
    for r0 in range(0, n, chunk):
        rows = slice(r0, r0 + chunk)
        nll, _ = sm.nll(q_logits[rows], targets[rows])
        acc.add_chunk(r0, q_logits[rows], nll, sm)
    return acc


def test_kl_of_known_distributions():
    # P uniform over 4 tokens; Q puts twice the weight on token 0: Q = (2, 1, 1, 1) / 5.
    # KL(P||Q) = 1/4 log(5/8) + 3/4 log(5/4) = 0.049857; and KL(P||P) = 0.
    n = 12
    p_logits = np.zeros((n, 4), np.float32)
    q_logits = np.zeros((n, 4), np.float32)
    q_logits[:6, 0] = math.log(2.0)  # the first six rows differ, the last six are identical
    targets = np.zeros(n, np.int64)
    acc = run(p_logits, q_logits, targets, k=3)  # top 3 exact + the one-token rest: the whole vocabulary
    want = 0.25 * math.log(5 / 8) + 0.75 * math.log(5 / 4)
    assert want == pytest.approx(0.049857, abs=1e-6)
    assert acc.kld_values[:6] == pytest.approx([want] * 6, rel=1e-5)
    assert acc.kld_values[6:] == pytest.approx([0.0] * 6, abs=1e-7)
    r = acc.result()
    assert r.count == n and r.kld_mean == pytest.approx(want / 2, rel=1e-5)
    assert r.kld_max == pytest.approx(want, rel=1e-5) and r.kld_min == pytest.approx(0.0, abs=1e-7)
    # Δp of the target (token 0): Q gives it 2/5, P 1/4
    assert r.dp_mean == pytest.approx((2 / 5 - 1 / 4) / 2, rel=1e-6)
    assert r.max_dp == pytest.approx(2 / 5 - 1 / 4, rel=1e-6)
    # ln PPL ratio = mean(nll_q - nll_p): log(1/4) - log(2/5) = log(5/8) on half the rows, 0 on the rest
    assert r.ln_ppl_ratio == pytest.approx(0.5 * math.log((1 / 4) / (2 / 5)), rel=1e-6)
    assert r.ppl_base == pytest.approx(4.0, rel=1e-6)


def test_statistics_equal_numpy_on_random_logits():
    n, V = 40, 9
    base, quant, targets = noisy_pair(3, n, V, scale=2, noise=0.7)
    acc = run(base, quant, targets, k=V - 1, chunk=16)  # chunked: rows land in the right places
    r = acc.result()

    p, q = softmax(base), softmax(quant)
    kl = (p * (np.log(p) - np.log(q))).sum(axis=1)
    assert acc.kld_values == pytest.approx(kl, rel=1e-4, abs=1e-7)
    assert r.kld_mean == pytest.approx(kl.mean(), rel=1e-5)
    # llama.cpp's uncertainty of a mean: sqrt(population variance / (n - 1))
    assert r.kld_err == pytest.approx(kl.std() / math.sqrt(n - 1), rel=1e-4)
    # percentiles: linear interpolation between neighbours, numpy's default
    for got, pct in ((r.kld_median, 50), (r.kld_p90, 90), (r.kld_p95, 95), (r.kld_p99, 99), (r.kld_p999, 99.9)):
        assert got == pytest.approx(np.percentile(kl, pct), rel=1e-4), pct
    assert r.kld_max == pytest.approx(kl.max(), rel=1e-5) and r.kld_min == pytest.approx(kl.min(), rel=1e-4)

    # top-token agreement: the share of rows where the quantized argmax is the base's
    same = quant.argmax(axis=1) == base.argmax(axis=1)
    assert 0 < same.sum() < n  # the noise flips some rows, not all: the statistic is exercised
    top = same.mean()
    assert r.same_top_p == pytest.approx(top) and r.same_top_p_err == pytest.approx(math.sqrt(top * (1 - top) / (n - 1)))

    rows = np.arange(n)
    dp = q[rows, targets] - p[rows, targets]
    assert r.dp_mean == pytest.approx(dp.mean(), rel=1e-5, abs=1e-8)
    assert r.rms_dp == pytest.approx(math.sqrt((dp**2).mean()), rel=1e-5)
    assert r.max_dp == pytest.approx(np.abs(dp).max(), rel=1e-5)

    nll_p, nll_q = -np.log(p[rows, targets]), -np.log(q[rows, targets])
    assert r.ppl == pytest.approx(math.exp(nll_q.mean()), rel=1e-5)
    assert r.ppl_base == pytest.approx(math.exp(nll_p.mean()), rel=1e-5)
    assert r.ppl_ratio == pytest.approx(math.exp(nll_q.mean() - nll_p.mean()), rel=1e-5)
    assert r.ppl_diff == pytest.approx(math.exp(nll_q.mean()) - math.exp(nll_p.mean()), rel=1e-4)
    # the ratio's error uses the covariance of the paired NLLs (correlated, so smaller than independent errors)
    cov = np.cov(nll_q, nll_p, bias=True)[0, 1] / (n - 1)
    want = math.sqrt(nll_q.std() ** 2 / (n - 1) + nll_p.std() ** 2 / (n - 1) - 2 * cov)
    assert r.ln_ppl_ratio_err == pytest.approx(want, rel=1e-4)


def test_sampled_tail_estimates_the_full_vocabulary_kl():
    # A 4096-token vocabulary, exact top 32 + 64 stratified tail samples: the estimate tracks the full KL.
    base, quant, targets = noisy_pair(7, 256, 4096, scale=1.5, noise=0.3)
    p, q = softmax(base), softmax(quant)
    exact = (p * (np.log(p) - np.log(q))).sum(axis=1).mean()
    top_only = run(base, quant, targets, k=32, m=0).result().kld_mean  # the tail as one bucket
    sampled = run(base, quant, targets, k=32, m=64).result().kld_mean
    assert sampled == pytest.approx(exact, rel=0.02), (sampled, exact)
    assert abs(top_only - exact) > 10 * abs(sampled - exact)  # the bucket alone misses most of the tail's KL


def test_percentile_median_and_uncertainty_helpers():
    v = np.sort(np.array([4.0, 1.0, 3.0, 2.0, 10.0], np.float32))
    assert median(v) == 3.0 and median(v[:4]) == 2.5
    assert percentile(v, 0.0) == 1.0 and percentile(v, 1.0) == 10.0
    assert percentile(v, 0.9) == pytest.approx(np.percentile(v, 90))  # 4 + 0.6 * 6
    assert percentile(v, 0.9) == pytest.approx(7.6, rel=1e-6)
    # below 11 samples no uncertainty is claimed (llama.cpp's rule), and none for zero variance
    assert mean_and_uncertainty(10.0, 30.0, 5) == (2.0, 0.0)
    f, e = mean_and_uncertainty(22.0, 60.0, 11)
    assert f == 2.0 and e == pytest.approx(math.sqrt((60 / 11 - 4) / 10))
    assert mean_and_uncertainty(0.0, 0.0, 0) == (0.0, 0.0)
    assert covariance(10.0, 10.0, 12.0, 5) == 0.0
    assert covariance(11.0, 22.0, 30.0, 11) == pytest.approx((30 / 11 - 1 * 2) / 10)


def test_too_few_tokens_and_incomplete_base_are_errors(tmp_path):
    acc = run(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32), np.zeros(1, np.int64), k=3)
    with pytest.raises(EvalError, match="too few"):
        acc.result()
    base = BaseLogProbs(8, 16, k=4, m=4)
    with pytest.raises(EvalError, match="incomplete"):
        base.save(tmp_path / "b.npz")
    assert not (tmp_path / "b.npz").exists()


def test_base_log_probs_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((20, 300)).astype(np.float32)
    targets = rng.integers(0, 300, 20)
    acc = run(logits, logits, targets, k=8, m=8)
    path = acc.base.save(tmp_path / "base.npz")
    back = BaseLogProbs.load(path)
    assert (back.k, back.m, back.n_vocab, back.n_tokens) == (8, 8, 300, 20)
    for name in ("ids", "logp", "tail_ids", "tail_logp", "rest_logp", "nll"):
        assert np.array_equal(getattr(back, name), getattr(acc.base, name)), name
    # the base against itself: zero divergence, same top token everywhere
    r = acc.result()
    assert r.kld_max == pytest.approx(0.0, abs=1e-6) and r.same_top_p == 1.0 and r.ppl_ratio == pytest.approx(1.0)
    (tmp_path / "bad.npz").write_bytes(b"not an npz")
    with pytest.raises(EvalError, match="cannot read"):
        BaseLogProbs.load(tmp_path / "bad.npz")
