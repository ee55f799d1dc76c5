"""The GGUF imatrix file: llama-imatrix's output format, read, written and checked.

The layout is what `IMatrixCollector::save_imatrix` writes in the pinned
llama.cpp (tools/imatrix/imatrix.cpp): metadata `general.type = "imatrix"`,
`imatrix.datasets` (string array), `imatrix.chunk_count` and
`imatrix.chunk_size` (u32), then per weight, in sorted name order, two F32
tensors: `<weight>.in_sum2` (the summed squared activations, ne = [cols,
n_mat]) and `<weight>.counts` (rows seen, ne = [1, n_mat]). Dimensions are
written as ggml_n_dims reports them (trailing 1s dropped), data aligned to 32.

Reading refuses, with one line, anything llama.cpp would misread or abort on:
another file type, a truncated or corrupted file, a sum without its count,
shapes that disagree, non-finite values. `check_against_model` then refuses a
matrix made for another model (names or widths that differ), which
llama-quantize would otherwise apply partly or abort on.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgellm.errors import GGUFError, QuantizeError
from edgellm.fsutil import unreadable
from edgellm.gguf.layout import model_matmul_widths, read_layout

ALIGN = 32
_F32 = 0
_T_U32, _T_STR, _T_ARR = 4, 8, 9


@dataclass
class Entry:
    sums: np.ndarray  # float32 (n_mat, cols)
    counts: np.ndarray  # int64 (n_mat,)

    def normalized(self) -> np.ndarray:
        """What llama-quantize hands llama_model_quantize: sums / count per matrix, 1 where nothing was seen
        (tools/quantize/quantize.cpp load_imatrix), as float32 division."""
        out = np.ones_like(self.sums)
        seen = self.counts > 0
        out[seen] = self.sums[seen] / self.counts[seen].astype(np.float32)[:, None]
        return out.reshape(-1)


@dataclass
class IMatrix:
    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _dims(shape: tuple[int, ...]) -> list[int]:
    dims = list(shape)
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return dims


def encode(m: IMatrix) -> bytes:
    """The bytes llama-imatrix would write for `m` (GGUF v3)."""
    kv = [
        _string("general.type") + struct.pack("<I", _T_STR) + _string("imatrix"),
        _string("imatrix.datasets")
        + struct.pack("<IIQ", _T_ARR, _T_STR, len(m.datasets))
        + b"".join(_string(d) for d in m.datasets),
        _string("imatrix.chunk_count") + struct.pack("<II", _T_U32, m.chunk_count),
        _string("imatrix.chunk_size") + struct.pack("<II", _T_U32, m.chunk_size),
    ]
    tensors: list[tuple[str, tuple[int, ...], bytes]] = []
    for name in sorted(m.entries):
        e = m.entries[name]
        n_mat, cols = e.sums.shape
        tensors.append((f"{name}.in_sum2", (cols, n_mat), np.ascontiguousarray(e.sums, np.float32).tobytes()))
        tensors.append((f"{name}.counts", (1, n_mat), e.counts.astype(np.float32).tobytes()))
    infos, offset = [], 0
    for tname, shape, data in tensors:
        dims = _dims(shape)
        infos.append(
            _string(tname)
            + struct.pack("<I", len(dims))
            + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", _F32, offset)
        )
        offset += _pad(len(data))
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(infos)
    out = bytearray(head + b"\0" * (_pad(len(head)) - len(head)))
    for _n, _s, data in tensors:
        out += data + b"\0" * (_pad(len(data)) - len(data))
    return bytes(out)


def read_imatrix(path: Path | str) -> IMatrix:
    """Parse and check an imatrix GGUF. Raises QuantizeError with one line."""

    path = Path(path)
    what = f"{path.name}: not a usable importance matrix"
    try:
        head = path.read_bytes()[:4]
    except OSError as e:
        raise QuantizeError(unreadable(path, e)) from None
    if head != b"GGUF":
        raise QuantizeError(
            f"{what} (not a GGUF file; the legacy .dat format is not read: convert it with "
            "`llama-imatrix --in-file X.dat -o X.gguf`)"
        )
    try:
        parsed = read_layout(path)
    except GGUFError as e:
        raise QuantizeError(f"{what} ({str(e).split(': ', 1)[-1]})") from None
    except Exception as e:  # a hostile file: any parse failure is the same answer
        raise QuantizeError(f"{what} (malformed GGUF: {type(e).__name__})") from None
    f = parsed.fields
    if f.get("general.type") != "imatrix":
        kind = f.get("general.type") or ("a model" if "general.architecture" in f else "unknown")
        raise QuantizeError(f"{what} (its general.type is {kind!r}, not 'imatrix')")
    size = path.stat().st_size
    by_name = {t.name: t for t in parsed.tensors}
    entries: dict[str, Entry] = {}
    with open(path, "rb") as fh:
        for t in parsed.tensors:
            if not t.name.endswith(".in_sum2"):
                if not t.name.endswith(".counts"):
                    raise QuantizeError(f"{what} (unexpected tensor {t.name})")
                continue
            name = t.name[: -len(".in_sum2")]
            c = by_name.get(name + ".counts")
            if c is None:
                raise QuantizeError(f"{what} ({name} has sums but no counts)")
            for x in (t, c):
                if x.type_id != _F32:
                    raise QuantizeError(f"{what} ({x.name} is {x.type_name}, not F32)")
                if x.data_offset + x.n_bytes > size:
                    raise QuantizeError(f"{what} (truncated: {x.name} ends past the end of the file)")
            cols = t.shape[0]
            n_mat = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
            if c.n_elements != n_mat:
                raise QuantizeError(f"{what} ({name}: {n_mat} matrices but {c.n_elements} counts)")
            fh.seek(t.data_offset)
            sums = np.frombuffer(fh.read(t.n_bytes), np.float32).reshape(n_mat, cols)
            fh.seek(c.data_offset)
            counts_f = np.frombuffer(fh.read(c.n_bytes), np.float32)
            if not (np.isfinite(sums).all() and np.isfinite(counts_f).all()) or (sums < 0).any() or (counts_f < 0).any():
                raise QuantizeError(f"{what} ({name} holds negative or non-finite values: the file is corrupted)")
            entries[name] = Entry(sums.copy(), counts_f.astype(np.int64))
    if not entries:
        raise QuantizeError(f"{what} (it holds no entries)")
    datasets = f.get("imatrix.datasets")
    if not isinstance(datasets, list):
        datasets = []
    datasets = [d.decode("utf-8", "replace") if isinstance(d, bytes) else str(d) for d in datasets]
    if "imatrix.chunk_size" not in f and "imatrix.chunk_count" not in f and not datasets:
        raise QuantizeError(f"{what} (missing imatrix metadata)")  # llama-quantize refuses these too
    return IMatrix(entries, datasets, int(f.get("imatrix.chunk_count", 0) or 0), int(f.get("imatrix.chunk_size", 0) or 0))


def check_against_model(m: IMatrix, model_path: Path | str, *, label: str, model_label: str) -> None:
    """Refuse a matrix made for another model: every entry must name one of its
    weights with the same width and matrix count (llama-quantize's size check)."""
    _arch, widths = model_matmul_widths(model_path)
    missing = [n for n in m.entries if n not in widths]
    if missing:
        raise QuantizeError(
            f"imatrix {label} was not made for {model_label}: {len(missing)} of its {len(m.entries)} entries name "
            f"weights {model_label} lacks (e.g. {missing[0]})"
        )
    for name, e in sorted(m.entries.items()):
        cols, n_mat = widths[name]
        if e.sums.shape != (n_mat, cols):
            raise QuantizeError(
                f"imatrix {label} was not made for {model_label}: {name} has {e.sums.shape[1]} columns x {e.sums.shape[0]} "
                f"there, {cols} x {n_mat} in the model"
            )
    if not any(n.startswith("blk.") for n in m.entries) or not any(n.startswith("blk.") for n in widths):
        return
    want = {n for n in widths if n.startswith("blk.") and n.endswith(".weight") and _is_matmul_weight(n)}
    if want and len(want & set(m.entries)) < len(want) // 2:
        raise QuantizeError(
            f"imatrix {label} covers only {len(want & set(m.entries))} of the {len(want)} layer "
            f"matrices of {model_label}: it was made for another model"
        )


def _is_matmul_weight(name: str) -> bool:
    return any(
        k in name for k in ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate", "ffn_up", "ffn_down", "attn_qkv.")
    )


def summary(m: IMatrix) -> dict[str, Any]:
    return {"entries": len(m.entries), "chunk_count": m.chunk_count, "chunk_size": m.chunk_size, "datasets": m.datasets}
