"""The GGUF container: header, metadata and tensor table, parsed with bounds checks.

The parser is ours but its type tables (GGMLQuantizationType, block sizes,
LlamaFileType) are gguf-py's. gguf-py's GGUFReader builds a numpy view per
metadata item, which takes ~4 s on a 49k-token vocabulary; this takes 0.3 s.
Tensor data is still read with gguf-py (quant/convert.py). Judging what was
parsed is `edgellm.gguf.validate`'s job; `edgellm.gguf.reader` joins the two.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import re
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm.errors import GGUFError
from edgellm.fsutil import unreadable

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
    # Matmul weights (2-D, not an embedding table read by row) whose row count is a multiple
    # of 8, bytes by type: what llama.cpp's CPU backend may repack into a copy of its own.
    repack_candidate_bytes: dict[str, int] = field(default_factory=dict)
    # The token embedding is read one row per token, unless it is also the output matrix (tied).
    token_embd_bytes: int = 0
    tied_output: bool = False

    @property
    def bytes_per_token(self) -> int:
        """Weight bytes one generated token reads: every matrix once, the embedding table only if it is the output."""
        return self.tensor_bytes - (0 if self.tied_output else self.token_embd_bytes)

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

    mod = sys.modules.get("gguf.constants")
    if mod is not None:
        return mod

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
    except OSError as e:
        raise GGUFError(unreadable(path, e)) from None
    if not path.is_file():
        raise GGUFError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as e:
        raise GGUFError(unreadable(path, e)) from None
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


_CACHE: dict[tuple, _Parsed] = {}
_CACHE_SIZE = 4
_CACHE_LOCK = threading.Lock()


def _parse(path: Path, size: int, *, raw: bool = False) -> _Parsed:
    """With `raw`, also keep every KV as written (strings as bytes, arrays whole)
    in `raw_kvs`, for code that copies metadata verbatim (quant/convert.py).

    A command reads the same input several times (resolve, the recipe's check,
    quantize's own); walking a 49k-token vocabulary costs ~20 ms each, so the
    last few parses are kept, keyed by the file's identity and mtime (files
    changed in the last two seconds are not). The result is shared: callers
    only read it."""
    if raw:
        return _parse_file(path, size, raw=True)
    st = os.stat(path)
    if time.time() - st.st_mtime < 2.0:  # mtimes tick in jiffies: a file still being rewritten may keep its key
        return _parse_file(path, size)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, size)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is None:
        hit = _parse_file(path, size)
        with _CACHE_LOCK:
            if len(_CACHE) >= _CACHE_SIZE:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[key] = hit
    return hit


# long: one bounds-checked pass over header, metadata and tensor table; the readers are closures sharing `pos`
def _parse_file(path: Path, size: int, *, raw: bool = False) -> _Parsed:
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
            return unpack("<I", "a 32-bit value")

        def u64() -> int:
            return unpack("<Q", "a 64-bit value")

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

        def unpack(fmt: str, what: str):
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n, what)
            v = struct.unpack_from(fmt, mm, pos)[0]
            pos += n
            return v

        def scalar(t: int, what: str):
            return unpack(_SCALAR[t], what)

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
                    if keep or raw:
                        blobs = [raw_string(key) for _i in range(count)]
                        if keep:
                            out.fields[key] = [b.decode("utf-8", "replace") for b in blobs]
                        if raw:
                            out.raw_kvs.append((key, t, blobs, et))
                    else:
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
                raise GGUFError(
                    f"{path.name}: tensor {name!r} rows of {shape[0]} are not a multiple of the {qtype.name} block ({block})"
                )
            n_el = 1
            for d in shape:
                n_el *= d
            out.tensors.append(_Tensor(name, shape, type_id, qtype.name, offset, n_el, n_el // block * type_size))
        out.data_offset = (pos + align - 1) // align * align
        for tensor in out.tensors:
            tensor.data_offset = out.data_offset + tensor.offset
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


def read_tensors(path: Path | str) -> _Parsed:
    """The tensor table (with absolute data offsets) and the metadata, long
    arrays only counted: what code that reads shapes or tensor bytes needs,
    without read_layout's copy of a 49k-token vocabulary (0.3 s)."""
    path = Path(path)
    return _parse(path, _check_header(path))


def model_matmul_widths(model_path: Path | str) -> tuple[str, dict[str, tuple[int, int]]]:
    """(architecture, {weight name: (cols, n_mat)}) for every tensor an imatrix can describe."""

    parsed = read_tensors(model_path)
    arch = parsed.fields.get("general.architecture", "")
    out = {}
    for t in parsed.tensors:
        if len(t.shape) >= 2:
            out[t.name] = (t.shape[0], t.shape[2] if len(t.shape) > 2 else 1)
    return str(arch), out
