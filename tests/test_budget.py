"""`quantize --budget` as a typed job, and where it must win: on a base with no quantization grid.

The default model's F16 is dequantized from Q4_1, which flatters any search that can land on that
grid; scripts/make_wide_model.py --dither removes the grid (docs/quantize.md, "Figures"). The test
here builds that gridless 135M base, and fails if a --budget file at the size of llama-quantize
--imatrix Q4_K_M is not better than it, by mean KLD on WikiText-2 (a text neither the matrix nor
the search saw).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support.helpers import run_ok

ROOT = Path(__file__).resolve().parents[1]
EVAL_CHUNKS = 4


def test_budget_parses_its_input_once(tiny_f32, edgellm_home, monkeypatch):
    """One read_gguf of the input for the whole --budget job (resolve, budget, matrix, search, quantize), on a
    real (tiny, 256-wide) llama: every step runs, the probes included, in seconds."""
    import edgellm.gguf.reader as reader
    import quant._common
    import quant.perplexity
    import quant.quantize_result
    from quant.budget import quantize_to_budget
    from quant.imatrix import compute_imatrix

    matrix = compute_imatrix(tiny_f32, chunks=2, threads=2).path  # its own job, before the count starts
    real, seen = reader.read_gguf, []

    def counting(path, *a, **kw):
        seen.append(Path(path).resolve())
        return real(path, *a, **kw)

    for mod in (reader, quant._common, quant.quantize_result, quant.perplexity):
        monkeypatch.setattr(mod, "read_gguf", counting)
    res, recipe = quantize_to_budget(tiny_f32, budget="5bpw", imatrix=str(matrix), threads=2, feedback=False)
    inp = Path(tiny_f32).resolve()
    assert seen.count(inp) == 1, seen
    others = [p for p in seen if p != inp]  # the one other parse validates the output before its rename
    assert len(others) == 1 and others[0].name.startswith(res.path.name + ".") and others[0].suffix == ".partial"
    assert res.size_bytes <= recipe.budget["bytes"] and recipe.predicted_bytes >= res.size_bytes
    assert recipe.calibration["probes_measured"] > 0
    assert json.loads(Path(recipe.file).read_text())["tensor_types"] == [list(p) for p in recipe.tensor_types]


def _edgellm(home: Path, *args: str) -> object:
    import os

    env = dict(os.environ, EDGELLM_HOME=str(home))
    proc = run_ok(sys.executable, "-m", "edgellm.cli", *args, env=env, timeout=3600)
    return json.loads(proc.stdout) if "--json" in args else proc.stdout


@pytest.mark.slow
def test_budget_beats_imatrix_q4_k_m_on_the_gridless_base(default_gguf, llama_tools, wikitext, tmp_path):
    """--budget at the size of llama-quantize --imatrix Q4_K_M: a lower mean KLD, on a base with no grid, from the
    search alone (--no-error-feedback; the default's feedback only lowers it further, tests/test_feedback.py)."""
    home = tmp_path / "home"
    gridless = tmp_path / "gridless-135m-f16.gguf"
    run_ok(sys.executable, ROOT / "scripts" / "make_wide_model.py", default_gguf, "--factor", "1", "--dither", "-o", gridless)
    _edgellm(home, "import", str(gridless), "--name", "gl-f16", "--link")
    im = _edgellm(home, "imatrix", "gl-f16", "--threads", "2", "--json", "--no-progress")["file"]  # the shipped text
    ref = tmp_path / "ref-q4_k_m.gguf"
    run_ok(llama_tools / "llama-quantize", "--imatrix", im, gridless, ref, "Q4_K_M", "2")
    _edgellm(home, "import", str(ref), "--name", "gl-q4_k_m-imat")
    size = ref.stat().st_size
    out = _edgellm(
        home, "quantize", "gl-f16", "--budget", str(size), "--imatrix", im, "--threads", "2", "--json", "--no-progress",
        "--no-error-feedback",
    )[0]  # fmt: skip
    assert out["size_bytes"] <= size
    rep = _edgellm(
        home,
        "eval",
        "gl-f16",
        "--levels",
        f"gl-q4_k_m-imat,{out['name']}",
        "--text",
        str(wikitext),
        "--ctx",
        "512",
        "--chunks",
        str(EVAL_CHUNKS),
        "--threads",
        "2",
        "--json",
        "--no-progress",
    )
    kld = {lv["name"]: lv["kld_mean"] for lv in rep["levels"]}
    assert kld[out["name"]] < kld["gl-q4_k_m-imat"], kld


def test_a_blown_up_row_counts_at_most_row_cap_medians():
    """IQ3_S's rounding can blow up one row of a matrix: that row must not set the proxy of its whole group."""
    import numpy as np

    from quant.budget import ROW_CAP, proxy_error

    rows = np.ones(256)
    assert proxy_error(rows, 1024) == pytest.approx(1024)  # an even matrix: the sample scaled to all rows
    rows[7] = 1000.0
    assert proxy_error(rows, 1024) == pytest.approx((255 + ROW_CAP) * 4)
    # a matrix whose sampled rows are mostly exact (zero padding rows): the cap comes from the rows with an error
    rows[:200], rows[250] = 0.0, 1000.0
    assert proxy_error(rows, 256) == pytest.approx(55 + ROW_CAP)
    assert proxy_error(np.zeros(256), 256) == 0.0


def test_a_probe_rounds_its_rows_on_every_thread_alike():
    """A probe's rounding is split over the threads in near-equal row ranges: fixed 2,048-row steps left
    a 2,304-row matrix to one thread for 8/9 of its rows and a 768-row one to one thread entirely."""
    from quant.sensitivity import _ROWS_PER_STEP, row_spans

    for rows in (1, 3, 768, 2304, 6144, 49152):
        for threads in (1, 2, 3, 16):
            spans = row_spans(rows, threads)
            assert spans[0][0] == 0 and spans[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:], strict=True))  # contiguous, each row once
            sizes = [b - a for a, b in spans]
            assert max(sizes) <= _ROWS_PER_STEP and max(sizes) - min(sizes) <= 1
            assert len(spans) % threads == 0 or len(spans) == rows  # every thread gets as many ranges
    assert row_spans(2304, 2) == [(0, 1152), (1152, 2304)]
    assert len(row_spans(768, 2)) == 2


