"""scripts/make_wide_model.py: the larger test models compute the default model's function.

The bounded slice of issue "At the sizes users run": factor 2 (0.54B, 1.1 GB
F16) here; the 1.93B and 7.3B models are made by scripts/bench_scale.py.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support.helpers import ROOT

SCRIPT = ROOT / "scripts" / "make_wide_model.py"
PROMPTS = ("Name three colours.", "What is the capital of France?")


def run_script(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def reply(cli_subprocess, model: Path, prompt: str) -> str:
    res = cli_subprocess(
        "chat", str(model), "-p", prompt, "--temperature", "0", "--max-tokens", "32", "--no-history", "--ctx", "512", "--json"
    )
    assert res.exit_code == 0, res.stderr
    return res.json()["reply"]


@pytest.fixture(scope="module")
def wide_x2(default_gguf, tmp_path_factory) -> Iterator[tuple[Path, str]]:
    out = tmp_path_factory.mktemp("wide") / "wide-x2-f16.gguf"
    res = run_script(default_gguf, "--factor", "2", "-o", out)
    assert res.returncode == 0, res.stderr
    yield out, res.stdout
    shutil.rmtree(out.parent, ignore_errors=True)  # 1.1 GB: not kept for the rest of the session


def test_factor_2_doubles_every_unit_and_passes_its_own_check(wide_x2, default_gguf):
    from edgellm.gguf.reader import read_gguf

    out, stdout = wide_x2
    base, wide = read_gguf(default_gguf), read_gguf(out)
    assert (wide.embedding_length, wide.head_count, wide.head_count_kv) == (
        2 * base.embedding_length,
        2 * base.head_count,
        2 * base.head_count_kv,
    )
    assert wide.block_count == base.block_count and wide.vocab_size == base.vocab_size
    assert base.tied_output and not wide.tied_output  # the output matrix is untied: embedding / F
    # 4x every matrix, 2x the embedding, plus the untied output (the embedding's size again, x2)
    emb = base.vocab_size * base.embedding_length
    assert wide.parameters == pytest.approx(4 * (base.parameters - emb) + 4 * emb, rel=0.01)
    assert 0.53e9 < wide.parameters < 0.55e9
    line = next(ln for ln in stdout.splitlines() if "check:" in ln)
    rel = float(line.split("relative difference ")[1].split()[0])
    assert rel <= 1e-3 and "the same function" in line


def test_a_wider_model_writes_fewer_tokens_of_its_own_for_error_feedback(wide_x2, default_gguf):
    """quant/selfgen.py gives each model the forward work the default model's sequences take: the x2 model (4x its
    matrices' weights) writes fewer, in whole steps, and none would come from x4 (1.93B; docs/quantize.md)."""
    from quant.selfgen import GEN_SEQS, GEN_STEP, sequences_for

    assert sequences_for(default_gguf) == GEN_SEQS
    x2 = sequences_for(wide_x2[0])
    assert 0 < x2 < GEN_SEQS and x2 % GEN_STEP == 0


def test_factor_2_gives_the_base_reply_at_temperature_0(wide_x2, f16_session, cli_subprocess):
    base_f16 = f16_session[0].path
    for prompt in PROMPTS:
        expected = reply(cli_subprocess, base_f16, prompt)
        assert len(expected) > 20
        assert reply(cli_subprocess, wide_x2[0], prompt) == expected


def _block_values(path: Path, name: str, n_blocks: int) -> np.ndarray:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    return dequantize(t.data, t.tensor_type).reshape(-1, 32)[:n_blocks].astype(np.float32)


def test_dither_fills_each_block_and_stays_within_half_a_step(default_gguf, f16_session, tmp_path):
    out = tmp_path / "gridless.gguf"
    res = run_script(default_gguf, "--factor", "1", "--dither", "--seed", "7", "--no-check", "-o", out)
    assert res.returncode == 0, res.stderr
    name = "blk.3.ffn_down.weight"  # Q4_1 in the default model: at most 16 values per block of 32
    base = _block_values(f16_session[0].path, name, 2000)
    dithered = _block_values(out, name, 2000)
    distinct_base = np.mean([len(np.unique(b)) for b in base])
    distinct_dithered = np.mean([len(np.unique(b)) for b in dithered])
    assert distinct_base <= 16 and distinct_dithered > 30
    # the noise is at most half of the block's own step (Q4_1: (max - min) / 15), plus F16 rounding
    step = (base.max(axis=1) - base.min(axis=1)) / 15
    excess = np.abs(dithered - base) - (step[:, None] / 2 + 2e-3 * np.abs(base) + 1e-6)
    assert (excess <= 0).all()
    # seeded: the same seed gives the same bytes, another seed other bytes
    again, other = tmp_path / "again.gguf", tmp_path / "other.gguf"
    assert run_script(default_gguf, "--factor", "1", "--dither", "--seed", "7", "--no-check", "-o", again).returncode == 0
    assert run_script(default_gguf, "--factor", "1", "--dither", "--seed", "8", "--no-check", "-o", other).returncode == 0
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (out, again, other)]
    assert digest[0] == digest[1] != digest[2]
    # the F16 holds no block steps: dithering it would write the grid base under a "dithered" name
    from_f16 = run_script(f16_session[0].path, "--factor", "1", "--dither", "--no-check", "-o", tmp_path / "f16d.gguf")
    assert from_f16.returncode == 2 and "--dither needs a base whose matrices are stored in" in from_f16.stderr
    assert len(from_f16.stderr.strip().splitlines()) == 1 and not list(tmp_path.glob("f16d*"))


def test_other_architectures_and_bad_input_are_one_line_errors(tmp_path):
    from gguf import GGUFWriter

    gpt2 = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(gpt2), arch="gpt2")
    w.add_uint32("general.file_type", 0)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    res = run_script(gpt2, "--factor", "2", "-o", tmp_path / "out.gguf")
    assert res.returncode == 2
    assert res.stderr.strip() == "error: only llama-architecture GGUFs can be widened; this one is 'gpt2'"
    assert not list(tmp_path.glob("out*"))
    missing = run_script(tmp_path / "nope.gguf", "-o", tmp_path / "out.gguf")
    assert missing.returncode == 2 and missing.stderr.strip().startswith("error: no such file")
