"""edgellm imatrix and quantize --imatrix on the real default model's F16, against llama.cpp's own tools.

The agreement and byte-identity tests use a few chunks to stay short; the
full-size figures come from scripts/bench_imatrix.py (docs/quantize.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from quant import rounding
from support.eval_reports import eval_report, level_eval
from support.helpers import assert_one_line_error, run_ok, start_cli, store_snapshot
from support.quant_fixtures import F16_NAME, f16_model, f16_session  # noqa: F401 (fixtures)

CHUNKS = 2
_cache: dict[str, object] = {}


def _sha(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def f16_path(f16_session) -> Path:
    return Path(f16_session[0].path)


@pytest.fixture(scope="session")
def session_imatrix(f16_path, tmp_path_factory) -> Path:
    """edgellm's matrix of the F16 on the shipped text, CHUNKS x 512, computed once."""
    if "mine" not in _cache:
        from quant.imatrix import compute_imatrix

        home = tmp_path_factory.mktemp("imatrix-home")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EDGELLM_HOME", str(home))
            rec = compute_imatrix(f16_path, chunks=CHUNKS, threads=2)
        _cache["mine"] = rec.path
    return _cache["mine"]  # type: ignore[return-value]


@pytest.fixture(scope="session")
def reference_imatrix(f16_path, llama_tools, tmp_path_factory) -> Path:
    """llama-imatrix of the same tree, same file, text, ctx and chunks."""
    from quant.imatrix import calibration_path

    out = tmp_path_factory.mktemp("llama-imatrix") / "ref.gguf"
    # session_imatrix's text, ctx, chunks and threads
    as_ours = ["-f", calibration_path(), "-c", "512", "--chunks", CHUNKS, "-t", "2"]
    run_ok(llama_tools / "llama-imatrix", "-m", f16_path, *as_ours, "--no-ppl", "-o", out)
    return out


# -- the matrix --------------------------------------------------------------


def test_imatrix_cli_stores_with_lineage(cli, f16_model, edgellm_home):
    from quant.imatrix_file import read_imatrix

    before = store_snapshot(edgellm_home)
    res = cli("imatrix", F16_NAME, "--chunks", "1", "--threads", "2", "--json")
    assert res.exit_code == 0, res
    rec = res.json()
    assert rec["name"] == f"{F16_NAME}-imatrix" and rec["model"] == F16_NAME
    assert rec["model_sha256"] == f16_model.sha256
    assert rec["text"] == "edgellm-calibration.txt" and len(rec["text_sha256"]) == 64
    assert rec["chunks"] == 1 and rec["ctx"] == 512 and rec["tokens"] == 512 and rec["text_tokens"] > 5000
    # SmolLM2-135M: 30 layers x (q, k, v, o, gate, up, down), and the output layer, tied: token_embd
    assert rec["entries"] == 211 and rec["output"] is True
    m = read_imatrix(rec["file"])
    assert len(m.entries) == 211 and m.chunk_count == 1 and m.chunk_size == 512
    assert m.datasets == ["edgellm-calibration.txt"]
    for name, e in m.entries.items():
        assert e.counts.tolist() == [512], name
        assert (e.sums > 0).all() and np.isfinite(e.sums).all()
    assert m.entries["blk.0.ffn_down.weight"].sums.shape == (1, 1536)
    assert m.entries["blk.0.attn_q.weight"].sums.shape == (1, 576)
    assert m.entries["token_embd.weight"].sums.shape == (1, 576)  # the output layer's input: the last hidden state
    # the lineage file beside it, and --list
    side = json.loads(Path(rec["file"]).with_suffix(".json").read_text())
    assert side["text_sha256"] == rec["text_sha256"]
    listed = cli("imatrix", "--list", "--json").json()
    assert [r["name"] for r in listed] == [rec["name"]]
    # the model store is untouched: a matrix is not a model
    assert store_snapshot(edgellm_home)[0] == before[0]
    again = cli("imatrix", F16_NAME, "--chunks", "1")
    assert_one_line_error(again)
    assert "already exists" in again.stderr
    # llama-imatrix's default entries, exactly: no output layer
    plain = cli("imatrix", F16_NAME, "--chunks", "1", "--threads", "2", "--no-process-output", "--name", "plain", "--json")
    assert plain.exit_code == 0, plain
    assert plain.json()["entries"] == 210 and plain.json()["output"] is False
    assert "token_embd.weight" not in read_imatrix(plain.json()["file"]).entries


