"""A bounded slice of scripts/fuzz_gguf.py: malformed GGUFs through every command.

The full run (>= 500 files) is `scripts/fuzz_gguf.py --count 500`; its counts
are in docs/hardening.md. Here a seeded slice keeps the suite fast but still
covers every mutation family on both the tiny model and the default model.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_gguf", ROOT / "scripts" / "fuzz_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_gguf"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_malformed_file_is_a_one_line_error(default_gguf, capsys):
    fuzz = _load_fuzz()
    rc = fuzz.main(["--count", "60", "--default-cases", "12", "--default-model", str(default_gguf), "--seed", "7", "--json"])
    out = capsys.readouterr().out
    import json

    summary = json.loads(out)
    assert summary["files"] == 60 and summary["from_default_model"] == 12
    assert summary["runs"] == 60 * len(summary["commands"])
    assert summary["failures"] == 0, summary["problems"]
    assert rc == 0


def test_mutation_families_are_all_generated(tmp_path):
    fuzz = _load_fuzz()
    import random

    from support.gguf_files import write_tiny_llama

    data = write_tiny_llama(tmp_path / "t.gguf").read_bytes()
    names = " ".join(c.name for c in fuzz.mutations("tiny", data, random.Random(0)))
    for family in (
        "truncate@",
        "magic=",
        "version=",
        "tensor_count=",
        "kv_count=",
        "strlen-past-eof",
        "arraylen-past-eof",
        "ndims=",
        "dim0=",
        "type=99",
        "offset-past-eof",
        "offset-misaligned",
        "llama.block_count=0",
        "llama.block_count=999",
        "llama.embedding_length=",
        "llama.attention.head_count=",
        "nan:",
        "inf:",
    ):
        assert family in names, family
    assert len(fuzz.mutations("tiny", data, random.Random(0))) > 300


@pytest.mark.parametrize("value", [0, 999])
def test_block_count_lies_are_caught_before_llama_cpp(value, default_gguf, tmp_path, cli):
    # llama.cpp itself aborts (SIGABRT) on these; edgellm must refuse them first.
    fuzz = _load_fuzz()
    import random

    with open(default_gguf, "rb") as fh:
        head = fh.read(4 << 20)
    cases = [
        c
        for c in fuzz.mutations("default", head, random.Random(0), file_size=default_gguf.stat().st_size)
        if c.name == f"default:llama.block_count={value}"
    ]
    assert len(cases) == 1
    f = fuzz.materialize(cases[0], {"default": default_gguf}, tmp_path / "bad.gguf")
    for args in (["inspect", f], ["import", f], ["chat", f, "-p", "hi", "--max-tokens", "2"]):
        res = cli(*args)
        assert res.exit_code != 0
        assert "block_count" in res.stderr, res
