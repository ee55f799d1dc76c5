"""`quantize --budget` and `--recipe` on the default model's F16: sizes, the recipe and what reproduces it,
the in-memory probe, refusals, kill -9. Where --budget must win is tests/test_budget.py (the gridless base).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from edgellm.fsutil import sha256_file
from quant import rounding
from support.helpers import refused, run_ok, start_cli
from support.quant_fixtures import F16_NAME, f16_model, f16_session  # noqa: F401 (fixtures)


def test_budget_sizes_parse(monkeypatch):
    from types import SimpleNamespace

    from edgellm.errors import UsageError
    from quant.budget import parse_budget

    info = SimpleNamespace(
        parameters=134_515_008,
        embedding_length=576,
        head_count=9,
        head_count_kv=3,
        block_count=30,
        context_length=8192,
        vocab_size=49152,
        tensor_bytes=0,
    )
    assert parse_budget("100MB", info).bytes == 100_000_000
    assert parse_budget("95.5 MiB", info).bytes == int(95.5 * 2**20)
    assert parse_budget("88201792", info).bytes == 88_201_792
    assert parse_budget("4.5bpw", info).bytes == int(4.5 * 134_515_008 / 8)
    # `ram`: the load guard's estimate solved for the weights, on the RAM available now.
    from edgellm.engine.memory import Shape, estimate

    monkeypatch.setenv("EDGELLM_FAKE_AVAILABLE_RAM", str(2_000_000_000))
    ram = parse_budget("ram", info)
    assert ram.bytes == 2_000_000_000 - estimate(Shape.of(info, tensor_bytes=0), ctx=4096).total_bytes
    # a file of that size is exactly what the load guard accepts
    assert estimate(Shape.of(info, tensor_bytes=ram.bytes), ctx=4096).total_bytes == 2_000_000_000
    assert "4096-token KV cache" in ram.text
    with pytest.raises(UsageError):
        parse_budget("100 parsecs", info)


def test_budget_below_smallest_file_names_the_minimum(cli, f16_model, session_imatrix, edgellm_home):
    err = refused(
        cli, edgellm_home, "quantize", F16_NAME, "--budget", "50MB", "--exclude-types", "q4_1", "--imatrix", str(session_imatrix)
    )
    # every matrix in its cheapest type (IQ2_S where 256 divides the width, else Q4_0) is 71.2 MB here
    assert "below the smallest file" in err and "71.2 MB" in err and "50.0 MB" in err
    assert "unknown type" in refused(cli, edgellm_home, "quantize", F16_NAME, "--budget", "90MB", "--exclude-types", "q9_9")
    assert "give a size" in refused(cli, edgellm_home, "quantize", F16_NAME, "--budget", "lots")
    assert "drop --level" in refused(cli, edgellm_home, "quantize", F16_NAME, "--budget", "90MB", "-l", "q4_0")


def test_budget_fits_records_its_recipe_and_the_recipe_reproduces_it(
    cli, f16_model, session_imatrix, edgellm_home, llama_tools, f16_path, tmp_path
):
    budget = 90_000_000
    res = cli(
        "quantize",
        F16_NAME,
        "--budget",
        "90MB",
        "--exclude-types",
        "q4_1",
        "--imatrix",
        str(session_imatrix),
        "--threads",
        "2",
        "--json",
        "--no-error-feedback",  # llama-quantize reproduces its file below; one fed back it cannot
    )
    assert res.exit_code == 0, res
    out = res.json()[0]
    assert out["name"] == "smollm2-135m-instruct-budget-90mb" and out["error_feedback"] is False
    assert out["size_bytes"] <= budget and out["size_bytes"] > 0.97 * budget  # the budget is used, not wasted
    assert "Q4_1" not in out["tensor_types"]
    assert out["search_seconds"] > 0 and out["quantize_seconds"] > 0
    recipe = json.loads(Path(out["recipe_file"]).read_text())
    assert recipe["architecture"] == "llama" and recipe["excluded_types"] == ["Q4_1"]
    assert len(recipe["tensor_types"]) == 211 and recipe["predicted_bytes"] >= out["size_bytes"]
    assert recipe["imatrix"]["sha256"] == sha256_file(session_imatrix)
    _check_measured_gains(recipe, f16_path, session_imatrix)
    shown = cli("inspect", out["name"], "--json").json()
    assert shown["recipe"]["file"] == out["recipe_file"]
    # the saved recipe, with the same matrix, gives the same bytes ...
    again = cli(
        "quantize", F16_NAME, "--recipe", out["recipe_file"], "--imatrix", str(session_imatrix), "--threads", "2", "--json"
    )
    assert again.exit_code == 0, again
    assert again.json()[0]["sha256"] == out["sha256"]
    # ... and so does llama-quantize with the recipe's --tensor-type-file twin and the refined rounding, which
    # makes a difference: the recipe has K-quant matrices (ffn_down, 1,536 wide) whose blocks it rounds anew
    assert recipe["rounding"] == out["rounding"] == rounding.BUDGET
    assert {"Q4_K", "Q5_K"} & set(out["tensor_types"]), out["tensor_types"]
    types = Path(out["recipe_file"]).with_suffix(".txt")
    shas = {}
    for refine in (str(rounding.level(rounding.BUDGET)), "0"):
        ref = tmp_path / f"ref-{refine}.gguf"
        run_ok(
            llama_tools / "llama-quantize",
            "--imatrix",
            session_imatrix,
            "--tensor-type-file",
            types,
            f16_path,
            ref,
            "Q4_K_M",
            "2",
            env=dict(os.environ, GGML_QUANT_REFINE=refine),
            timeout=900,
        )
        shas[refine] = sha256_file(ref)
    assert shas[str(rounding.level(rounding.BUDGET))] == out["sha256"] and shas["0"] != out["sha256"]


def _check_measured_gains(recipe: dict, f16_path: Path, imatrix: Path) -> None:
    """The recipe's gains were measured on the shipped calibration text, per group and type, and differ as
    measured; every type the recipe uses was measured in its tensor's group or is named as borrowed."""
    from quant.imatrix import calibration_text
    from quant.sensitivity import group_of

    cal = recipe["calibration"]
    assert cal["probes_measured"] > 0 and cal["probes_cached"] == 0 and 0 < cal["seconds"] < recipe["search_seconds"]
    assert cal["text_sha256"] == calibration_text().sha256  # the imatrix's text, never an evaluation text
    # 7 kinds x 6 slices of the 30 layers (0, 1, 2-10, 11-19, 20-28, 29), and the tied embedding/output matrix
    assert len(cal["groups"]) == 43
    probed = [r for per in cal["groups"].values() for r in per.values()]
    assert probed and all(r["kld"] > 0 and r["error"] > 0 for r in probed)
    # the search stops after quant.budget.MAX_ROUNDS: a pick of the last round that no round measured borrows its
    # group's nearest measured gain, and says so; such picks stay a small minority of the recipe
    n_borrowed = 0
    for pattern, t in recipe["tensor_types"]:
        name = pattern[1:-1].replace("\\.", ".")
        g = group_of(name, 30)
        assert cal["groups"][g], g
        if t not in cal["groups"][g]:
            assert t in cal["borrowed"].get(g, []), (name, t, cal["borrowed"])
            n_borrowed += 1
    assert n_borrowed <= len(recipe["tensor_types"]) // 10, cal["borrowed"]
    # per unit of proxy error, the first layers' attn_v moves the logits >10x more than the last layers' attn_output
    gv = max(r["gain"] for r in cal["groups"]["attn_v/0"].values())
    go = max(r["gain"] for r in cal["groups"]["attn_output/20-28"].values())
    assert gv > 10 * go


