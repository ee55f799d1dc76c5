"""edgellm imatrix and quantize --imatrix on the real default model's F16, against llama.cpp's own tools.

The agreement and byte-identity tests use a few chunks to stay short; the
full-size figures come from scripts/bench_imatrix.py (docs/quantize.md).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np

from edgellm.fsutil import sha256_file
from support.eval_reports import eval_report, level_eval
from support.helpers import assert_one_line_error, refused, run_ok, start_cli, store_snapshot
from support.quant_fixtures import F16_NAME, IMATRIX_CHUNKS, f16_model, f16_session  # noqa: F401 (fixtures)

CHUNKS = IMATRIX_CHUNKS


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
        assert o["imatrix"]["file"] == str(reference_imatrix) and o["imatrix"]["sha256"] == sha256_file(reference_imatrix)
        ref = tmp_path / f"ref-{level}.gguf"
        run_ok(llama_tools / "llama-quantize", "--imatrix", reference_imatrix, f16_path, ref, level.upper(), "2", timeout=900)
        assert o["sha256"] == sha256_file(ref), level
    # lineage in the store and in inspect
    from edgellm.models.store import Store

    rec = Store().get("smollm2-135m-instruct-q4_k_m-imat")
    assert rec.extra["imatrix"]["sha256"] == sha256_file(reference_imatrix)
    shown = cli("inspect", "smollm2-135m-instruct-q4_k_m-imat", "--json")
    assert shown.exit_code == 0, shown
    d = shown.json()
    # llama.cpp's quantize.imatrix.* keys in the file, and edgellm's lineage in the store
    assert d["imatrix"]["file"] == str(reference_imatrix) and d["imatrix"]["entries_count"] == 210
    assert d["imatrix"]["chunks_count"] == CHUNKS and d["imatrix_lineage"]["sha256"] == sha256_file(reference_imatrix)


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


def test_level_needing_imatrix_says_how(cli, f16_model, edgellm_home):
    err = refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "iq2_xs")
    assert "--imatrix auto" in err


def test_imatrix_of_another_model_isrefused(cli, f16_model, session_imatrix, edgellm_home, tmp_path):
    from quant.imatrix import compute_imatrix
    from quant.imatrix_file import IMatrix, encode, read_imatrix
    from support.gguf_files import write_tiny_llama

    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    other = compute_imatrix(tiny, ctx=64, chunks=2, name="tiny-imatrix", threads=2).path
    err = refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(other))
    # the tiny model's output is its own output.weight, a weight the tied default model lacks
    assert "was not made for" in err and "output.weight" in err
    # without it, the widths differ
    other = compute_imatrix(tiny, ctx=64, chunks=2, name="tiny-blk-imatrix", threads=2, output=False).path
    err = refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(other))
    assert "was not made for" in err and "256" in err and "576" in err
    # same widths, other names (e.g. another architecture's tensor names)
    m = read_imatrix(session_imatrix)
    renamed = IMatrix({k.replace("attn_q", "attn_qkv"): v for k, v in m.entries.items()}, m.datasets, m.chunk_count, m.chunk_size)
    p = tmp_path / "renamed.gguf"
    p.write_bytes(encode(renamed))
    err = refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(p))
    assert "was not made for" in err and "attn_qkv" in err


def test_truncated_or_corrupted_imatrix_isrefused(cli, f16_model, session_imatrix, edgellm_home, tmp_path):
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
        err = refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(p))
        assert "importance matrix" in err or "imatrix" in err, (fname, err)
    # a model file is not a matrix either
    err = refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", str(f16_model.path))
    assert "not 'imatrix'" in err
    err = refused(cli, edgellm_home, "quantize", F16_NAME, "-l", "q4_k_m", "--imatrix", "no-such-matrix")
    assert "no importance matrix named" in err


def test_imatrix_bad_text_and_options(cli, f16_model, edgellm_home, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short to make two chunks of context\n")
    assert "needs at least" in refused(cli, edgellm_home, "imatrix", F16_NAME, "--text", str(short))
    assert "--ctx" in refused(cli, edgellm_home, "imatrix", F16_NAME, "--ctx", "4")
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
