"""Tensors must tile the data region: every import path refuses a file whose
declared tensor types or shapes disagree with the bytes they occupy.

The files are the real default model with one byte of its tensor table
patched, the way a mislabelled or hand-edited GGUF looks. llama.cpp itself is
asked too, so the test proves the check refuses what llama.cpp refuses and
accepts what it loads.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

Q4_0, Q4_1, Q8_0, F16, F32 = 2, 3, 8, 1, 0
GAP_TENSOR = "blk.0.ffn_gate.weight"  # Q4_1 [576, 1536] in the default model


def patch_tensor_type(src: Path, dst: Path, tensor: str, new_type: int) -> Path:
    """Copy `src` to `dst` with `tensor`'s type id in the tensor table set to `new_type`."""
    from edgellm.gguf.reader import read_layout

    shutil.copyfile(src, dst)
    layout = read_layout(dst)
    t = next(t for t in layout.tensors if t.name == tensor)
    with open(dst, "r+b") as fh:
        head = fh.read(layout.data_offset)
        key = struct.pack("<Q", len(tensor)) + tensor.encode()
        pos = head.index(key) + len(key) + 4 + 8 * len(t.shape)  # name, n_dims, dims, then the type
        assert struct.unpack_from("<I", head, pos)[0] == t.type_id
        fh.seek(pos)
        fh.write(struct.pack("<I", new_type))
    return dst


def llama_cpp_loads(path: Path) -> bool:
    """Whether llama.cpp's own loader accepts the file (vocab only: the tensor table is still checked)."""
    code = "import sys; from llama_cpp import Llama; Llama(sys.argv[1], vocab_only=True, verbose=False)"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    return proc.returncode == 0


def one_line_error(res) -> str:
    assert res.exit_code != 0, res
    assert "Traceback" not in res.stderr + res.stdout, res
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]  # progress lines may come first
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], res
    return errors[0]


def test_the_real_model_tiles_and_llama_cpp_loads_it(default_gguf):
    from edgellm.gguf.layout import _check_header, _parse
    from edgellm.gguf.validate import check_tiling

    size = _check_header(default_gguf)
    parsed = _parse(default_gguf, size)
    check_tiling(default_gguf, parsed, size)
    assert len(parsed.tensors) == 272 and parsed.alignment == 32
    assert llama_cpp_loads(default_gguf)


def test_import_refuses_a_tensor_declared_smaller_than_its_bytes(default_gguf, cli, tmp_path, edgellm_home):
    bad = patch_tensor_type(default_gguf, tmp_path / "patched.gguf", GAP_TENSOR, Q4_0)
    assert not llama_cpp_loads(bad)  # what the check protects against: llama.cpp refuses it too
    res = cli("import", bad)
    line = one_line_error(res)
    # Q4_0 [576, 1536] = 27648 blocks x 18 bytes; the Q4_1 bytes written are 27648 x 20.
    assert line == (
        f"error: patched.gguf: tensor '{GAP_TENSOR}' is declared Q4_0 [576, 1536] (497664 bytes) "
        "but occupies 552960 bytes before 'blk.0.ffn_up.weight'; its type or shape is wrong"
    )
    assert not (edgellm_home / "index.json").exists()
    assert not list((edgellm_home / "models").rglob("*.gguf")) if (edgellm_home / "models").exists() else True


def test_import_refuses_a_tensor_declared_larger_than_its_bytes(default_gguf, cli, tmp_path):
    bad = patch_tensor_type(default_gguf, tmp_path / "grown.gguf", GAP_TENSOR, Q8_0)
    assert not llama_cpp_loads(bad)
    line = one_line_error(cli("import", bad))
    assert f"'{GAP_TENSOR}'" in line and "overlap" in line


def test_import_refuses_a_last_tensor_that_leaves_bytes_behind(default_gguf, cli, tmp_path):
    from edgellm.gguf.reader import read_layout

    last = read_layout(default_gguf).tensors[-1]
    assert (last.name, last.type_name, last.shape) == ("output_norm.weight", "F32", [576])
    bad = patch_tensor_type(default_gguf, tmp_path / "short-tail.gguf", last.name, F16)
    line = one_line_error(cli("import", bad))
    assert line == (
        "error: short-tail.gguf: tensor 'output_norm.weight' is declared F16 [576] (1152 bytes) "
        "but 1152 bytes follow it to the end of the file; its type or shape is wrong"
    )


def test_bundle_import_refuses_a_file_that_does_not_tile(default_gguf, cli, tmp_path, edgellm_home):
    """A bundle whose manifest hashes match a mislabelled file is still refused."""
    bundle = tmp_path / "bundle"
    (bundle / "m").mkdir(parents=True)
    bad = patch_tensor_type(default_gguf, bundle / "m" / "m.gguf", GAP_TENSOR, Q4_0)
    data = bad.read_bytes()
    manifest = {
        "format": "edgellm-bundle",
        "version": 1,
        "models": [{"name": "m", "files": [{"path": "m/m.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]}],
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    line = one_line_error(cli("import", bundle))
    assert f"bundle file m/m.gguf: tensor '{GAP_TENSOR}' is declared Q4_0" in line and "nothing was imported" in line
    assert not (edgellm_home / "index.json").exists()
    assert [p for p in (edgellm_home / "models").rglob("*") if p.is_file()] == []


def _split_set(folder: Path) -> list[Path]:
    """A two-shard llama-arch GGUF written by gguf-py (F32 tensors, two per shard)."""
    import gguf
    import numpy as np

    from edgellm.gguf.reader import split_set

    w = gguf.GGUFWriter(str(folder / "tiny.gguf"), "llama", split_max_tensors=2)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_token_list([f"t{i}" for i in range(64)])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((64, 32), dtype=np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.standard_normal(32, dtype=np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return split_set(sorted(folder.glob("tiny-00001-of-*.gguf"))[0])


@pytest.mark.parametrize("shard", [0, 1])
def test_a_split_set_is_checked_shard_by_shard(tmp_path, shard):
    """Later shards skip the metadata cross-check, never the tiling check."""
    from edgellm.errors import GGUFError
    from edgellm.gguf.reader import read_layout, validate_for_import

    shards = _split_set(tmp_path)
    assert len(shards) == 2
    assert validate_for_import(shards).architecture == "llama"
    target = shards[shard]
    name = read_layout(target).tensors[0].name
    patched = patch_tensor_type(target, tmp_path / "patched.gguf", name, F16)
    patched.replace(target)
    with pytest.raises(GGUFError, match=f"^{target.name}: tensor '{name}' is declared F16"):
        validate_for_import(shards)


def test_parse_cache_never_serves_a_changed_file(tmp_path):
    """A command reads its input several times and parses it once (edgellm.gguf.layout's
    cache); a file rewritten in place is parsed again, and so is one written just now
    (mtimes tick in jiffies, so its key could survive a rewrite)."""
    import os
    import time

    from support.gguf_files import write_tiny_llama

    from edgellm.gguf.layout import read_tensors
    from edgellm.gguf.reader import read_gguf

    p = write_tiny_llama(tmp_path / "m.gguf", n_layer=2)
    assert read_tensors(p) is not read_tensors(p)  # fresh: not cached
    old = time.time() - 60
    os.utime(p, (old, old))
    first = read_tensors(p)
    assert read_tensors(p) is first and read_gguf(p).block_count == 2  # settled: parsed once
    write_tiny_llama(p, n_layer=3)
    os.utime(p, (old + 1, old + 1))
    assert read_tensors(p) is not first and read_gguf(p).block_count == 3
