"""Reading and validating GGUF files.

llama.cpp trusts the files it loads: a truncated file, an absurd tensor count
or metadata that contradicts the tensors can make it abort the whole process.
So every path a user hands edgellm goes through `read_gguf()` first, which
parses the header, metadata and tensor table with bounds checks on every
read, then cross-checks the metadata against the tensor table. Only a file
that passes reaches llama.cpp.

The parser is ours but its type tables (GGMLQuantizationType, block sizes,
LlamaFileType) are gguf-py's. gguf-py's GGUFReader builds a numpy view per
metadata item, which takes ~4 s on a 49k-token vocabulary; this takes 0.3 s.
Tensor data is still read with gguf-py (quant/convert.py).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm.errors import GGUFError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_BLK_RE = re.compile(r"^blk\.(\d+)\.")
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass
class GGUFInfo:
    path: Path
    size_bytes: int
    version: int
    architecture: str
    name: str
    parameters: int
    context_length: int
    block_count: int
    embedding_length: int
    head_count: int
    head_count_kv: int
    vocab_size: int
    file_type: Optional[int]
    level: str  # lowercase llama.cpp file type name: q4_1, q4_k_m, f16 ...
    tensor_count: int
    tensor_types: dict[str, int]
    tensor_bytes: int
    chat_template: Optional[str]
    split_count: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def bpw(self) -> float:
        """Bits per weight over the tensor data, as llama.cpp reports it."""
        return self.tensor_bytes * 8 / self.parameters if self.parameters else 0.0

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def kv_cache_bytes(self, n_ctx: int, *, bytes_per_elem: float = 2.0) -> int:
        """K and V for every layer at n_ctx (f16 by default)."""
        if not (self.head_count and self.embedding_length and self.block_count):
            return 0
        head_dim = self.embedding_length // self.head_count
        n_kv = self.head_count_kv or self.head_count
        return int(2 * self.block_count * n_ctx * n_kv * head_dim * bytes_per_elem)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "gguf_version": self.version,
            "architecture": self.architecture,
            "name": self.name,
            "parameters": self.parameters,
            "context_length": self.context_length,
            "block_count": self.block_count,
            "embedding_length": self.embedding_length,
            "head_count": self.head_count,
            "head_count_kv": self.head_count_kv,
            "vocab_size": self.vocab_size,
            "file_type": self.file_type,
            "level": self.level,
            "bpw": round(self.bpw, 4),
            "tensor_count": self.tensor_count,
            "tensor_types": self.tensor_types,
            "has_chat_template": self.has_chat_template,
            "split_count": self.split_count,
        }


def gguf_constants():
    """gguf-py's type tables (`gguf.constants`), without the rest of gguf-py.

    `import gguf` also imports numpy and gguf-py's reader and writer: ~0.2 s
    that every validation would pay before its first byte. constants.py
    itself needs only the standard library, so it is loaded on its own under
    its real name; a later `import gguf` then reuses this very module (same
    enums), as the import system finds it in sys.modules.
    """
    import sys

    mod = sys.modules.get("gguf.constants")
    if mod is not None:
        return mod
    import importlib.util

    spec = importlib.util.find_spec("gguf")
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    if origin is None or not (origin.parent / "constants.py").is_file():
        import gguf.constants  # an unusual layout: the plain import still works

        return gguf.constants
    cspec = importlib.util.spec_from_file_location("gguf.constants", origin.parent / "constants.py")
    mod = importlib.util.module_from_spec(cspec)
    sys.modules["gguf.constants"] = mod
    try:
        cspec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["gguf.constants"]
        raise
    return mod


def file_type_name(ftype: int) -> str:
    """llama.cpp's file type number → lowercase level name ("q4_k_m")."""
    LlamaFileType = gguf_constants().LlamaFileType

    try:
        name = LlamaFileType(ftype).name
    except ValueError:
        return f"ftype{ftype}"
    if name == "ALL_F32":
        return "f32"
    return name.removeprefix("MOSTLY_").lower()