def test_in_memory_probe_writes_llama_cpps_rounding_and_restores_the_weights(f16_path, session_imatrix, edgellm_home):
    """A probe rounds a group as llama_model_quantize would, computes with it, and puts the F16 back."""
    from edgellm.errors import Cancelled
    from edgellm.gguf.layout import read_tensors
    from edgellm.progress import CancelToken
    from quant import sensitivity
    from quant._ggml import ggml
    from quant.imatrix_file import read_imatrix
    from quant.recipe import TYPES

    entries = {n: e.normalized().astype(np.float32) for n, e in read_imatrix(session_imatrix).entries.items()}
    tensors = {t.name: t for t in read_tensors(f16_path).tensors}
    names = [f"blk.{i}.attn_v.weight" for i in range(10)]
    q4, q8 = TYPES["Q4_0"][0], TYPES["Q8_0"][0]
    p = sensitivity.Prober(f16_path, tensors, entries, threads=2, cancel=None)
    try:
        assert p.can_probe(names) and p.can_probe(["token_embd.weight"])
        p._write(names[0], q4)
        src, live = p._target(names[0])
        g = ggml()
        rows = np.ascontiguousarray(src, np.float32)
        want = g.to_float(q4, g.quantize(q4, rows, entries[names[0]]), rows.shape).astype(np.float16)
        assert np.array_equal(live, want) and not np.array_equal(live, src)
        p._restore(names[0])
        assert np.array_equal(live, src)
        a, b, c = p.measure(names, q4), p.measure(names, q4), p.measure(names, q8)
        assert a == b  # deterministic: the weights were restored in between
        assert 0 < c[0] < a[0] / 5  # Q8_0's rounding moves the logits far less than Q4_0's
        assert all(np.array_equal(*p._target(n)) for n in names)
        # a cancel between probes: Cancelled, nothing measured after it
        token, results = CancelToken(), {}

        def on_progress(pr) -> None:
            if pr.done == 1:
                token.cancel()

        todo = [("attn_v/0", "Q4_0", names, 1.0), ("attn_v/0", "Q8_0", names, 0.1), ("attn_k/0", "Q4_0", names, 1.0)]
        with pytest.raises(Cancelled):
            sensitivity.run_probes(p, todo, {"Q4_0": q4, "Q8_0": q8}, results, on_progress=on_progress, cancel=token)
        assert list(results) == [("attn_v/0", "Q4_0")]
    finally:
        p.close()
    # nothing on disk: no probe files at all, and the cache is written only by a finished search
    assert not (edgellm_home / "sensitivity").exists() or not list((edgellm_home / "sensitivity").iterdir())