def test_a_cached_probe_takes_this_runs_proxy_error():
    from quant.allocate import Matrix
    from quant.budget import with_current_errors
    from quant.sensitivity import ProbeResult

    groups = {
        "ffn_down/2-10": [Matrix(f"blk.{i}.ffn_down.weight", 8, 256, [("Q4_K", 100, 2.0), ("Q6_K", 200, 0.5)]) for i in (2, 3)]
    }
    cached = {
        ("ffn_down/2-10", "Q4_K"): ProbeResult(kld=0.04, kld_err=0.001, error=40.0, matrices=2, seconds=1.0),
        ("ffn_down/2-10", "IQ3_S"): ProbeResult(kld=0.09, kld_err=0.001, error=9.0, matrices=2, seconds=1.0),
    }
    now = with_current_errors(cached, groups)
    assert now[("ffn_down/2-10", "Q4_K")].error == 4.0 and now[("ffn_down/2-10", "Q4_K")].gain == pytest.approx(0.01)
    assert now[("ffn_down/2-10", "IQ3_S")] == cached[("ffn_down/2-10", "IQ3_S")]  # not a candidate now: as cached


def test_a_cached_probe_of_an_excluded_type_lends_no_gain():
    """On the grid base an all-types run caches Q4_1 probes (nearly exact there, so their KLD per unit error is
    noise); a q4_1-excluded run after it must borrow Q5_0's gain from the types it can pick, not from Q4_1."""
    from quant.allocate import Matrix
    from quant.budget import pickable, type_bpw
    from quant.sensitivity import ProbeResult, gain_lookup

    g = "ffn_down/11-19"
    mats = [Matrix("blk.12.ffn_down.weight", 8, 256, [("IQ4_NL", 90, 3.0), ("Q5_0", 110, 1.0), ("Q8_0", 170, 0.1)])]
    cached = {
        (g, "Q4_1"): ProbeResult(kld=3e-6, kld_err=1e-7, error=0.02, matrices=9, seconds=1.0),  # gain 1.5e-4
        (g, "IQ4_NL"): ProbeResult(kld=5e-3, kld_err=1e-4, error=100.0, matrices=9, seconds=1.0),  # gain 5e-5
    }
    assert gain_lookup(cached, type_bpw)(g, "Q5_0") == pytest.approx(1.5e-4)  # Q4_1 is nearest in bits
    mine = pickable(cached, mats)
    assert set(mine) == {(g, "IQ4_NL")}
    assert gain_lookup(mine, type_bpw)(g, "Q5_0") == pytest.approx(5e-5)


