"""KL divergence of a quantized model against its base, llama.cpp-compatible.

llama.cpp's `--kl-divergence-base` writes every scored token's full
log-probability vector as uint16 (2 bytes x n_vocab per token: ~100 KB a
token for a 49k vocabulary, GBs for a corpus). We keep, per scored token,
the base's exact top-k log-probs (float32) and token ids (uint16 or int32),
m tokens sampled from the rest (ids and exact log-probs), the log of the
remaining probability mass, and the NLL of the actual token: 6 x (k + m) + 8
bytes, 1.5 KB at k = m = 128, 63x smaller than llama.cpp's file.

KLD per token = exact top-k part + the rest, split as
  P_rest log(P_rest / Q_rest)          (exact: both masses are known)
  + P_rest KL(tail_p || tail_q)        (estimated from the m samples).
Top-k plus "one bucket" alone is not enough: a 135M model spreads ~20% of
its KLD over the tail beyond the top 64 tokens. The within-tail KL is
estimated with the low-variance unbiased estimator E_p[(r - 1) - log r],
r = q/p (each term >= 0, second order in q - p), over m draws that are
stratified: systematic sampling of the tail ordered by log-prob, with a
seeded offset per token, so results are deterministic. P_rest and Q_rest come
from the very float32 exps the log-softmax summed, so there is no
cancellation error. Measured against the full-vocabulary KLD on the default
model: within ±0.5% on 510 tokens, and the error shrinks with 1/sqrt(tokens);
llama.cpp's own file drops every base log-prob below -16 (±0.5% too).

The statistics (mean ± err, median, percentiles, max, same-top-p, RMS Δp,
PPL ratio ± err) follow `kl_divergence()` in llama.cpp's perplexity.cpp
formula for formula.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edgellm.errors import EvalError
from edgellm.fsutil import atomic_path

log = logging.getLogger(__name__)

DEFAULT_TOPK = 128
DEFAULT_TAIL_SAMPLES = 128
FORMAT_VERSION = 2


class BaseLogProbs:
    """The base model's compact per-token log-probabilities, filled chunk by chunk."""

    def __init__(
        self,
        n_tokens: int,
        n_vocab: int,
        *,
        k: int = DEFAULT_TOPK,
        m: int = DEFAULT_TAIL_SAMPLES,
        meta: Optional[dict[str, Any]] = None,
    ) -> None:
        k = max(1, min(k, n_vocab - 1))
        self.k, self.m = k, m
        self.n_vocab = n_vocab
        id_type = np.uint16 if n_vocab <= 65536 else np.int32
        self.ids = np.zeros((n_tokens, k), id_type)
        self.logp = np.zeros((n_tokens, k), np.float32)
        self.tail_ids = np.zeros((n_tokens, m), id_type)
        self.tail_logp = np.zeros((n_tokens, m), np.float32)
        self.rest_logp = np.full(n_tokens, -np.inf, np.float32)
        self.nll = np.zeros(n_tokens, np.float32)
        self.meta = dict(meta or {})
        self.filled = 0

    @property
    def n_tokens(self) -> int:
        return len(self.nll)

    def add_chunk(self, row0: int, logits: np.ndarray, targets: np.ndarray, nll: np.ndarray, sm: Any, *, seed: int = 0) -> None:
        """Take top-k and tail samples of one chunk's scored logits.

        `sm` is the LogSoftmax that just ran on them; its exp buffer is
        overwritten here (it is scratch until the next chunk).
        """
        k, n = self.k, len(targets)
        rows = slice(row0, row0 + n)
        V = logits.shape[1]
        part = np.argpartition(logits, V - k, axis=1)[:, V - k :]
        part.sort(axis=1)  # by id first, so equal logits keep llama.cpp's lowest-id-wins order
        vals = np.take_along_axis(logits, part, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        ids = np.take_along_axis(part, order, axis=1)
        vals = np.take_along_axis(vals, order, axis=1).astype(np.float64)
        self.ids[rows] = ids
        self.logp[rows] = vals - sm.lse_rows[:, None]
        top = np.take_along_axis(sm.exp, ids, axis=1).sum(axis=1, dtype=np.float64)
        rest = np.maximum(sm.sums - top, 0.0) / sm.sums
        with np.errstate(divide="ignore"):
            self.rest_logp[rows] = np.log(rest)
        self.nll[rows] = nll
        if self.m:
            self._sample_tail(rows, logits, ids, sm, seed)
        self.filled = max(self.filled, row0 + n)

    def _sample_tail(self, rows: slice, logits: np.ndarray, ids: np.ndarray, sm: Any, seed: int) -> None:
        n, V = logits.shape
        w = sm.exp  # exp(logit - max): tail weights once the top-k are zeroed
        np.put_along_axis(w, ids, 0.0, axis=1)
        # Strata: the tail ordered by log-prob, coarsely (1/4 nat bins, radix-sorted).
        key = np.clip((logits.max(axis=1, keepdims=True) - logits) * 4.0, 0, 255).astype(np.uint8)
        order = np.argsort(key, axis=1, kind="stable")
        cs = np.cumsum(np.take_along_axis(w, order, axis=1), axis=1, dtype=np.float64)
        tot = cs[:, -1:].copy()
        tot[tot <= 0] = 1.0
        cs /= tot
        cs += np.arange(n, dtype=np.float64)[:, None]  # rows side by side: one global searchsorted
        u = np.random.default_rng(seed).random((n, 1))
        targets = (u + np.arange(self.m)[None, :]) / self.m + np.arange(n)[:, None]
        pos = np.searchsorted(cs.ravel(), targets.ravel(), side="right").reshape(n, self.m) - (np.arange(n) * V)[:, None]
        pos = np.clip(pos, 0, V - 1)
        tail = np.take_along_axis(order, pos, axis=1)
        self.tail_ids[rows] = tail
        self.tail_logp[rows] = np.take_along_axis(logits, tail, axis=1).astype(np.float64) - sm.lse_rows[:, None]

    # -- persistence --------------------------------------------------------

    def save(self, path: Path) -> Path:
        if self.filled != self.n_tokens:
            raise EvalError(f"base log-probs incomplete ({self.filled}/{self.n_tokens} tokens); not saved")
        meta = dict(self.meta, k=self.k, m=self.m, n_vocab=self.n_vocab, version=FORMAT_VERSION)
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as fh:
                np.savez(
                    fh,
                    ids=self.ids,
                    logp=self.logp,
                    rest_logp=self.rest_logp,
                    nll=self.nll,
                    tail_ids=self.tail_ids,
                    tail_logp=self.tail_logp,
                    meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                )
        return path

    @classmethod
    def load(cls, path: Path) -> BaseLogProbs:
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                obj = cls.__new__(cls)
                obj.ids, obj.logp, obj.rest_logp, obj.nll = z["ids"], z["logp"], z["rest_logp"], z["nll"]
                obj.tail_ids, obj.tail_logp = z["tail_ids"], z["tail_logp"]
        except (OSError, ValueError, KeyError) as e:
            raise EvalError(f"cannot read base log-probs {path.name}: {e}") from None
        if meta.get("version") != FORMAT_VERSION:
            raise EvalError(f"{path.name}: base log-probs of an unknown format version")
        obj.k, obj.m, obj.n_vocab, obj.meta = int(meta["k"]), int(meta["m"]), int(meta["n_vocab"]), meta
        obj.filled = len(obj.nll)
        return obj


@dataclass
class KLDResult:
    """llama.cpp's `kl_divergence()` summary, same names where it has them."""

    count: int
    ppl: float
    ppl_err: float
    ppl_base: float
    ppl_base_err: float
    ln_ppl_ratio: float
    ln_ppl_ratio_err: float
    ppl_ratio: float
    ppl_ratio_err: float
    ppl_diff: float
    ppl_diff_err: float
    kld_mean: float
    kld_err: float
    kld_max: float
    kld_p999: float
    kld_p99: float
    kld_p95: float
    kld_p90: float
    kld_median: float
    kld_min: float
    dp_mean: float  # mean Δp, as a fraction (llama.cpp prints x100 %)
    dp_err: float
    rms_dp: float
    rms_dp_err: float
    max_dp: float
    same_top_p: float  # fraction
    same_top_p_err: float

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 8) if isinstance(v, float) else v) for k, v in asdict(self).items()}