def _check_header(path: Path) -> int:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise GGUFError(f"{path}: no such file") from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot read ({e.strerror})") from None
    if not path.is_file():
        raise GGUFError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read ({e.strerror})") from None
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path.name}: not a GGUF file (bad magic)")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise GGUFError(f"{path.name}: unsupported GGUF version {version} (expected 2 or 3)")
    return size


class _Parsed:
    """The header, metadata and tensor table of a GGUF, parsed without gguf-py's
    per-item numpy views (which take seconds on a 50k-token vocabulary)."""

    def __init__(self) -> None:
        self.version = 0
        self.fields: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        self.tensors: list[_Tensor] = []
        self.alignment = 32
        self.data_offset = 0
        # (key, GGUF value type, value, array item type) as written; filled with raw=True
        self.raw_kvs: list[tuple[str, int, Any, Optional[int]]] = []


@dataclass
class _Tensor:
    name: str
    shape: list[int]
    type_id: int
    type_name: str
    offset: int  # relative to the data section
    n_elements: int
    n_bytes: int
    data_offset: int = 0  # absolute


# GGUF metadata value types (gguf-py: GGUFValueType) -> struct format
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_MAX_STR = 1 << 24
_MAX_COUNT = 1 << 32
# Arrays kept in full; others (vocabularies, merges) are only counted.
_KEEP_ARRAYS = 4096


