"""Error feedback (quant/feedback.py): its block layouts are ggml's own, it lowers a matmul's output error on
inputs it never saw, and `--budget` (feedback is its default) writes a file its recipe reproduces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgellm.gguf.layout import read_tensors
from support.helpers import refused
from support.quant_fixtures import F16_NAME, f16_model, f16_session  # noqa: F401 (fixtures)

from quant.selfgen import GEN_SEQS


def _correlated_inputs(rng: np.random.Generator, n: int, cols: int) -> np.ndarray:
    # activations whose channels share a few directions and differ in scale, as a transformer's do
    mix = rng.standard_normal((cols, cols)) * 0.3 + np.eye(cols)
    scale = np.exp(rng.standard_normal(cols))
    return (rng.standard_normal((n, cols)) @ mix * scale).astype(np.float32)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_levels_written_back_give_ggml_s_own_bytes(type_name):
    """Each packer puts level k where ggml's to_float reads it: the levels read back from a block ggml wrote,
    put into a copy, give that block's bytes exactly."""
    from quant._ggml import ggml
    from quant.feedback import PACKERS, TYPE_NAMES

    g, tid = ggml(), TYPE_NAMES[type_name]
    p = PACKERS[tid]
    rng = np.random.default_rng(tid)
    w = (rng.standard_normal((48, 512)) * np.exp(rng.standard_normal(512))).astype(np.float32)
    data = g.quantize(tid, w, rng.uniform(0.1, 2.0, 512).astype(np.float32)).reshape(48, -1)
    for bi in range(512 // p.block):
        blk = np.ascontiguousarray(data[:, bi * p.size : (bi + 1) * p.size])
        ends = []
        for k in (0, 1):
            b = blk.copy()
            p.put(b, np.full((48, p.block), k))
            ends.append(g.to_float(tid, b, (48, p.block)))
        a, b0 = ends[1] - ends[0], ends[0]
        v = g.to_float(tid, blk, (48, p.block))
        k = np.where(a == 0, 0, np.rint((v - b0) / np.where(a == 0, 1, a))).astype(np.int64)
        assert k.min() >= 0 and k.max() < p.levels
        again = blk.copy()
        p.put(again, k)
        assert np.array_equal(again, blk), f"{type_name} block {bi}"


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_feedback_lowers_the_output_error_on_inputs_it_never_saw(type_name):
    """Against ggml's own rounding with the same importance (the covariance's diagonal): the output error
    E H E^T is lower on the calibration inputs and, by less, on held-out ones; same bytes per row."""
    from quant._ggml import ggml
    from quant.feedback import TYPE_NAMES, feed_back

    g, tid = ggml(), TYPE_NAMES[type_name]
    rng = np.random.default_rng(7)
    cols = 512
    x = _correlated_inputs(rng, 8192, cols)
    cal, held = x[:4096], x[4096:]
    h_cal, h_held = (cal.T @ cal / len(cal)).astype(np.float64), (held.T @ held / len(held)).astype(np.float64)
    w = (rng.standard_normal((64, cols)) * 0.05).astype(np.float32)
    imp = np.diag(h_cal).astype(np.float32)
    plain = g.quantize(tid, w, imp)
    fed = np.frombuffer(feed_back(tid, w, h_cal, imp), np.uint8)
    assert fed.size == plain.size and not np.array_equal(fed, plain)

    def out_error(data: np.ndarray, h: np.ndarray) -> float:
        e = (w - g.to_float(tid, np.ascontiguousarray(data), w.shape)).astype(np.float64)
        return float(np.einsum("ij,jk,ik->", e, h, e))

    on_cal = out_error(fed, h_cal) / out_error(plain, h_cal)
    on_held = out_error(fed, h_held) / out_error(plain, h_held)
    assert on_cal < 0.8 and on_held < 0.85, (type_name, on_cal, on_held)


def test_budget_with_error_feedback_is_reproduced_by_its_recipe(
    cli, f16_model, session_imatrix, edgellm_home, monkeypatch, tmp_path
):
    common = ["--exclude-types", "q4_1", "--imatrix", str(session_imatrix), "--threads", "2", "--json"]
    res = cli("quantize", F16_NAME, "--budget", "95MB", *common)  # feedback is --budget's default
    assert res.exit_code == 0, res
    out = res.json()[0]
    assert out["name"] == "smollm2-135m-instruct-budget-95mb-fb" and out["size_bytes"] <= 95_000_000
    assert out["error_feedback"] is True and out["feedback_skipped"] == ""
    fs = out["feedback_seconds"]
    assert fs["matrices"] > 100 and fs["tokens"] > 0 and fs["inputs"] > 0 and fs["rewrite"] > 0
    assert fs["tokens_cached"] == 0 and len(list((edgellm_home / "selfgen").glob("*.npy"))) == 1
    recipe = json.loads(Path(out["recipe_file"]).read_text())
    assert recipe["feedback"] is True and recipe["feedback_seconds"] == fs  # the saved recipe has the job's timing
    # the default model writes all its sequences (quant/selfgen.py: a wider one fewer), and the recipe says how many
    assert recipe["feedback_sequences"] == fs["sequences"] == GEN_SEQS
    plain = cli("quantize", F16_NAME, "--budget", "95MB", "--no-error-feedback", *common).json()[0]
    assert plain["name"] == "smollm2-135m-instruct-budget-95mb" and plain["error_feedback"] is False
    # the same types (the search does not know about feedback), other bytes
    assert plain["tensor_types"] == out["tensor_types"] and plain["size_bytes"] == out["size_bytes"]
    assert plain["sha256"] != out["sha256"]
    # reproduced with the RAM for about half the covariances: two passes over the text, the same bytes
    from quant.feedback import FACTOR_COPIES, HEADROOM, input_key, targets

    tables = {t.name: int(t.shape[0]) for t in read_tensors(f16_model.path).tensors}
    widths = {input_key(n): tables[n] for n in targets([(p, t) for p, t in recipe["tensor_types"]], tables)}
    covs = sum(8 * c * c for c in widths.values())
    room = covs // 2 + (1 + FACTOR_COPIES) * 8 * max(widths.values()) ** 2  # the first pass takes over half
    monkeypatch.setenv("EDGELLM_FAKE_AVAILABLE_RAM", str(f16_model.path.stat().st_size + HEADROOM + room))
    again = cli("quantize", F16_NAME, "--recipe", out["recipe_file"], "--force", *common[2:])
    assert again.exit_code == 0, again
    assert again.json()[0]["sha256"] == out["sha256"]
    assert fs["passes"] == 1 and again.json()[0]["feedback_seconds"]["passes"] == 2
    # the model's tokens were read back from the first job's cache (quant/selfgen.py): the same bytes again
    assert again.json()[0]["feedback_seconds"]["tokens_cached"] == 1
    # too little RAM for even the widest input: refused before anything is quantized
    monkeypatch.setenv("EDGELLM_FAKE_AVAILABLE_RAM", str(HEADROOM + 1_000_000))
    msg = refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", out["recipe_file"], "--force", *common[2:])
    assert "error feedback needs" in msg and "wide inputs of " in msg and "the recipe was made with error feedback" in msg
    # a --budget job that asked for it is refused alike, and says how to go without ...
    msg = refused(cli, edgellm_home, "quantize", F16_NAME, "--budget", "95MB", "--error-feedback", "--force", *common[:-1])
    assert "error feedback needs" in msg and "or quantize with --no-error-feedback" in msg
    # ... and one that left it to the default goes on without: the plain file, and it says why
    short = cli("quantize", F16_NAME, "--budget", "95MB", "--force", *common)
    assert short.exit_code == 0, short
    s = short.json()[0]
    assert s["error_feedback"] is False and "error feedback needs" in s["feedback_skipped"]
    assert s["name"] == plain["name"] and s["sha256"] == plain["sha256"]
    assert json.loads(Path(s["recipe_file"]).read_text())["feedback_skipped"] == s["feedback_skipped"]
    text = cli("quantize", F16_NAME, "--budget", "95MB", "--force", "--no-progress", *common[:-1])
    assert text.exit_code == 0 and "error feedback: left out (error feedback needs" in text.stdout, text
    monkeypatch.delenv("EDGELLM_FAKE_AVAILABLE_RAM")
    # a model too large to write tokens of its own (quant/selfgen.py's sequences_for: none from ~1.4B weights) is fed
    # back from the calibration text alone: the rewritten matrices still change, and no tokens are written or read
    fed = [p for p, t in recipe["tensor_types"] if t in ("Q8_0", "Q6_K", "Q5_1", "Q5_0", "Q4_0")][:2]
    types = [[p, t if p in fed else "IQ4_NL"] for p, t in recipe["tensor_types"]]
    for fb in (True, False):
        Path(tmp_path / f"few-{fb}.json").write_text(
            json.dumps(dict(recipe, tensor_types=types, feedback=fb, feedback_sequences=0, file=""))
        )
    few = cli("quantize", F16_NAME, "--recipe", str(tmp_path / "few-True.json"), *common[2:]).json()[0]
    none = cli("quantize", F16_NAME, "--recipe", str(tmp_path / "few-False.json"), *common[2:]).json()[0]
    assert len(fed) == 2 and few["size_bytes"] == none["size_bytes"] and few["sha256"] != none["sha256"]
    f = few["feedback_seconds"]
    assert f["sequences"] == 0 and f["tokens"] == 0 and f["matrices"] == 2 and f["inputs"] > 0
    assert len(list((edgellm_home / "selfgen").glob("*.npy"))) == 1
    # the recipe needs the matrix it rounds with; the flag needs --budget
    assert "add --imatrix" in refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", out["recipe_file"], "--force")
    assert "goes with --budget" in refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_0", "--error-feedback")


def test_passes_hold_what_fits_and_a_layer_s_shared_input_once():
    from edgellm.errors import InsufficientResources
    from quant.feedback import FACTOR_COPIES, pass_plan, plan_passes

    cols = {f"blk.{i}.{k}.weight": (1536 if k == "ffn_down" else 576) for i in range(3) for k in ("attn_q", "attn_k", "ffn_down")}
    big, small = 8 * 1536**2, 8 * 576**2
    transient = FACTOR_COPIES * big
    # everything fits: one pass; q and k share one input, so a layer costs small + big
    assert pass_plan(cols, transient + 3 * (small + big)) == [list(cols)]
    # room for two layers' inputs per pass: the third layer waits for a second pass
    two = pass_plan(cols, transient + 2 * (small + big))
    assert [len(p) for p in two] == [6, 3] and all(n.startswith("blk.2.") for n in two[1])
    assert pass_plan({}, 0) == []
    with pytest.raises(InsufficientResources, match="1536-wide inputs of blk.0.ffn_down"):
        pass_plan(cols, transient + big - 1)
    # beside a base that leaves too little, the passes take all that is free (the base is read from disk again)
    base = 10**9
    assert plan_passes(cols, base + transient + 3 * (small + big), base) == [list(cols)]
    assert plan_passes(cols, base + transient + small + big, base) == one_layer_a_pass(cols)
    assert plan_passes(cols, transient + 3 * (small + big), base) == [list(cols)]
    with pytest.raises(InsufficientResources, match="error feedback needs"):
        plan_passes(cols, transient + big - 1, base)


def one_layer_a_pass(cols: dict[str, int]) -> list[list[str]]:
    return [[n for n in cols if n.startswith(f"blk.{i}.")] for i in range(3)]


def test_the_tokens_the_model_writes_repeat_with_their_seed_and_read_as_its_own(f16_model):
    """quant/selfgen.py: each sequence starts at BOS, a seed writes the same tokens again and another seed
    others, and the text is the model's own: its perplexity under the model is that of samples at temperature 1
    (near the model's entropy, far from the vocabulary's 49,152), and it is not one token repeated."""
    from quant.perplexity import LogitsRunner
    from quant.selfgen import generate

    a = generate(f16_model.path, n_seq=3, n_ctx=48, threads=1, seed=1)
    assert a.shape == (3 * 48,) and a.dtype == np.int32
    seqs = a.reshape(3, 48)
    with LogitsRunner(f16_model.path, n_ctx=48, n_seq=1, n_batch=48, threads=1) as r:
        assert (seqs[:, 0] == r.bos).all() and a.min() >= 0 and a.max() < r.n_vocab
    assert np.array_equal(a, generate(f16_model.path, n_seq=3, n_ctx=48, threads=1, seed=1))
    b = generate(f16_model.path, n_seq=3, n_ctx=48, threads=1, seed=2)
    assert not np.array_equal(a, b)
    assert not np.array_equal(seqs[0], seqs[1]) and min(len(set(s)) for s in seqs) > 20

    from quant.perplexity import ChunkPlan

    plan = ChunkPlan(n_ctx=48, n_chunk=3, n_batch=48, n_seq=1, first=0)
    with LogitsRunner(f16_model.path, n_ctx=48, n_seq=1, n_batch=48, threads=1) as r:
        nll = []
        for _i, logits, target in r.chunks(a, plan):
            lp = logits.astype(np.float64)
            lse = np.log(np.exp(lp - lp.max(axis=1, keepdims=True)).sum(axis=1)) + lp.max(axis=1)
            nll.extend(lse - lp[np.arange(len(target)), target])
    ppl = float(np.exp(np.mean(nll)))
    assert 3 < ppl < 2000, ppl


def test_a_recipe_with_no_fed_back_type_writes_no_tokens_and_leaves_the_file(f16_model, session_imatrix, edgellm_home, tmp_path):
    """A Q3_K_M-size recipe can hold no matrix in a type of FED_BACK (x4: none at that size): the feedback then
    plans no pass and must not spend minutes writing tokens it would not use (nor touch the file)."""
    from quant import feedback, rounding
    from quant.imatrix_file import read_imatrix

    run, timing = feedback.prepare(
        f16_model.path, [(".*", "Q4_K")], read_imatrix(session_imatrix), rounding.BUDGET, model_sha256="0" * 64,
        sequences=GEN_SEQS, threads=1,
    )  # fmt: skip
    out = tmp_path / "quantized.gguf"
    out.write_bytes(b"as llama.cpp wrote it")
    run(out)
    assert out.read_bytes() == b"as llama.cpp wrote it"
    assert timing["passes"] == 0 and timing["tokens"] == 0 and timing["matrices"] == 0 and timing["sequences"] == 0
    assert not (edgellm_home / "selfgen").exists()
