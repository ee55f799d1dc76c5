"""edgellm ppl: equal to llama-perplexity on the real model; one-line errors; cancel."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from support.helpers import DEFAULT_NAME, CancelAfter, assert_one_line_error


def llama_ppl(llama_bin: Path, model: Path, text: Path, *, ctx: int, chunks: int, batch: int, threads: int) -> float:
    proc = subprocess.run(
        [
            str(llama_bin / "llama-perplexity"),
            "-m",
            str(model),
            "-f",
            str(text),
            "-c",
            str(ctx),
            "-b",
            str(batch),
            "--chunks",
            str(chunks),
            "-t",
            str(threads),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", proc.stdout + proc.stderr)
    assert m, f"llama-perplexity gave no estimate: {(proc.stdout + proc.stderr)[-1500:]}"
    return float(m.group(1)), float(m.group(2))


def test_ppl_equals_llama_perplexity(cli, default_model, default_gguf, wikitext, llama_tools):
    from edgellm.engine.runtime import default_threads

    # the one set of settings both tools get, by the names of `edgellm ppl`'s options
    same = {"ctx": 256, "chunks": 4, "batch": 1024, "threads": default_threads()}
    flags = [a for k, v in same.items() for a in (f"--{k}", v)]
    res = cli("ppl", DEFAULT_NAME, "--text", wikitext, *flags, "--json", "--no-progress")
    assert res.exit_code == 0, res
    d = res.json()
    ref, ref_err = llama_ppl(llama_tools, default_gguf, wikitext, **same)
    assert abs(d["ppl"] / ref - 1) < 5e-4, (d["ppl"], ref)
    assert abs(d["ppl_err"] / ref_err - 1) < 1e-3, (d["ppl_err"], ref_err)
    assert d["n_chunks"] == 4 and d["ctx"] == 256 and d["corpus"] == "wiki.test.raw"
    assert d["n_tokens_scored"] == 4 * (256 - 1 - 128)
    assert d["tokens_per_second"] > 0
    assert 5 < d["ppl"] < 200  # a real language model on English text, not noise


def test_batch_layout_does_not_change_the_result(tiny_f32):
    from quant.perplexity import Scoring, perplexity

    # One chunk per decode, 4 chunks per decode, and 2 decodes per chunk: the same PPL.
    a = perplexity(tiny_f32, Scoring(corpus="python-docs", ctx=128, chunks=8, batch=512))
    b = perplexity(tiny_f32, Scoring(corpus="python-docs", ctx=128, chunks=8, batch=128))
    c = perplexity(tiny_f32, Scoring(corpus="python-docs", ctx=128, chunks=8, batch=64))
    assert a.n_tokens_scored == b.n_tokens_scored == c.n_tokens_scored == 8 * 63
    assert abs(a.ppl / b.ppl - 1) < 1e-4 and abs(a.ppl / c.ppl - 1) < 1e-4, (a.ppl, b.ppl, c.ppl)
    assert a.corpus == "python-docs" and a.ppl_err > 0


def test_progress_and_cancel(tiny_f32):
    from edgellm.errors import Cancelled
    from quant.perplexity import Scoring, perplexity

    events = []
    perplexity(tiny_f32, Scoring(corpus="python-docs", ctx=128, chunks=6, batch=256), on_progress=events.append)
    chunk_events = [e for e in events if e.unit == "chunk"]
    assert chunk_events[-1].done == chunk_events[-1].total == 6
    assert "PPL" in chunk_events[-1].message

    stop = CancelAfter(2)
    with pytest.raises(Cancelled):
        perplexity(tiny_f32, Scoring(corpus="python-docs", ctx=128, chunks=8, batch=256), on_progress=stop, cancel=stop.token)
    assert max(stop.seen) < 8


def test_ppl_errors_are_one_line(cli, tiny_f32, tmp_path, monkeypatch):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    short = tmp_path / "short.txt"
    short.write_text("A short text. " * 10)
    for args, needle in (
        (["--text", empty], "empty"),
        (["--text", binary], "binary"),
        (["--text", short, "--ctx", "512"], "needs at least 1024"),
        (["--text", tmp_path / "missing.txt"], "no such file"),
        (["--corpus", "nope"], "unknown corpus"),
        ([], "--text FILE or --corpus NAME"),
        (["--corpus", "python-docs", "--ctx", "8"], "too small"),
        (["--corpus", "python-docs", "--batch", "0"], "--batch"),
        (["--corpus", "python-docs", "--threads", "0"], "--threads"),
        (["--corpus", "python-docs", "--chunks", "0"], "--chunks"),
    ):
        res = cli("ppl", tiny_f32, *args, "--no-progress")
        assert_one_line_error(res)
        assert needle in res.stderr, (needle, res)
    monkeypatch.setenv("EDGELLM_CORPUS_DIR", str(tmp_path / "no-corpora"))
    res = cli("ppl", tiny_f32, "--corpus", "wikitext-2", "--no-progress")
    assert_one_line_error(res)
    assert "not shipped" in res.stderr and "EDGELLM_CORPUS_DIR" in res.stderr


def test_wikitext_corpus_name_resolves(tiny_f32, wikitext, monkeypatch):
    from quant.corpus import load_text

    monkeypatch.setenv("EDGELLM_CORPUS_DIR", str(wikitext.parent.parent))
    t = load_text(corpus="wikitext-2")
    raw = wikitext.read_bytes()
    expected = raw[:-1] if raw.endswith(b"\n") else raw  # llama.cpp's -f drops one trailing newline
    assert t.label == "wikitext-2" and t.data == expected
