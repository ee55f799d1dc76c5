"""One finished level: llama.cpp's temp file validated, hashed, synced and renamed
into place, registered in the store, and described.

The side-by-side scheduler in `quant.quantize` hands each finished job to
`finish` on a separate thread while the workers go on.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from edgellm.errors import GGUFError, QuantizeError
from edgellm.fsutil import fsync_path, human_size, sha256_file
from edgellm.gguf.reader import GGUFInfo, read_gguf
from edgellm.models.resolve import Resolved
from edgellm.models.store import ModelRecord, Store
from edgellm.progress import CancelToken
from quant._common import inherited_lineage, output_fields, register_output, result_json
from quant._workers import Job, Run
from quant.levels import QK_K, Level, is_quantized, type_bpw

if TYPE_CHECKING:
    from quant.imatrix import ImatrixChoice


@dataclass
class QuantizeResult:
    """One quantized file, registered in the store."""

    name: str
    level: str  # "q4_k_m"
    path: Path
    size_bytes: int
    bpw: float
    tensor_types: dict[str, int]  # {"Q5_0": 150, "F32": 61, ...}
    fallback_tensors: int  # tensors llama.cpp stored in another type (rows not a multiple of the block)
    tensor_count: int
    seconds: float  # the whole job for this level: quantize, validate, hash, register
    quantize_seconds: float = 0.0  # llama_model_quantize alone
    fallbacks: dict[str, int] = field(default_factory=dict)  # {"Q4_K->Q5_0": 150, ...}
    fallback_reason: str = ""
    input_level: str = ""
    parent: Optional[str] = None
    sha256: str = ""
    threads: int = 0
    warnings: list[str] = field(default_factory=list)
    record: Optional[ModelRecord] = None
    imatrix: Optional[dict[str, Any]] = None  # the importance matrix used (quant.imatrix.ImatrixChoice.lineage)
    recipe: Optional[dict[str, Any]] = None  # the per-tensor recipe applied (quant/budget.py)

    def to_json(self) -> dict[str, Any]:
        return result_json(self)


def finish(
    job: Job,
    *,
    resolved: Resolved,
    info: GGUFInfo,
    nthread: int,
    warnings: list[str],
    store: Store,
    cancel: Optional[CancelToken],
    imatrix: Optional[ImatrixChoice] = None,
    recipe: Optional[dict[str, Any]] = None,
) -> QuantizeResult:
    """Validate, hash and sync one finished temp file, rename it into place and register it."""
    lv, plan, tmp = job.level, job.plan, job.tmp
    try:
        # hashing (hashlib drops the GIL) and the fsync overlap the validation
        with ThreadPoolExecutor(2) as pool:
            hashing = pool.submit(sha256_file, tmp, cancel=cancel)
            syncing = pool.submit(fsync_path, tmp)
            try:
                out = read_gguf(tmp)
            except GGUFError as e:
                raise QuantizeError(f"llama.cpp wrote an invalid {lv.key} file: {e}") from None
            finally:
                sha = hashing.result()
                syncing.result()
        if out.tensor_count != info.tensor_count:
            raise QuantizeError(f"the {lv.key} file has {out.tensor_count} tensors, the input {info.tensor_count}")
        os.replace(tmp, plan.path)
        fsync_path(plan.path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

    run = job.run
    fallback_types = Counter(f"{src.upper()}->{dst.upper()}" for _n, _c, _b, src, dst in run.fallbacks)
    n_fallback = run.n_fallback if run.n_fallback is not None else len(run.fallbacks)
    extra: dict[str, Any] = {
        "quantized_from": resolved.label,
        "input_level": info.level,
        "fallback_tensors": n_fallback,
        "threads": nthread,
    }
    if is_quantized(info):
        extra["requantized"] = True
    extra.update(inherited_lineage(resolved))
    if imatrix is not None:
        extra["imatrix"] = imatrix.lineage()
    if recipe is not None:
        extra["recipe"] = recipe
    rec = register_output(store, plan, out, sha, resolved=resolved, source="quantize", extra=extra)
    return QuantizeResult(
        **output_fields(rec, plan, out, sha),
        fallback_tensors=n_fallback,
        tensor_count=out.tensor_count,
        seconds=time.perf_counter() - job.t0,
        quantize_seconds=run.seconds,
        fallbacks=dict(fallback_types),
        fallback_reason=fallback_reason(run, n_fallback, out.tensor_count, lv),
        input_level=info.level,
        threads=job.threads,
        warnings=list(warnings),
        imatrix=extra.get("imatrix"),
        recipe=extra.get("recipe"),
    )


def fallback_reason(run: Run, n: int, total: int, lv: Level) -> str:
    if not n:
        return ""
    cols = sorted({c for _n, c, _b, _s, _d in run.fallbacks})
    blocks = sorted({b for _n, _c, b, _s, _d in run.fallbacks}) or [QK_K]
    pairs = Counter((s.upper(), d.upper()) for _n, _c, _b, s, d in run.fallbacks)
    swaps = ", ".join(f"{s} -> {d} ({type_bpw(s):g} -> {type_bpw(d):g} bpw)" for (s, d), _k in pairs.most_common())
    width = "/".join(str(c) for c in cols) or "?"
    return (
        f"{n} of {total} tensors have rows of {width} values, not a multiple of the {'/'.join(map(str, blocks))}-value "
        f"block of the type {lv.key} picks for them, so llama.cpp stored them in a 32-block type instead: {swaps}. "
        f"That is why this file is larger than {lv.key}'s nominal {lv.bpw:g} bits/weight."
    )


def describe(result: QuantizeResult) -> str:
    """The text report for one output (the CLI prints it)."""
    types = ", ".join(f"{k} {v}" for k, v in sorted(result.tensor_types.items(), key=lambda kv: -kv[1]))
    lines = [
        f"{result.name}: {result.level}, {human_size(result.size_bytes)}, {result.bpw:.2f} bits/weight, {result.seconds:.1f} s",
        f"  {result.path}",
        f"  tensors: {types}",
    ]
    if result.imatrix:
        im = result.imatrix
        lines.append(
            f"  imatrix: {im.get('name') or im['file']} ({im.get('text') or ', '.join(im['datasets'])}, "
            f"{im['chunks']} chunks x {im['chunk_size']})"
        )
    if result.fallback_tensors:
        lines.append(f"  fallback: {result.fallback_reason}")
    return "\n".join(lines)