def test_imatrix_cli_delete_removes_both_files(cli, f16_model, edgellm_home):
    made = cli("imatrix", F16_NAME, "--chunks", "1", "--threads", "2", "--json")
    assert made.exit_code == 0, made
    name = made.json()["name"]
    res = cli("imatrix", "--delete", name, "--json")
    assert res.exit_code == 0, res
    assert res.json() == made.json()  # the record as it was
    assert list((edgellm_home / "imatrix").iterdir()) == []
    assert cli("imatrix", "--list", "--json").json() == []
    for args in (["--delete", name], ["--delete", "../index"], ["--delete", name, F16_NAME]):
        again = cli("imatrix", *args)
        assert_one_line_error(again)
    assert "no importance matrix named" in cli("imatrix", "--delete", name).stderr


def test_matches_llama_imatrix(session_imatrix, reference_imatrix):
    """Same sums and counts as llama-imatrix built from the same tree (per tensor, relative <= 1e-4); the
    output layer's entry is ours alone (llama-imatrix never collects a tied output)."""
    from quant.imatrix_file import read_imatrix

    mine, ref = read_imatrix(session_imatrix), read_imatrix(reference_imatrix)
    assert sorted(mine.entries) == sorted([*ref.entries, "token_embd.weight"]) and len(ref.entries) == 210
    assert (mine.chunk_count, mine.chunk_size) == (ref.chunk_count, ref.chunk_size) == (CHUNKS, 512)
    worst = 0.0
    for name, r in ref.entries.items():
        m = mine.entries[name]
        assert m.counts.tolist() == r.counts.tolist() == [CHUNKS * 512], name
        rel = float(np.abs(m.sums - r.sums).max() / np.abs(r.sums).max())
        worst = max(worst, rel)
    print(f"largest per-tensor relative difference vs llama-imatrix: {worst:.2e}")
    assert worst <= 1e-4


def test_quant_with_imatrix_is_byte_identical_to_llama_quantize(
    cli, f16_model, f16_path, reference_imatrix, llama_tools, tmp_path, edgellm_home
):
    """The same file through `quantize --imatrix` and `llama-quantize --imatrix`: the same bytes.
    q2_k_s is one of the levels only an importance matrix makes possible."""
    res = cli(
        "quantize", F16_NAME, "-l", "q4_k_m", "-l", "q2_k_s", "--imatrix", str(reference_imatrix), "--threads", "2", "--json"
    )
    assert res.exit_code == 0, res
    out = {o["level"]: o for o in res.json()}
    for level in ("q4_k_m", "q2_k_s"):
        o = out[level]
        assert o["name"] == f"smollm2-135m-instruct-{level}-imat"
        assert o["imatrix"]["file"] == str(reference_imatrix) and o["imatrix"]["sha256"] == _sha(reference_imatrix)
        ref = tmp_path / f"ref-{level}.gguf"
        run_ok(llama_tools / "llama-quantize", "--imatrix", reference_imatrix, f16_path, ref, level.upper(), "2", timeout=900)
        assert o["sha256"] == _sha(ref), level
    # lineage in the store and in inspect
    from edgellm.models.store import Store

    rec = Store().get("smollm2-135m-instruct-q4_k_m-imat")
    assert rec.extra["imatrix"]["sha256"] == _sha(reference_imatrix)
    shown = cli("inspect", "smollm2-135m-instruct-q4_k_m-imat", "--json")
    assert shown.exit_code == 0, shown
    d = shown.json()
    # llama.cpp's quantize.imatrix.* keys in the file, and edgellm's lineage in the store
    assert d["imatrix"]["file"] == str(reference_imatrix) and d["imatrix"]["entries_count"] == 210
    assert d["imatrix"]["chunks_count"] == CHUNKS and d["imatrix_lineage"]["sha256"] == _sha(reference_imatrix)