def test_refined_rounding_lowers_the_weighted_error_of_its_types_only():
    """The roundings --budget files use (scripts/patches/ggml-quants-refine-k.patch), through llama.cpp's own
    quantizer: on bell-shaped rows with uneven importance, less weighted error than llama.cpp's own blocks
    (docs/quantize.md measures them on model rows). k1 re-chooses Q4_K and Q5_K; k2 is k1 with Q5_K looked at
    further out and IQ4_XS too; other types, and the stock rounding, as before."""
    import numpy as np

    from quant._ggml import ggml
    from quant.recipe import TYPES
    from quant.rounding import REFINED, REFINED_K1, STOCK

    rng = np.random.default_rng(0)
    rows = np.ascontiguousarray(rng.laplace(0, 0.02, (64, 1536)) * rng.uniform(0.5, 2.0, (64, 1)), np.float32)
    imp = np.ascontiguousarray(rng.gamma(0.7, 1.0, 1536), np.float32)
    g = ggml()

    def err(type_name: str, rounding: str) -> tuple[float, bytes]:
        tid = TYPES[type_name][0]
        with g.rounding(rounding):
            q = g.quantize(tid, rows, imp)
        back = g.to_float(tid, q, rows.shape)
        assert np.isfinite(back).all()
        return float((np.square(rows - back, dtype=np.float64) * imp).sum()), q.tobytes()

    kinds = ("Q4_K", "Q5_K", "IQ4_XS", "Q6_K", "Q8_0")
    stock = {t: err(t, STOCK) for t in kinds}
    k1 = {t: err(t, REFINED_K1) for t in kinds}
    k2 = {t: err(t, REFINED) for t in kinds}
    assert k1["Q4_K"][0] < 0.985 * stock["Q4_K"][0], (k1["Q4_K"][0], stock["Q4_K"][0])
    assert k1["Q5_K"][0] < 0.96 * stock["Q5_K"][0], (k1["Q5_K"][0], stock["Q5_K"][0])
    assert k2["Q5_K"][0] < 0.99 * k1["Q5_K"][0], (k2["Q5_K"][0], k1["Q5_K"][0])
    assert k2["IQ4_XS"][0] < 0.99 * stock["IQ4_XS"][0], (k2["IQ4_XS"][0], stock["IQ4_XS"][0])
    assert k2["Q4_K"][1] == k1["Q4_K"][1]  # k2 leaves Q4_K as k1 rounds it
    assert k1["IQ4_XS"][1] == stock["IQ4_XS"][1]  # and k1 is what it was: its recipes still reproduce
    for t in ("Q6_K", "Q8_0"):
        assert k1[t][1] == stock[t][1] == k2[t][1]
    assert err("Q4_K", STOCK)[1] == stock["Q4_K"][1]  # the switch went back off
    # without an importance matrix llama.cpp rounds by another path, which the switch leaves alone
    for t in ("Q4_K", "IQ4_XS"):
        with g.rounding(REFINED):
            plain = g.quantize(TYPES[t][0], rows, None)
        assert plain.tobytes() == g.quantize(TYPES[t][0], rows, None).tobytes()
