"""Reading GGUF files: the one entry point for every file a user hands edgellm.

llama.cpp trusts the files it loads: a truncated file, an absurd tensor count
or metadata that contradicts the tensors can make it abort the whole process.
So every path goes through `read_gguf()` first, which parses the header,
metadata and tensor table with bounds checks on every read (`layout`), then
cross-checks the metadata, the tensor table and the data region (`validate`).
Only a file that passes reaches llama.cpp.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from edgellm.errors import GGUFError, one_line
from edgellm.gguf.layout import (  # noqa: F401  (re-exported: the names callers import from here)
    _SPLIT_RE,
    GGUF_MAGIC,
    GGUFInfo,
    _check_header,
    _parse,
    file_type_name,
    gguf_constants,
    read_layout,
)
from edgellm.gguf.validate import check_tensor_data, check_tiling, cross_check

log = logging.getLogger(__name__)

# Tables llama.cpp reads by row (GET_ROWS), never as a matmul weight: never repacked.
_ROW_TABLES = ("token_embd", "position_embd", "token_types")


def read_gguf(path: Path | str, *, check: bool = True) -> GGUFInfo:
    """Parse and validate a GGUF file. Raises `GGUFError` with a one-line reason."""
    path = Path(path)
    size = _check_header(path)
    try:
        parsed = _parse(path, size)
    except GGUFError:
        raise
    except (Exception, RecursionError) as e:  # anything else a hostile file can provoke
        raise GGUFError(f"{path.name}: malformed GGUF ({one_line(e, 160)})") from None
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
    repack: Counter = Counter()
    for t in tensors:
        if len(t.shape) == 2 and t.shape[1] % 8 == 0 and t.name.split(".")[0] not in _ROW_TABLES:
            repack[t.type_name] += t.n_bytes
    names = {t.name: t for t in tensors}
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
        repack_candidate_bytes=dict(sorted(repack.items())),
        token_embd_bytes=names["token_embd.weight"].n_bytes if "token_embd.weight" in names else 0,
        tied_output="output.weight" not in names and "token_embd.weight" in names,
    )
    if check:
        cross_check(info, parsed, size)
    return info


def _guess_level(types: Counter[str]) -> str:
    weights = {k: v for k, v in types.items() if k not in ("F32",)}
    if not weights:
        return "f32"
    return max(weights, key=lambda k: weights[k]).lower()


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


def validate_for_import(shards: list[Path]) -> GGUFInfo:
    """Everything a file (or split set) must pass before the store takes it:
    every import path (a file, a bundle, another tool's store) calls this.
    Returns the first shard's info."""
    info = read_gguf(shards[0])
    for s in shards[1:]:
        # Later shards carry only split.* metadata: structure and tiling, no metadata cross-check.
        read_gguf(s, check=False)
        size = _check_header(s)
        check_tiling(s, _parse(s, size), size)
    for s in shards:
        check_tensor_data(s)
    return info