def test_the_output_entry_reaches_llama_quantize(f16_path, session_imatrix, reference_imatrix, llama_tools, tmp_path):
    """The tied output's entry (ours alone) is read by llama-quantize: the token_embd it rounds to Q5_1 differs
    from the one rounded with llama-imatrix's file, and has the lower error weighted by that entry."""
    import gguf

    from quant._ggml import ggml
    from quant.imatrix_file import read_imatrix
    from quant.recipe import TYPES

    w = read_imatrix(session_imatrix).entries["token_embd.weight"].normalized().astype(np.float64)[0]
    x = np.asarray(next(t for t in gguf.GGUFReader(f16_path).tensors if t.name == "token_embd.weight").data, np.float64)
    g, q5_1 = ggml(), TYPES["Q5_1"][0]
    err, raw = {}, {}
    for label, im in (("ours", session_imatrix), ("llama", reference_imatrix)):
        out = tmp_path / f"{label}.gguf"
        run_ok(llama_tools / "llama-quantize", "--imatrix", im, "--token-embedding-type", "q5_1", f16_path, out, "Q8_0", "2")
        t = next(t for t in gguf.GGUFReader(out).tensors if t.name == "token_embd.weight")
        assert t.tensor_type.name == "Q5_1"
        raw[label] = np.asarray(t.data).tobytes()
        q = g.to_float(q5_1, np.frombuffer(raw[label], np.uint8), x.shape).astype(np.float64)
        err[label] = float((w * (q - x) ** 2).sum())
    assert raw["ours"] != raw["llama"]
    print(f"tied output in Q5_1, error weighted by its entry: {err['ours']:.4g} with it, {err['llama']:.4g} without")
    assert err["ours"] < 0.95 * err["llama"], err  # 0.906x on this base


def test_imatrix_changes_the_quant(cli, f16_model, session_imatrix):
    """With a matrix, a level's weights differ from the stock quant: the matrix reaches llama.cpp."""
    res = cli("quantize", F16_NAME, "-l", "q4_0", "--threads", "2", "--json")
    res2 = cli("quantize", F16_NAME, "-l", "q4_0", "--imatrix", str(session_imatrix), "--threads", "2", "--json")
    assert res.exit_code == 0 and res2.exit_code == 0, (res, res2)
    a, b = res.json()[0], res2.json()[0]
    assert a["sha256"] != b["sha256"]
    # llama.cpp's own rule with a matrix: the first n_layer/8 ffn_down of a Q4_0 file go Q4_1 (30 layers: 3)
    assert "Q4_1" not in a["tensor_types"] and b["tensor_types"]["Q4_1"] == 3


# -- refusals ------------------------------------------------------------------


def _refused(cli, home: Path, *args: str) -> str:
    before = store_snapshot(home)
    res = cli(*args)
    assert_one_line_error(res)
    assert store_snapshot(home) == before
    assert not list(home.rglob("*.partial"))
    return res.stderr


def test_level_needing_imatrix_says_how(cli, f16_model, edgellm_home):
    err = _refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "iq2_xs")
    assert "--imatrix auto" in err


def test_imatrix_of_another_model_is_refused(cli, f16_model, session_imatrix, edgellm_home, tmp_path):
    from quant.imatrix import compute_imatrix
    from quant.imatrix_file import IMatrix, encode, read_imatrix
    from support.gguf_files import write_tiny_llama

    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    other = compute_imatrix(tiny, ctx=64, chunks=2, name="tiny-imatrix", threads=2).path
    err = _refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(other))
    # the tiny model's output is its own output.weight, a weight the tied default model lacks
    assert "was not made for" in err and "output.weight" in err
    # without it, the widths differ
    other = compute_imatrix(tiny, ctx=64, chunks=2, name="tiny-blk-imatrix", threads=2, output=False).path
    err = _refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(other))
    assert "was not made for" in err and "256" in err and "576" in err
    # same widths, other names (e.g. another architecture's tensor names)
    m = read_imatrix(session_imatrix)
    renamed = IMatrix({k.replace("attn_q", "attn_qkv"): v for k, v in m.entries.items()}, m.datasets, m.chunk_count, m.chunk_size)
    p = tmp_path / "renamed.gguf"
    p.write_bytes(encode(renamed))
    err = _refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(p))
    assert "was not made for" in err and "attn_qkv" in err


