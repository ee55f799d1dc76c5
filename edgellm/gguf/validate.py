"""Checks that a parsed GGUF is one llama.cpp will load and run as intended.

`reader.read_gguf()` parses; this module judges. Three kinds of checks:
the tensor table against the data region (every tensor's bytes, from its
type and shape, tile the region in table order, as llama.cpp's gguf loader
demands), the metadata against the tensor table (block count, shapes of
llama-like architectures, vocabulary), and the tensor values themselves
(NaN/Inf, which llama.cpp loads and then generates garbage from).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from edgellm.errors import GGUFError
from edgellm.gguf.layout import _BLK_RE, GGUFInfo, _check_header, _parse, _Parsed, _Tensor


def cross_check(info: GGUFInfo, parsed: _Parsed, size: int) -> None:
    """Metadata against the tensor table, and the tensor table against the bytes."""
    name = info.path.name
    tensors = parsed.tensors
    if not info.architecture:
        raise GGUFError(f"{name}: no general.architecture in the metadata")
    if info.split_count == 1 and not tensors:
        raise GGUFError(f"{name}: the file holds no tensors")
    alignment = parsed.alignment
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise GGUFError(f"{name}: duplicate tensor '{t.name}'")
        seen.add(t.name)
        if t.offset % alignment:
            raise GGUFError(f"{name}: tensor '{t.name}' data is not aligned to {alignment} bytes")
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{name}: tensor '{t.name}' extends past the end of the file (truncated?)")
    # Tensor data must not overlap: a grown dimension shows up here whatever the arch.
    spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in tensors)
    for (_a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:], strict=False):
        if b0 < a1:
            raise GGUFError(f"{name}: tensors '{an}' and '{bn}' overlap in the file (a dimension or offset is wrong)")
    check_tiling(info.path, parsed, size)
    if info.split_count > 1:
        return  # the other shards hold the rest of the tensor table
    blocks: dict[int, set[str]] = {}
    for t in tensors:
        if m := _BLK_RE.match(t.name):
            blocks.setdefault(int(m.group(1)), set()).add(t.name[m.end() :])
    if blocks:
        n_blk = max(blocks) + 1
        if info.block_count != n_blk:
            raise GGUFError(
                f"{name}: metadata says {info.architecture}.block_count={info.block_count} "
                f"but the file has tensors for {n_blk} blocks"
            )
        first = blocks.get(0, set())
        for i in range(n_blk):
            missing = first - blocks.get(i, set())
            if missing:
                raise GGUFError(f"{name}: block {i} lacks tensor 'blk.{i}.{sorted(missing)[0]}'")
    if info.architecture in _LLAMA_LIKE:
        _check_llama_shapes(info, tensors, bool(blocks))
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is not None:
        dims = embd.shape
        if info.embedding_length and dims[0] != info.embedding_length:
            raise GGUFError(
                f"{name}: metadata says embedding_length={info.embedding_length} but token_embd.weight is {dims[0]} wide"
            )
        if info.vocab_size and len(dims) > 1 and dims[1] != info.vocab_size:
            raise GGUFError(f"{name}: vocabulary has {info.vocab_size} tokens but token_embd.weight has {dims[1]} rows")
    if info.head_count:
        if info.embedding_length and info.embedding_length % info.head_count:
            raise GGUFError(f"{name}: embedding_length {info.embedding_length} is not a multiple of head_count {info.head_count}")
        if info.head_count_kv and info.head_count % info.head_count_kv:
            raise GGUFError(f"{name}: head_count {info.head_count} is not a multiple of head_count_kv {info.head_count_kv}")
    if info.context_length and info.context_length > 1 << 24:
        raise GGUFError(f"{name}: context_length {info.context_length} is implausible")


# Architectures whose tensor names and shapes follow llama's layout.
_LLAMA_LIKE = {"llama", "qwen2", "qwen3", "mistral", "granite"}


def _check_llama_shapes(info: GGUFInfo, tensors, has_blocks: bool) -> None:
    name = info.path.name
    arch = info.architecture
    required = {
        "block_count": info.block_count,
        "embedding_length": info.embedding_length,
        "attention.head_count": info.head_count,
        "context_length": info.context_length,
    }
    for key, v in required.items():
        if has_blocks and v <= 0:
            raise GGUFError(f"{name}: {arch}.{key} is missing or zero")
    md = info.metadata
    for key in ("attention.head_count_kv", "vocab_size", "feed_forward_length"):
        got = md.get(f"{arch}.{key}")
        if isinstance(got, int) and got <= 0:
            raise GGUFError(f"{name}: {arch}.{key} is {got}")
    n_embd, n_head = info.embedding_length, info.head_count
    n_head_kv = info.head_count_kv or n_head
    head_dim = md.get(f"{arch}.attention.key_length") or (n_embd // n_head if n_head else 0)
    head_dim_v = md.get(f"{arch}.attention.value_length") or head_dim
    n_ff = md.get(f"{arch}.feed_forward_length")
    if isinstance(n_ff, list):
        n_ff = max(n_ff) if n_ff else 0
    expected: dict[str, list[int]] = {
        "token_embd.weight": [n_embd, info.vocab_size],
        "output.weight": [n_embd, info.vocab_size],
        "output_norm.weight": [n_embd],
        "attn_norm.weight": [n_embd],
        "ffn_norm.weight": [n_embd],
        "attn_q.weight": [n_embd, n_head * head_dim],
        "attn_k.weight": [n_embd, n_head_kv * head_dim],
        "attn_v.weight": [n_embd, n_head_kv * head_dim_v],
        "attn_output.weight": [n_head * head_dim_v, n_embd],
    }
    if isinstance(n_ff, int) and not md.get(f"{arch}.expert_count"):
        expected |= {"ffn_gate.weight": [n_embd, n_ff], "ffn_up.weight": [n_embd, n_ff], "ffn_down.weight": [n_ff, n_embd]}
    names = {t.name for t in tensors}
    if has_blocks and "token_embd.weight" not in names:
        raise GGUFError(f"{name}: no token_embd.weight tensor")
    for t in tensors:
        m = _BLK_RE.match(t.name)
        short = t.name[m.end() :] if m else t.name
        want = expected.get(short)
        if want and t.shape != want:
            raise GGUFError(f"{name}: tensor '{t.name}' has shape {t.shape}, but the metadata implies {want}")


def check_tiling(path: Path, parsed: _Parsed, size: int) -> None:
    """Each tensor starts where the previous one's bytes (padded to the
    alignment) end, and the last one ends within one alignment of the file's end.

    llama.cpp's loader walks the table the same way and refuses a file whose
    offsets disagree ("tensor has offset X, expected Y"), but only at load
    time and with no hint of the cause. The usual cause is a tensor whose
    declared type or shape does not match the bytes written for it (a patched
    or mislabelled file): its computed size then leaves a gap or an overlap.
    """
    name = path.name
    align = parsed.alignment
    expected = 0
    prev: Optional[_Tensor] = None
    for t in parsed.tensors:
        if t.offset != expected:
            if prev is None:
                raise GGUFError(f"{name}: tensor '{t.name}' starts {t.offset} bytes into the data region, expected at its start")
            room = t.offset - prev.offset
            if room > 0:
                raise GGUFError(
                    f"{name}: tensor '{prev.name}' is declared {_shape(prev)} ({prev.n_bytes} bytes) but occupies "
                    f"{room} bytes before '{t.name}'; its type or shape is wrong"
                )
            raise GGUFError(
                f"{name}: tensor '{t.name}' starts before '{prev.name}' in the data region; llama.cpp needs them in table order"
            )
        expected = t.offset + _pad(t.n_bytes, align)
        prev = t
    if prev is not None:
        trailing = size - (prev.data_offset + prev.n_bytes)
        if trailing >= align:
            raise GGUFError(
                f"{name}: tensor '{prev.name}' is declared {_shape(prev)} ({prev.n_bytes} bytes) but {trailing} bytes "
                "follow it to the end of the file; its type or shape is wrong"
            )


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _shape(t: _Tensor) -> str:
    return f"{t.type_name} {t.shape}"


# Where each block type keeps its float scales: (block bytes, [(offset, dtype)]).
# A NaN/Inf weight in a quantized tensor can only come from these scales.
_SCALE_LAYOUT: dict[str, tuple[int, list[tuple[int, str]]]] = {
    "Q4_0": (18, [(0, "<f2")]),
    "Q4_1": (20, [(0, "<f2"), (2, "<f2")]),
    "Q5_0": (22, [(0, "<f2")]),
    "Q5_1": (24, [(0, "<f2"), (2, "<f2")]),
    "Q8_0": (34, [(0, "<f2")]),
    "Q2_K": (84, [(80, "<f2"), (82, "<f2")]),
    "Q3_K": (110, [(108, "<f2")]),
    "Q4_K": (144, [(0, "<f2"), (2, "<f2")]),
    "Q5_K": (176, [(0, "<f2"), (2, "<f2")]),
    "Q6_K": (210, [(208, "<f2")]),
    "Q8_K": (292, [(0, "<f4")]),
    "IQ4_NL": (18, [(0, "<f2")]),
    "IQ4_XS": (136, [(0, "<f2")]),
}


def check_tensor_data(path: Path | str, info: Optional[GGUFInfo] = None) -> None:
    """Raise GGUFError if a float tensor, or a quantized tensor's scale, is NaN/Inf.

    llama.cpp loads such a file happily and generates garbage (or NaN
    logits); this reads each tensor once, at memory speed.
    """
    import numpy as np  # numpy (~0.1 s) only where arrays are

    path = Path(path)
    parsed = _parse(path, _check_header(path))
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        for t in parsed.tensors:
            raw = mm[t.data_offset : t.data_offset + t.n_bytes]
            if t.type_name == "F32":
                bad = not np.isfinite(raw.view("<f4")).all()
            elif t.type_name == "F16":
                bad = not np.isfinite(raw.view("<f2")).all()
            elif t.type_name == "BF16":
                bad = bool(((raw.view("<u2") & 0x7F80) == 0x7F80).any())
            elif t.type_name in _SCALE_LAYOUT:
                block, scales = _SCALE_LAYOUT[t.type_name]
                blocks = raw.reshape(-1, block)
                bad = any(
                    not np.isfinite(np.ascontiguousarray(blocks[:, o : o + np.dtype(dt).itemsize]).view(dt)).all()
                    for o, dt in scales
                )
            else:
                continue
            if bad:
                raise GGUFError(f"{path.name}: tensor '{t.name}' holds NaN or Inf values")
    finally:
        del mm