def _parse(path: Path, size: int, *, raw: bool = False) -> _Parsed:
    """With `raw`, also keep every KV as written (strings as bytes, arrays whole)
    in `raw_kvs`, for code that copies metadata verbatim (quant/convert.py)."""
    import mmap
    import struct

    consts = gguf_constants()
    GGML_QUANT_SIZES, GGMLQuantizationType = consts.GGML_QUANT_SIZES, consts.GGMLQuantizationType
    unpack_u64 = struct.Struct("<Q").unpack_from

    out = _Parsed()
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pos = 0

        def need(n: int, what: str) -> None:
            if n < 0 or pos + n > size:
                raise GGUFError(f"{path.name}: truncated or corrupt GGUF ({what} runs past the end of the file at byte {pos})")

        def u32() -> int:
            nonlocal pos
            need(4, "a 32-bit value")
            v = struct.unpack_from("<I", mm, pos)[0]
            pos += 4
            return v

        def u64() -> int:
            nonlocal pos
            need(8, "a 64-bit value")
            v = struct.unpack_from("<Q", mm, pos)[0]
            pos += 8
            return v

        def raw_string(what: str) -> bytes:
            nonlocal pos
            n = u64()
            if n > _MAX_STR:
                raise GGUFError(f"{path.name}: {what} claims a string of {n} bytes")
            need(n, what)
            b = mm[pos : pos + n]
            pos += n
            return b

        def string(what: str) -> str:
            return raw_string(what).decode("utf-8", "replace")

        def scalar(t: int, what: str):
            nonlocal pos
            fmt = _SCALAR[t]
            n = struct.calcsize(fmt)
            need(n, what)
            v = struct.unpack_from(fmt, mm, pos)[0]
            pos += n
            return v

        pos = 4
        out.version = u32()
        n_tensors = u64()
        n_kv = u64()
        # Every entry takes at least 8 bytes on disk: a count beyond that is a lie.
        if n_tensors > size // 8 or n_kv > size // 8:
            raise GGUFError(f"{path.name}: absurd header counts ({n_tensors} tensors, {n_kv} metadata keys)")
        for _ in range(n_kv):
            key = string("a metadata key")
            t = u32()
            if t in _SCALAR:
                out.fields[key] = scalar(t, key)
                if raw:
                    out.raw_kvs.append((key, t, out.fields[key], None))
            elif t == 8:
                b = raw_string(key)
                out.fields[key] = b.decode("utf-8", "replace")
                if raw:
                    out.raw_kvs.append((key, t, b, None))
            elif t == 9:
                et = u32()
                count = u64()
                if count > _MAX_COUNT:
                    raise GGUFError(f"{path.name}: {key} claims {count} array items")
                if et in _SCALAR:
                    n = struct.calcsize(_SCALAR[et])
                    need(n * count, key)
                    if count <= _KEEP_ARRAYS or raw:
                        items = list(struct.unpack_from("<" + _SCALAR[et][1] * count, mm, pos))
                        if count <= _KEEP_ARRAYS:
                            out.fields[key] = items
                        if raw:
                            out.raw_kvs.append((key, t, items, et))
                    pos += n * count
                elif et == 8:
                    # minimum 8 bytes per string: reject impossible counts before looping
                    need(8 * count, key)
                    keep = count <= _KEEP_ARRAYS
                    blobs = [raw_string(key) for _i in range(count)] if (keep or raw) else None
                    if blobs is None:
                        # only counted (vocabularies, merges: 10^5 strings): walked in a tight
                        # loop, the same checks as raw_string without its call overhead
                        p = pos
                        for _i in range(count):
                            if p + 8 > size:
                                need(p + 8 - pos, key)
                            n = unpack_u64(mm, p)[0]
                            if n > _MAX_STR:
                                raise GGUFError(f"{path.name}: {key} claims a string of {n} bytes")
                            p += 8 + n
                        need(p - pos, key)
                        pos = p
                    if keep:
                        out.fields[key] = [b.decode("utf-8", "replace") for b in blobs]
                    if raw:
                        out.raw_kvs.append((key, t, blobs, et))
                else:
                    raise GGUFError(f"{path.name}: {key} has an array of unsupported type {et}")
                out.array_lengths[key] = count
            else:
                raise GGUFError(f"{path.name}: metadata key {key!r} has unknown type {t}")
        align = out.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1) or align > 1 << 16:
            raise GGUFError(f"{path.name}: invalid general.alignment {align!r}")
        out.alignment = align
        for _ in range(n_tensors):
            name = string("a tensor name")
            n_dims = u32()
            if n_dims == 0 or n_dims > 4:
                raise GGUFError(f"{path.name}: tensor {name!r} has {n_dims} dimensions")
            shape = [u64() for _d in range(n_dims)]
            type_id = u32()
            offset = u64()
            try:
                qtype = GGMLQuantizationType(type_id)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFError(f"{path.name}: tensor {name!r} has unknown type {type_id}") from None
            if any(d <= 0 or d > 1 << 40 for d in shape):
                raise GGUFError(f"{path.name}: tensor {name!r} has invalid dimensions {shape}")
            if shape[0] % block:
                raise GGUFError(f"{path.name}: tensor {name!r} rows of {shape[0]} are not a multiple of the {qtype.name} block ({block})")
            n_el = 1
            for d in shape:
                n_el *= d
            out.tensors.append(_Tensor(name, shape, type_id, qtype.name, offset, n_el, n_el // block * type_size))
        out.data_offset = (pos + align - 1) // align * align
        for t in out.tensors:
            t.data_offset = out.data_offset + t.offset
    finally:
        mm.close()
    return out


def read_layout(path: Path | str) -> _Parsed:
    """Every KV as written and the tensor table with absolute data offsets.

    For code that rewrites a file (quant/convert.py); call `read_gguf` first
    to validate it.
    """
    path = Path(path)
    return _parse(path, _check_header(path), raw=True)


def read_gguf(path: Path | str, *, check: bool = True) -> GGUFInfo:
    """Parse and validate a GGUF file. Raises `GGUFError` with a one-line reason."""
    path = Path(path)
    size = _check_header(path)
    try:
        parsed = _parse(path, size)
    except GGUFError:
        raise
    except (Exception, RecursionError) as e:  # anything else a hostile file can provoke
        msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise GGUFError(f"{path.name}: malformed GGUF ({msg})") from None
    fields = parsed.fields
    tensors = parsed.tensors
    arch = fields.get("general.architecture", "")
    arch = arch if isinstance(arch, str) else ""
    ftype = fields.get("general.file_type")
    types = Counter(t.type_name for t in tensors)
    split_count = fields.get("split.count", 1)
    split_count = int(split_count) if isinstance(split_count, int) and split_count > 0 else 1

    def arch_int(key: str) -> int:
        v = fields.get(f"{arch}.{key}", 0)
        if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv in some archs)
            v = max(v) if v else 0
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0

    template = fields.get("tokenizer.chat_template")
    info = GGUFInfo(
        path=path,
        size_bytes=size,
        version=parsed.version,
        architecture=arch,
        name=str(fields.get("general.name", "") or ""),
        parameters=sum(t.n_elements for t in tensors),
        context_length=arch_int("context_length"),
        block_count=arch_int("block_count"),
        embedding_length=arch_int("embedding_length"),
        head_count=arch_int("attention.head_count"),
        head_count_kv=arch_int("attention.head_count_kv"),
        vocab_size=arch_int("vocab_size") or parsed.array_lengths.get("tokenizer.ggml.tokens", 0),
        file_type=int(ftype) if isinstance(ftype, int) else None,
        level=file_type_name(int(ftype)) if isinstance(ftype, int) else _guess_level(types),
        tensor_count=len(tensors),
        tensor_types=dict(sorted(types.items())),
        tensor_bytes=sum(t.n_bytes for t in tensors),
        chat_template=template if isinstance(template, str) else None,
        split_count=split_count,
        metadata={k: v for k, v in fields.items() if not isinstance(v, list) and k != "tokenizer.chat_template"},
    )
    if check:
        _cross_check(info, parsed, size)
    return info


def _guess_level(types: Counter) -> str:
    weights = {k: v for k, v in types.items() if k not in ("F32",)}
    if not weights:
        return "f32"
    return max(weights, key=weights.get).lower()


def _cross_check(info: GGUFInfo, parsed: "_Parsed", size: int) -> None:
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
    for (a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise GGUFError(f"{name}: tensors '{an}' and '{bn}' overlap in the file (a dimension or offset is wrong)")
    if info.split_count > 1:
        return  # the other shards hold the rest of the tensor table
    blocks: dict[int, set[str]] = {}
    for t in tensors:
        if m := _BLK_RE.match(t.name):
            blocks.setdefault(int(m.group(1)), set()).add(t.name[m.end():])
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
                f"{name}: metadata says embedding_length={info.embedding_length} "
                f"but token_embd.weight is {dims[0]} wide"
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
    required = {"block_count": info.block_count, "embedding_length": info.embedding_length,
                "attention.head_count": info.head_count, "context_length": info.context_length}
    for key, v in required.items():
        if has_blocks and v <= 0:
            raise GGUFError(f"{name}: {arch}.{key} is missing or zero")
    md = info.metadata
    for key in ("attention.head_count_kv", "vocab_size", "feed_forward_length"):
        v = md.get(f"{arch}.{key}")
        if isinstance(v, int) and v <= 0:
            raise GGUFError(f"{name}: {arch}.{key} is {v}")
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
        short = t.name[m.end():] if m else t.name
        want = expected.get(short)
        if want and t.shape != want:
            raise GGUFError(f"{name}: tensor '{t.name}' has shape {t.shape}, but the metadata implies {want}")


def split_set(path: Path) -> list[Path]:
    """All shards of a split GGUF given any one of them (or [path])."""
    m = _SPLIT_RE.search(path.name)
    if not m:
        return [path]
    n = int(m.group(2))
    prefix = path.name[: m.start()]
    return [path.with_name(f"{prefix}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def human_params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.0f}M"
    return str(n)




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
    import numpy as np

    path = Path(path)
    size = path.stat().st_size
    parsed = _parse(path, size)
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
                bad = any(not np.isfinite(np.ascontiguousarray(blocks[:, o : o + np.dtype(dt).itemsize]).view(dt)).all() for o, dt in scales)
            else:
                continue
            if bad:
                raise GGUFError(f"{path.name}: tensor '{t.name}' holds NaN or Inf values")
    finally:
        del mm