class KLDAccumulator:
    """Sums of `kl_divergence_result`, fed chunk by chunk from the quantized model's logits."""

    def __init__(self, base: BaseLogProbs) -> None:
        self.base = base
        n = base.n_tokens
        self.kld_values = np.zeros(n, np.float32)
        self.p_diff_values = np.zeros(n, np.float32)
        self.sum_nll = self.sum_nll2 = self.sum_nll_base = self.sum_nll_base2 = self.sum_nll_nll_base = 0.0
        self.sum_kld = self.sum_kld2 = self.sum_p_diff = self.sum_p_diff2 = self.sum_p_diff4 = 0.0
        self.max_p_diff = 0.0
        self.n_same_top = 0
        self.count = 0

    def add_chunk(self, row0: int, logits: np.ndarray, nll: np.ndarray, sm: Any) -> None:
        b = self.base
        n = len(nll)
        rows = slice(row0, row0 + n)
        ids = b.ids[rows].astype(np.intp)
        logp = b.logp[rows].astype(np.float64)
        rest_logp = b.rest_logp[rows].astype(np.float64)
        logq = np.take_along_axis(logits, ids, axis=1).astype(np.float64) - sm.lse_rows[:, None]
        top_q = np.take_along_axis(sm.exp, ids, axis=1).sum(axis=1, dtype=np.float64)
        q_rest = np.maximum(sm.sums - top_q, 0.0) / sm.sums
        p = np.exp(logp)
        kld = (p * (logp - logq)).sum(axis=1)
        p_rest = np.exp(rest_logp)
        tail = p_rest > 0
        # A tail the quantized model gives no float32 mass at all: cap at the
        # smallest positive double rather than an infinite divergence.
        log_q_rest = np.log(np.maximum(q_rest, 1e-300))
        kld[tail] += p_rest[tail] * (rest_logp[tail] - log_q_rest[tail])
        if b.m:
            tids = b.tail_ids[rows].astype(np.intp)
            tlq = np.take_along_axis(logits, tids, axis=1).astype(np.float64) - sm.lse_rows[:, None]
            with np.errstate(over="ignore", invalid="ignore"):
                log_r = (tlq - log_q_rest[:, None]) - (b.tail_logp[rows].astype(np.float64) - rest_logp[:, None])
                within = (np.expm1(log_r) - log_r).mean(axis=1)
            kld[tail] += p_rest[tail] * within[tail]
        self.kld_values[rows] = kld
        self.sum_kld += float(kld.sum())
        self.sum_kld2 += float(np.dot(kld, kld))

        nll_base = b.nll[rows].astype(np.float64)
        self.sum_nll += float(nll.sum())
        self.sum_nll2 += float(np.dot(nll, nll))
        self.sum_nll_base += float(nll_base.sum())
        self.sum_nll_base2 += float(np.dot(nll_base, nll_base))
        self.sum_nll_nll_base += float(np.dot(nll, nll_base))

        self.n_same_top += int(np.count_nonzero(logits.argmax(axis=1) == ids[:, 0]))
        p_diff = np.exp(-nll) - np.exp(-nll_base)
        self.p_diff_values[rows] = p_diff
        self.sum_p_diff += float(p_diff.sum())
        d2 = p_diff * p_diff
        self.sum_p_diff2 += float(d2.sum())
        self.sum_p_diff4 += float(np.dot(d2, d2))
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max()) if n else 0.0)
        self.count += n

    def result(self) -> KLDResult:
        c = self.count
        if c < 2:
            raise EvalError("too few scored tokens for KL-divergence statistics")
        log_ppl, log_ppl_e = mean_and_uncertainty(self.sum_nll, self.sum_nll2, c)
        log_base, log_base_e = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, c)
        cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, c)
        ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
        ppl_e, ppl_base_e = ppl * log_ppl_e, ppl_base * log_base_e
        ratio = log_ppl - log_base
        ratio_e = math.sqrt(max(log_ppl_e**2 + log_base_e**2 - 2.0 * cov, 0.0))
        ppl_cov = ppl * ppl_base * cov
        kld, kld_e = mean_and_uncertainty(self.sum_kld, self.sum_kld2, c)
        kv = np.sort(self.kld_values[:c])
        dp, dp_e = mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, c)
        mse, mse_e = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, c)
        rms = math.sqrt(mse)
        top = self.n_same_top / c
        return KLDResult(
            count=c,
            ppl=ppl,
            ppl_err=ppl_e,
            ppl_base=ppl_base,
            ppl_base_err=ppl_base_e,
            ln_ppl_ratio=ratio,
            ln_ppl_ratio_err=ratio_e,
            ppl_ratio=math.exp(ratio),
            ppl_ratio_err=math.exp(ratio) * ratio_e,
            ppl_diff=ppl - ppl_base,
            ppl_diff_err=math.sqrt(max(ppl_e**2 + ppl_base_e**2 - 2.0 * ppl_cov, 0.0)),
            kld_mean=kld,
            kld_err=kld_e,
            kld_max=float(kv[-1]),
            kld_p999=percentile(kv, 0.999),
            kld_p99=percentile(kv, 0.99),
            kld_p95=percentile(kv, 0.95),
            kld_p90=percentile(kv, 0.90),
            kld_median=median(kv),
            kld_min=float(kv[0]),
            dp_mean=dp,
            dp_err=dp_e,
            rms_dp=rms,
            rms_dp_err=0.5 / rms * mse_e if rms > 0 else 0.0,
            max_dp=self.max_p_diff,
            same_top_p=top,
            same_top_p_err=math.sqrt(top * (1 - top) / (c - 1)),
        )


def mean_and_uncertainty(s: float, s2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def covariance(sa: float, sb: float, sab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sab / count - (sa / count) * (sb / count)) / (count - 1)


def median(sorted_values: np.ndarray) -> float:
    n = len(sorted_values)
    if n % 2 == 0:
        return float(np.float32(0.5) * (sorted_values[n // 2] + sorted_values[n // 2 - 1]))
    return float(sorted_values[n // 2])


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's linear interpolation between neighbours (computed in float32 as it does)."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = np.float32(fraction) * np.float32(len(sorted_values) - 1)
    ip = int(p)
    p = np.float32(p - ip)
    nxt = sorted_values[min(ip + 1, len(sorted_values) - 1)]
    return float((np.float32(1) - p) * sorted_values[ip] + p * nxt)


__all__ = [
    "BaseLogProbs",
    "KLDAccumulator",
    "KLDResult",
    "DEFAULT_TOPK",
    "mean_and_uncertainty",
    "covariance",
    "percentile",
    "median",
]