def test_recipe_for_another_architecture_or_layout_isrefused(cli, f16_model, edgellm_home, tmp_path):
    from support.gguf_files import write_tiny_llama

    recipe = {"architecture": "qwen2", "tensor_types": [["^blk\\.0\\.attn_q\\.weight$", "Q4_0"]]}
    p = tmp_path / "qwen.json"
    p.write_text(json.dumps(recipe))
    err = refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", str(p))
    assert "for qwen2 models" in err and "llama" in err
    # same architecture, another layout: SmolLM2's 30 layers on a 2-layer llama
    recipe = {"architecture": "llama", "tensor_types": [[f"^blk\\.{i}\\.attn_q\\.weight$", "Q4_0"] for i in range(30)]}
    p.write_text(json.dumps(recipe))
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    err = refused(cli, edgellm_home, "quantize", str(tiny), "--recipe", str(p))
    assert "matches no tensor" in err
    p.write_text("{not json")
    assert "not an edgellm recipe" in refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", str(p))
    p.write_text(json.dumps({"architecture": "llama", "tensor_types": [["^blk\\.(0", "Q4_0"]]}))
    assert "is not a regular expression" in refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", str(p))
    # IQ2_S on a 1536-wide ffn_down fits its blocks, but llama.cpp quantizes it only with a matrix
    p.write_text(json.dumps({"architecture": "llama", "tensor_types": [["^blk\\.3\\.ffn_down\\.weight$", "IQ2_S"]]}))
    err = refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", str(p))
    assert "IQ2_S" in err and "--imatrix auto" in err


def test_kill_9_during_budget_search_leaves_nothing(cli, f16_model, session_imatrix, edgellm_home):
    proc = start_cli("quantize", F16_NAME, "--budget", "90MB", "--imatrix", str(session_imatrix), "--threads", "2")
    deadline = time.monotonic() + 120
    seen = ""
    while time.monotonic() < deadline and "sensitivity" not in seen:
        chunk = proc.stderr.read(64)  # type: ignore[union-attr]  (the bar redraws in place: no newlines)
        if not chunk and proc.poll() is not None:
            break
        seen += chunk
    assert "sensitivity" in seen, seen[-500:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    from edgellm.models.store import Store

    # the name it would have had, with error feedback (the default) and without
    assert Store().find("smollm2-135m-instruct-budget-90mb-fb") is None
    assert Store().find("smollm2-135m-instruct-budget-90mb") is None
    assert not list(edgellm_home.rglob("*.partial"))
    assert not (edgellm_home / "recipes").exists() or not list((edgellm_home / "recipes").iterdir())


def test_search_cost_adds_the_last_fed_back_job_s_feedback(f16_model, edgellm_home):
    """The cost line a search shows before it runs (the TUI's): the error feedback that follows by default, as the
    base's newest fed-back job took it, its tokens left out once quant/selfgen.py keeps them."""
    from edgellm.models.store import Store
    from quant.imatrix import model_sha256
    from quant.recipe import recipes_folder, resolve_base
    from quant.search_cost import search_cost
    from quant.selfgen import _cache_file

    src = resolve_base(F16_NAME, Store())
    folder = recipes_folder()
    folder.mkdir(parents=True, exist_ok=True)
    plain = {
        "architecture": "llama",
        "tensor_types": [["^output\\.weight$", "Q8_0"]],
        "model": src.label,
        "search_seconds": 60.0,
        "calibration": {"probes_measured": 10, "probes_cached": 0, "probe_seconds": 50.0},
    }
    (folder / "a-plain.json").write_text(json.dumps(plain))
    cost = search_cost(F16_NAME, "auto")
    assert cost.feedback_seconds is None and "error feedback" not in cost.describe(), cost
    timing = {"tokens": 57.0, "tokens_cached": 0.0, "inputs": 70.0, "rewrite": 54.0, "matrices": 192.0, "passes": 1.0}
    fed = folder / "b-fb.json"
    fed.write_text(json.dumps(dict(plain, feedback=True, feedback_sequences=20, feedback_seconds={**timing, "sequences": 20.0})))
    os.utime(fed, (time.time() + 5,) * 2)  # the newest
    cost = search_cost(F16_NAME, "auto")
    assert cost.feedback_seconds == 181.0 and "then error feedback ~3.0 min (as in b-fb)" in cost.describe(), cost
    assert "search ~" in cost.describe()  # the search's own estimate is still there, from the same recipes
    # the job's tokens kept for the next one: the pass and the rewrite only
    kept = _cache_file(model_sha256(src.resolved), 20)
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(b"")
    assert search_cost(F16_NAME, "auto").feedback_seconds == 124.0