def test_truncated_or_corrupted_imatrix_is_refused(cli, f16_model, session_imatrix, edgellm_home, tmp_path):
    data = Path(session_imatrix).read_bytes()
    cases = {
        "truncated.gguf": data[: len(data) // 2],
        "header.gguf": data[:4] + b"\xff" * 64 + data[68:],
        "empty.gguf": b"",
        "notgguf.gguf": b"hello world, not a matrix" * 10,
    }
    nan = bytearray(data)
    nan[-4096:-4092] = np.array([np.nan], np.float32).tobytes()
    cases["nan.gguf"] = bytes(nan)
    for fname, blob in cases.items():
        p = tmp_path / fname
        p.write_bytes(blob)
        err = _refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(p))
        assert "importance matrix" in err or "imatrix" in err, (fname, err)
    # a model file is not a matrix either
    err = _refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(f16_model.path))
    assert "not 'imatrix'" in err
    err = _refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", "no-such-matrix")
    assert "no importance matrix named" in err


def test_imatrix_bad_text_and_options(cli, f16_model, edgellm_home, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short to make two chunks of context\n")
    assert "needs at least" in _refused(cli, edgellm_home, "imatrix", F16_NAME, "--text", str(short))
    assert "--ctx" in _refused(cli, edgellm_home, "imatrix", F16_NAME, "--ctx", "4")
    assert not (edgellm_home / "imatrix").exists() or not list((edgellm_home / "imatrix").iterdir())


def test_kill_9_during_imatrix_leaves_nothing_and_rerun_works(cli, f16_model, edgellm_home):
    proc = start_cli("imatrix", F16_NAME, "--chunks", "8", "--threads", "2")
    folder = edgellm_home / "imatrix"
    # kill once the first chunk is running (the bar shows "first chunk" before the decode starts)
    deadline = time.monotonic() + 120
    seen = ""
    while time.monotonic() < deadline and "chunk" not in seen:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        if not line and proc.poll() is not None:
            break
        seen += line
    assert "chunk" in seen, seen
    time.sleep(1.0)
    assert proc.poll() is None, "the job ended before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    leftovers = sorted(p.name for p in folder.rglob("*")) if folder.exists() else []
    assert leftovers == []
    assert cli("imatrix", "--list", "--json").json() == []
    res = cli("imatrix", F16_NAME, "--chunks", "1", "--threads", "2", "--json")
    assert res.exit_code == 0, res
    assert sorted(p.name for p in folder.iterdir()) == [f"{F16_NAME}-imatrix.gguf", f"{F16_NAME}-imatrix.json"]


def test_ctrl_c_during_imatrix_cancels_cleanly(f16_model, edgellm_home):
    proc = start_cli("imatrix", F16_NAME, "--chunks", "8", "--threads", "2")
    deadline = time.monotonic() + 120
    seen = ""
    while time.monotonic() < deadline and "chunk" not in seen:
        chunk = proc.stderr.read(16)  # type: ignore[union-attr]
        if not chunk and proc.poll() is not None:
            break
        seen += chunk
    assert "chunk" in seen, seen
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "error: cancelled" in err.splitlines()[-1]
    folder = edgellm_home / "imatrix"
    assert not folder.exists() or list(folder.iterdir()) == []


# -- the calibration text ---------------------------------------------------------


def test_calibration_text_is_stated_and_disjoint_from_wikitext(wikitext):
    from quant.imatrix import calibration_path, calibration_text

    readme = (calibration_path().parent / "README.md").read_text()
    assert "CC0-1.0" in readme and "written for edgellm" in readme
    t = calibration_text()
    assert len(t.data) > 15000
    wiki = wikitext.read_text(encoding="utf-8")
    lines = [ln.strip() for ln in t.data.decode().splitlines() if len(ln.strip()) >= 40]
    assert len(lines) > 100
    shared = [ln for ln in lines if ln in wiki]
    assert shared == []
    # prose, code and dialogue are all there
    text = t.data.decode()
    assert "def " in text and "SELECT" in text and "\"You're the one" in text


# -- --budget and --recipe -------------------------------------------------------------


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
    err = _refused(
        cli, edgellm_home, "quantize", F16_NAME, "--budget", "50MB", "--exclude-types", "q4_1", "--imatrix", str(session_imatrix)
    )
    # every matrix in its cheapest type (IQ2_S where 256 divides the width, else Q4_0) is 71.2 MB here
    assert "below the smallest file" in err and "71.2 MB" in err and "50.0 MB" in err
    assert "unknown type" in _refused(cli, edgellm_home, "quantize", F16_NAME, "--budget", "90MB", "--exclude-types", "q9_9")
    assert "give a size" in _refused(cli, edgellm_home, "quantize", F16_NAME, "--budget", "lots")
    assert "drop --level" in _refused(cli, edgellm_home, "quantize", F16_NAME, "--budget", "90MB", "-l", "q4_0")


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
    )
    assert res.exit_code == 0, res
    out = res.json()[0]
    assert out["name"] == "smollm2-135m-instruct-budget-90mb"
    assert out["size_bytes"] <= budget and out["size_bytes"] > 0.97 * budget  # the budget is used, not wasted
    assert "Q4_1" not in out["tensor_types"]
    assert out["search_seconds"] > 0 and out["quantize_seconds"] > 0
    recipe = json.loads(Path(out["recipe_file"]).read_text())
    assert recipe["architecture"] == "llama" and recipe["excluded_types"] == ["Q4_1"]
    assert len(recipe["tensor_types"]) == 211 and recipe["predicted_bytes"] >= out["size_bytes"]
    assert recipe["imatrix"]["sha256"] == _sha(session_imatrix)
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
        shas[refine] = _sha(ref)
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


