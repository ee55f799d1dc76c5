"""Dequantize a GGUF to F16, BF16 or F32 with gguf-py.

Some models are published only quantized (the default model ships only as
Q4_1). To measure what further quantization costs, they need a
full-precision base: this expands every tensor back to floats
(`gguf.quants.dequantize`), keeps all metadata (tokenizer, chat template,
architecture keys) and sets `general.file_type` to the new type. Like
llama.cpp's converter, 1-D tensors (norms, biases) stay F32; every other
float tensor, the token embedding included, becomes the target type.

Such a base is the quantized model's values written at higher precision, not
the original weights: the store record says so (`extra["dequantized_from"]`),
and files quantized from it inherit that note, so the quality evaluation can
warn that its losses are measured against an already-quantized base.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm.errors import GGUFError, QuantizeError, UsageError
from edgellm.fsutil import atomic_path, check_free_disk, sha256_file
from edgellm.gguf.reader import read_gguf, read_layout
from edgellm.models.resolve import resolve
from edgellm.models.store import ModelRecord, Store
from edgellm.progress import CancelToken, Progress, ProgressCallback, RateMeter, no_progress
from quant._common import (
    FLOAT_LEVELS,
    check_writable,
    inherited_lineage,
    output_fields,
    plan_output,
    register_output,
    result_json,
)
from quant.levels import parse_level

log = logging.getLogger(__name__)

# Integer tensors (rare: token type tables) are copied unchanged.
_INT_TYPES = ("I8", "I16", "I32", "I64")


@dataclass
class ConvertResult:
    """One converted file, registered in the store."""

    name: str
    level: str  # "f16"
    path: Path
    size_bytes: int
    bpw: float
    tensor_types: dict[str, int]
    source_level: str  # level of the input: "q4_1"
    parent: Optional[str]
    seconds: float
    sha256: str = ""
    warnings: list[str] = field(default_factory=list)
    record: Optional[ModelRecord] = None

    def to_json(self) -> dict[str, Any]:
        return result_json(self)


# long: one job read top to bottom: resolve, check disk, dequantize tensor by tensor into a temp file, validate, register
def convert(
    model_ref_or_path: str | Path,
    to: str = "f16",
    *,
    output: Optional[Path | str] = None,
    name: Optional[str] = None,
    force: bool = False,
    store: Optional[Store] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> ConvertResult:
    """Write `model_ref_or_path` as an `to` ("f16", "bf16" or "f32") GGUF and register it.

    The output is `<models>/<name>/<name>.gguf` (name: the input's name with
    its level suffix swapped, e.g. `smollm2-135m-instruct-f16`) unless
    `output` is given; `name` overrides the store name.

    Raises UsageError (bad `to`), ModelNotFound, GGUFError (invalid input),
    QuantizeError (already that type, split input, unsupported tensor type,
    values beyond F16's range), ModelExists (output exists and not `force`),
    InsufficientResources (disk), Cancelled. On any failure nothing is left
    behind and nothing is registered.
    """
    t0 = time.perf_counter()
    store = store or Store()
    target = parse_level(to)
    if target.key not in FLOAT_LEVELS:
        raise UsageError(
            f"convert writes f16, bf16 or f32, not {target.key}; use `edgellm quantize --level {target.key}` for that"
        )
    resolved = resolve(str(model_ref_or_path), store=store)
    info = read_gguf(resolved.path)
    label = resolved.label
    if info.split_count > 1:
        raise QuantizeError(f"{label} is a split GGUF; merge it first (llama-gguf-split --merge)")
    if info.file_type == target.ftype or (info.file_type is None and info.level == target.key):
        raise QuantizeError(f"{label} is already {target.key}; nothing to convert")
    plan = plan_output(resolved, info, target.key, output=output, name=name, force=force, store=store)
    check_writable(plan.path.parent)

    import numpy as np  # numpy (~0.1 s) only where arrays are
    from gguf import GGMLQuantizationType, GGUFWriter, Keys  # gguf-py pulls numpy: only where tensors are converted

    src = _read_for_copy(resolved.path)
    out_qtype = GGMLQuantizationType[target.name]
    plan_types: list[GGMLQuantizationType] = []
    estimate = info.size_bytes - info.tensor_bytes  # the metadata is copied as is
    for t in src.tensors:
        if t.tensor_type.name in _INT_TYPES:
            dst = t.tensor_type
        elif len(t.shape) <= 1:
            dst = GGMLQuantizationType.F32
        else:
            dst = out_qtype
        plan_types.append(dst)
        estimate += t.n_bytes if dst == t.tensor_type else t.n_elements * (4 if dst == GGMLQuantizationType.F32 else 2)
    check_free_disk(plan.path.parent, estimate, what=f"{plan.name} ({target.key})")

    writer = GGUFWriter(None, arch=info.architecture)
    writer.data_alignment = src.alignment
    for key, vtype, value, sub_type in src.kvs:
        if key == Keys.General.ARCHITECTURE:
            continue  # written by GGUFWriter itself
        if key == Keys.General.FILE_TYPE:
            writer.add_uint32(Keys.General.FILE_TYPE, target.ftype)
        elif sub_type is not None and len(value) == 0:
            log.warning("dropping empty metadata array %s (GGUFWriter cannot write one)", key)
        else:
            writer.add_key_value(key, value, vtype, sub_type=sub_type)
    if not any(kv[0] == Keys.General.FILE_TYPE for kv in src.kvs):
        writer.add_uint32(Keys.General.FILE_TYPE, target.ftype)
    for t, dst in zip(src.tensors, plan_types, strict=False):
        np_shape = tuple(reversed(t.shape))
        nbytes = t.n_bytes if dst == t.tensor_type else t.n_elements * (4 if dst == GGMLQuantizationType.F32 else 2)
        writer.add_tensor_info(t.name, np_shape, np.dtype(np.float32), nbytes, raw_dtype=dst)

    total = len(src.tensors)
    task = f"convert {label} -> {target.key}"
    meter = RateMeter()
    with atomic_path(plan.path) as tmp:
        try:
            writer.open_output_file(tmp)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for i, (t, dst) in enumerate(zip(src.tensors, plan_types, strict=False)):
                if cancel is not None:
                    cancel.check()
                writer.write_tensor_data(_convert_tensor(t, dst, target.key))
                on_progress(Progress(task, i + 1, total, "tensor", message=t.name, rate=meter.update(i + 1)))
        except OSError as e:
            # numpy's short write carries no errno: on a local file that means the disk filled up
            hint = " (disk full or a file size limit?)" if e.errno in (None, errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else ""
            raise QuantizeError(f"cannot write {plan.path}: {e.strerror or e}{hint}") from None
        finally:
            writer.close()
        src.close()
        out = read_gguf(tmp)
        if out.tensor_count != info.tensor_count or out.parameters != info.parameters:
            raise GGUFError(
                f"the converted file has {out.tensor_count} tensors / {out.parameters} weights, the input {info.tensor_count} / {info.parameters}"
            )
        sha = sha256_file(tmp, cancel=cancel)

    warnings: list[str] = []
    extra: dict[str, Any] = {"converted_from": label}
    if info.level not in FLOAT_LEVELS:
        extra["dequantized_from"] = info.level
        warnings.append(
            f"{plan.name} was dequantized from {info.level}: it holds {info.level}'s values at {target.key} precision, "
            f"not the original weights, so quality measured against it excludes {info.level}'s own loss"
        )
        extra["lineage_warning"] = warnings[-1]
    extra.update(inherited_lineage(resolved))
    rec = register_output(store, plan, out, sha, resolved=resolved, source="convert", extra=extra)
    return ConvertResult(
        **output_fields(rec, plan, out, sha), source_level=info.level, seconds=time.perf_counter() - t0, warnings=warnings
    )


def _convert_tensor(t: Any, dst: Any, target: str):
    """One tensor's data in the `dst` type (numpy, row-major, ready to write)."""
    import numpy as np  # numpy (~0.1 s) only where arrays are
    from gguf import GGMLQuantizationType  # gguf-py pulls numpy: only where tensors are converted
    from gguf.quants import dequantize, quantize  # gguf-py pulls numpy: only where tensors are converted

    if dst == t.tensor_type:
        return t.data
    try:
        values = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise QuantizeError(f"tensor '{t.name}' is {t.tensor_type.name}, which gguf-py cannot dequantize") from None
    if dst == GGMLQuantizationType.F32:
        return values.astype(np.float32, copy=False)
    if dst == GGMLQuantizationType.F16:
        with np.errstate(over="ignore"):
            half = values.astype(np.float16)
        if not np.isfinite(half).all() and np.isfinite(values).all():
            raise QuantizeError(f"tensor '{t.name}' has values beyond F16's range (±65504); convert to bf16 or f32 instead")
        return half
    if dst == GGMLQuantizationType.BF16:
        return quantize(values, GGMLQuantizationType.BF16)
    raise QuantizeError(f"cannot convert '{t.name}' to {target}")  # pragma: no cover - plan_types only yields the above


@dataclass
class _SrcTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: row length first
    tensor_type: Any  # GGMLQuantizationType
    n_elements: int
    n_bytes: int
    data: Any  # numpy view: typed for F32/F16, uint8 rows of blocks otherwise (gguf-py's layout)


@dataclass
class _Source:
    kvs: list[tuple[str, Any, Any, Any]]  # key, GGUFValueType, value, array item type
    tensors: list[_SrcTensor]
    alignment: int
    _mm: Any = None

    def close(self) -> None:
        # the mapping goes when the last tensor view does
        self._mm = None
        self.tensors = []


def _read_for_copy(path: Path) -> _Source:
    """Metadata (typed, strings as raw bytes) and tensor views of a GGUF that
    `read_gguf` has already validated.

    The layout comes from edgellm's own GGUF reader (gguf-py's GGUFReader
    builds a numpy view per metadata item: 4-9 s on a 49k-token vocabulary).
    The tensor views use gguf-py's shapes, so `gguf.quants.dequantize` takes
    them as they are.
    """
    import numpy as np  # numpy (~0.1 s) only where arrays are
    from gguf import (  # gguf-py pulls numpy: only where tensors are converted
        GGML_QUANT_SIZES,
        GGMLQuantizationType,
        GGUFValueType,
    )

    layout = read_layout(path)
    kvs = [(k, GGUFValueType(t), v, GGUFValueType(et) if et is not None else None) for k, t, v, et in layout.raw_kvs]
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for t in layout.tensors:
        qtype = GGMLQuantizationType(t.type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(t.shape)
        np_shape = tuple(reversed(shape))
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or qtype.name in _INT_TYPES or qtype.name == "F64":
            item = {
                "F32": np.float32,
                "F16": np.float16,
                "F64": np.float64,
                "I8": np.int8,
                "I16": np.int16,
                "I32": np.int32,
                "I64": np.int64,
            }[qtype.name]
            data = np.frombuffer(mm, dtype=item, count=t.n_elements, offset=t.data_offset).reshape(np_shape)
        else:
            data = np.frombuffer(mm, dtype=np.uint8, count=t.n_bytes, offset=t.data_offset).reshape(
                (*np_shape[:-1], np_shape[-1] // block * type_size)
            )
        tensors.append(_SrcTensor(t.name, shape, qtype, t.n_elements, t.n_bytes, data))
    return _Source(kvs, tensors, layout.alignment, mm)


__all__ = ["ConvertResult", "convert"]