def test_recipe_for_another_architecture_or_layout_is_refused(cli, f16_model, edgellm_home, tmp_path):
    from support.gguf_files import write_tiny_llama

    recipe = {"architecture": "qwen2", "tensor_types": [["^blk\\.0\\.attn_q\\.weight$", "Q4_0"]]}
    p = tmp_path / "qwen.json"
    p.write_text(json.dumps(recipe))
    err = _refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", str(p))
    assert "for qwen2 models" in err and "llama" in err
    # same architecture, another layout: SmolLM2's 30 layers on a 2-layer llama
    recipe = {"architecture": "llama", "tensor_types": [[f"^blk\\.{i}\\.attn_q\\.weight$", "Q4_0"] for i in range(30)]}
    p.write_text(json.dumps(recipe))
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    err = _refused(cli, edgellm_home, "quantize", str(tiny), "--recipe", str(p))
    assert "matches no tensor" in err
    p.write_text("{not json")
    assert "not an edgellm recipe" in _refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", str(p))
    p.write_text(json.dumps({"architecture": "llama", "tensor_types": [["^blk\\.(0", "Q4_0"]]}))
    assert "is not a regular expression" in _refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", str(p))
    # IQ2_S on a 1536-wide ffn_down fits its blocks, but llama.cpp quantizes it only with a matrix
    p.write_text(json.dumps({"architecture": "llama", "tensor_types": [["^blk\\.3\\.ffn_down\\.weight$", "IQ2_S"]]}))
    err = _refused(cli, edgellm_home, "quantize", F16_NAME, "--recipe", str(p))
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

    assert Store().find("smollm2-135m-instruct-budget-90mb") is None
    assert not list(edgellm_home.rglob("*.partial"))
    assert not (edgellm_home / "recipes").exists() or not list((edgellm_home / "recipes").iterdir())


def test_eval_plot_marks_edgellm_files_as_their_own_series(tmp_path):
    from quant.evaluate import is_edgellm_recipe, level_tag, write_plot

    levels = [
        level_eval("m-q2_k", "q2_k", 88_201_792, 0.41),
        level_eval("m-q2_k-imat", "q2_k", 88_202_080, 0.27),
        level_eval("m-budget-88mb", "q4_k_m", 88_188_256, 0.06),
        level_eval("m-q4_k_m", "q4_k_m", 105_454_144, 0.06),
    ]
    assert [is_edgellm_recipe(x.name) for x in levels] == [False, True, True, False]
    rep = eval_report(levels)
    assert [level_tag(rep, x) for x in levels] == ["q2_k", "q2_k-imat", "budget-88mb", "q4_k_m"]
    out = write_plot(rep, tmp_path / "frontier.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
