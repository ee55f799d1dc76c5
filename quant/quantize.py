"""Quantize a GGUF to one or more llama.cpp levels, exactly as llama-quantize does.

The work is llama.cpp's own `llama_model_quantize`, called through
llama-cpp-python with `llama_model_quantize_default_params()` plus the file
type, thread count and allow_requantize, so the output is what
`llama-quantize IN OUT LEVEL THREADS` writes (scripts/bench_quantize.py
checks both bytes and speed).

That call is one blocking C function, so it runs in a child process
(quant/_quantize_worker.py) that writes to `<output>.<pid>.partial`; the
parent streams its per-tensor log lines into progress events, kills it on
cancel, survives a llama.cpp abort, validates the finished file with
`read_gguf` and only then renames and registers it. A killed parent takes the
child with it (PDEATHSIG) and its temp file is removed at the next start.

Fallbacks: K- and most i-quants pack 256 values per block. A tensor whose
rows are not a multiple of 256 (SmolLM2-135M is 576 wide: 180 of its 272
tensors) is stored by llama.cpp in a 32-block type instead (Q4_K → Q5_0,
Q5_K → Q5_1, Q6_K → Q8_0, ...). The report counts them from llama.cpp's own
log, because they are why such a model's Q4_K_M file is larger than its Q4_0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from edgellm.errors import BackendCrash, Cancelled, GGUFError, QuantizeError, UsageError
from edgellm.fsutil import atomic_path, check_free_disk, human_size, sha256_file
from edgellm.gguf_file import GGUFInfo, read_gguf
from edgellm.models import Resolved, resolve
from edgellm.progress import CancelToken, Progress, ProgressCallback, RateMeter, no_progress
from edgellm.store import ModelRecord, Store

from ._common import FLOAT_LEVELS, OutputPlan, check_writable, inherited_lineage, plan_output, register_output
from .levels import FALLBACK, QK_K, Level, parse_level, type_bpw

log = logging.getLogger(__name__)

_TENSOR_RE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
_FALLBACK_RE = re.compile(
    r"warning:\s+(\S+)\s+- ncols\s+(\d+) not divisible by\s+(\d+) \(required for type\s+(\S+)\).*?-> falling back to\s+(\S+)"
)
_N_FALLBACK_RE = re.compile(r"WARNING: (\d+) of (\d+) tensor\(s\) required fallback")
_FAILED_RE = re.compile(r"failed to quantize: (.*)")
_WORKER = "quant._quantize_worker"


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

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "level": self.level,
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "bpw": round(self.bpw, 4),
            "tensor_types": self.tensor_types,
            "tensor_count": self.tensor_count,
            "fallback_tensors": self.fallback_tensors,
            "fallbacks": self.fallbacks,
            "fallback_reason": self.fallback_reason,
            "seconds": round(self.seconds, 3),
            "quantize_seconds": round(self.quantize_seconds, 3),
            "threads": self.threads,
            "input_level": self.input_level,
            "parent": self.parent,
            "sha256": self.sha256,
            "warnings": self.warnings,
        }


@dataclass
class _Run:
    """What the worker reported about one llama_model_quantize call."""

    rc: Optional[int] = None
    seconds: float = 0.0
    fallbacks: list[tuple[str, int, int, str, str]] = field(default_factory=list)  # name, ncols, block, from, to
    n_fallback: Optional[int] = None
    error: str = ""
    tail: deque = field(default_factory=lambda: deque(maxlen=40))


def quantize(
    model_ref_or_path: str | Path,
    levels: Sequence[str] | str,
    *,
    output: Optional[Path | str] = None,
    threads: Optional[int] = None,
    allow_requantize: bool = False,
    force: bool = False,
    store: Optional[Store] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> list[QuantizeResult]:
    """Quantize a model to each of `levels` ("q4_k_m", "Q8_0", ...); one result per level.

    Outputs go to `<models>/<name>/<name>.gguf` with `name` the input's name
    with its level suffix swapped (`smollm2-135m-instruct-q4_k_m`). `output`
    is a file path (one level) or a folder. Every level is checked (known,
    no importance matrix needed, not the input's own type, output free or
    `force`, disk space) before the first one starts; levels then run in
    order, and each finished level stays registered if a later one fails.

    Raises UsageError (unknown level, no level, -o file with several levels),
    ModelNotFound, GGUFError, QuantizeError (importance matrix needed, same
    type, requantizing without `allow_requantize`, llama.cpp failure or write
    error), BackendCrash (llama.cpp killed the worker), ModelExists,
    InsufficientResources, Cancelled.
    """
    store = store or Store()
    if isinstance(levels, str):
        levels = [levels]
    if not levels:
        raise UsageError("give at least one level (--level q4_k_m)")
    wanted: list[Level] = []
    for text in levels:
        lv = parse_level(text)
        if lv not in wanted:
            wanted.append(lv)
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1, not {threads}")
    nthread = threads or _default_threads()
    worker = _Worker()
    try:
        return _quantize_all(model_ref_or_path, wanted, worker, output=output, nthread=nthread, allow_requantize=allow_requantize,
                             force=force, store=store, on_progress=on_progress, cancel=cancel)
    finally:
        worker.close()


def _quantize_all(
    model_ref_or_path: str | Path,
    wanted: list[Level],
    worker: "_Worker",
    *,
    output: Optional[Path | str],
    nthread: int,
    allow_requantize: bool,
    force: bool,
    store: Store,
    on_progress: ProgressCallback,
    cancel: Optional[CancelToken],
) -> list[QuantizeResult]:
    resolved = resolve(str(model_ref_or_path), store=store)
    info = read_gguf(resolved.path)
    label = resolved.label
    if info.split_count > 1:
        raise QuantizeError(f"{label} is a split GGUF; merge it first (llama-gguf-split --merge)")
    warnings = _check_levels(wanted, info, label, allow_requantize=allow_requantize)

    if output is not None and len(wanted) > 1:
        out = Path(output).expanduser()
        if not out.is_dir():
            raise UsageError(f"-o {output}: with several levels, -o must be an existing folder")
    plans = [plan_output(resolved, info, lv.key, output=output, name=None, force=force, store=store) for lv in wanted]
    if len({p.path for p in plans}) != len(plans):
        raise UsageError("two levels would write the same file; give -o a folder")
    need: dict[Path, int] = {}
    for lv, plan in zip(wanted, plans):
        check_writable(plan.path.parent)
        need[plan.path.parent] = need.get(plan.path.parent, 0) + estimate_size(info, lv)
    for folder, n in need.items():
        check_free_disk(folder, n, what=f"quantizing {label} to {', '.join(lv.key for lv in wanted)}")
    for w in warnings:
        log.warning("%s", w)

    results = []
    for lv, plan in zip(wanted, plans):
        if cancel is not None:
            cancel.check()
        results.append(_quantize_one(worker, resolved, info, lv, plan, nthread=nthread, allow_requantize=allow_requantize,
                                     warnings=warnings, store=store, on_progress=on_progress, cancel=cancel))
    return results


def _default_threads() -> int:
    from edgellm.runtime import default_threads

    return default_threads()


def is_quantized(info: GGUFInfo) -> bool:
    """A file whose weights are already quantized (anything beyond F32/F16/BF16)."""
    if info.level in FLOAT_LEVELS:
        return False
    return any(t not in ("F32", "F16", "BF16", "I8", "I16", "I32", "I64", "F64") for t in info.tensor_types)


def _check_levels(wanted: list[Level], info: GGUFInfo, label: str, *, allow_requantize: bool) -> list[str]:
    for lv in wanted:
        if lv.needs_imatrix:
            raise QuantizeError(
                f"{lv.key} needs an importance matrix (llama.cpp refuses it without one) and edgellm does not compute them; "
                "use iq4_xs, q2_k, q3_k_s or higher"
            )
        if not lv.readable:
            raise QuantizeError(f"{lv.key} output cannot be validated: the installed gguf-py does not know the {lv.base_type} tensor type")
        if info.file_type == lv.ftype:
            raise QuantizeError(f"{label} is already {lv.key}; pick another level")
    warnings = []
    if is_quantized(info):
        if not allow_requantize:
            raise QuantizeError(
                f"{label} is already quantized ({info.level}); requantizing compounds the errors. Quantize from an "
                f"F16/F32 file (`edgellm convert {label} --to f16` first), or pass --allow-requantize"
            )
        warnings.append(
            f"requantizing {label} ({info.level}): the errors compound (the new level's rounding adds to {info.level}'s); "
            "quantize from F16/F32 when you have it"
        )
    return warnings


def estimate_size(info: GGUFInfo, lv: Level) -> int:
    """A generous estimate of the output size, for the disk preflight.

    Fallbacks are assumed everywhere they could happen, and the token
    embedding (and an output matrix the same size) at up to 8.5 bits/weight:
    small models like SmolLM2 spend a fifth of their weights there.
    """
    meta = max(0, info.size_bytes - info.tensor_bytes)
    if lv.is_float:
        return meta + info.parameters * int(lv.bpw) // 8
    bits = max(lv.bpw, type_bpw(FALLBACK.get(lv.base_type, lv.base_type)))
    embd = min(info.parameters, 2 * info.embedding_length * info.vocab_size)
    rest = max(0, info.parameters - embd)
    return int(meta + embd * max(bits, 8.5) / 8 + rest * bits / 8 * 1.02)


def _quantize_one(
    worker: "_Worker",
    resolved: Resolved,
    info: GGUFInfo,
    lv: Level,
    plan: OutputPlan,
    *,
    nthread: int,
    allow_requantize: bool,
    warnings: list[str],
    store: Store,
    on_progress: ProgressCallback,
    cancel: Optional[CancelToken],
) -> QuantizeResult:
    t0 = time.perf_counter()
    task = f"quantize {resolved.label} -> {lv.key}"
    with atomic_path(plan.path) as tmp:
        run = worker.run(resolved.path, tmp, lv, nthread=nthread, allow_requantize=allow_requantize,
                         total=info.tensor_count, task=task, on_progress=on_progress, cancel=cancel)
        # hashing (hashlib drops the GIL) overlaps the validation
        with ThreadPoolExecutor(1) as pool:
            hashing = pool.submit(sha256_file, tmp, cancel=cancel)
            try:
                out = read_gguf(tmp)
            except GGUFError as e:
                raise QuantizeError(f"llama.cpp wrote an invalid {lv.key} file: {e}") from None
            finally:
                sha = hashing.result()
        if out.tensor_count != info.tensor_count:
            raise QuantizeError(f"the {lv.key} file has {out.tensor_count} tensors, the input {info.tensor_count}")

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
    try:
        rec = register_output(store, plan, out, sha, resolved=resolved, source="quantize", extra=extra)
    except BaseException:
        plan.path.unlink(missing_ok=True)
        raise
    return QuantizeResult(
        name=rec.name, level=out.level, path=plan.path, size_bytes=out.size_bytes, bpw=out.bpw,
        tensor_types=out.tensor_types, fallback_tensors=n_fallback, tensor_count=out.tensor_count,
        seconds=time.perf_counter() - t0, quantize_seconds=run.seconds, fallbacks=dict(fallback_types),
        fallback_reason=_fallback_reason(run, n_fallback, out.tensor_count, lv), input_level=info.level,
        parent=rec.parent, sha256=sha, threads=nthread, warnings=list(warnings), record=rec,
    )


def _fallback_reason(run: _Run, n: int, total: int, lv: Level) -> str:
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


def _worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class _Worker:
    """The worker process (quant/_quantize_worker.py), started before the
    parent's own checks so its start-up is not on the critical path, and
    reused for every level of one `quantize()` call."""

    def __init__(self) -> None:
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", _WORKER, str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_worker_env(),
            )
        except OSError as e:
            raise QuantizeError(f"cannot start the quantization worker: {e.strerror or e}") from None
        self.lines: queue.Queue = queue.Queue()
        self.stderr_tail: deque = deque(maxlen=20)
        self.readers = [threading.Thread(target=self._pump_stdout, daemon=True),
                        threading.Thread(target=self._pump_stderr, daemon=True)]
        for r in self.readers:
            r.start()

    def _pump_stdout(self) -> None:
        for raw in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(raw)
        self.lines.put(None)

    def _pump_stderr(self) -> None:
        for raw in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr_tail.append(raw.decode("utf-8", "replace").rstrip())

    def close(self) -> None:
        """Stop the worker. Between jobs it holds nothing worth a graceful exit
        (and may still be importing when an early check failed), so it is killed."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        self.kill()
        for r in self.readers:
            r.join(timeout=2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def run(
        self,
        src: Path,
        tmp: Path,
        lv: Level,
        *,
        nthread: int,
        allow_requantize: bool,
        total: int,
        task: str,
        on_progress: ProgressCallback,
        cancel: Optional[CancelToken],
    ) -> _Run:
        """Run llama_model_quantize in the worker; stream its log into progress."""
        job = {"input": str(src), "output": str(tmp), "ftype": lv.ftype, "nthread": nthread, "allow_requantize": allow_requantize}
        run = _Run()
        meter = RateMeter()
        on_progress(Progress(task, 0, total, "tensor", message="loading"))
        try:
            try:
                self.proc.stdin.write((json.dumps(job) + "\n").encode())  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass  # it died; the EOF below says how
            while run.rc is None:
                if cancel is not None and cancel.cancelled:
                    raise Cancelled(cancel.reason)
                try:
                    raw = self.lines.get(timeout=0.1)
                except queue.Empty:
                    continue
                if raw is None:
                    break
                try:
                    msg = json.loads(raw)
                except ValueError:
                    continue
                if "done" in msg:
                    run.rc, run.seconds = int(msg["done"]), float(msg.get("seconds", 0.0))
                elif "log" in msg:
                    _parse_log(run, msg["log"], task=task, total=total, meter=meter, on_progress=on_progress)
        except BaseException:
            self.kill()
            raise
        if run.rc is None:
            self.proc.wait()
            rc = self.proc.returncode
            for r in self.readers:
                r.join(timeout=2)
            if rc is not None and rc < 0:
                import signal as _signal

                try:
                    sig = _signal.Signals(-rc).name
                except ValueError:
                    sig = f"signal {-rc}"
                raise BackendCrash(f"llama.cpp died ({sig}) while quantizing to {lv.key}: {_last_words(run, self.stderr_tail)}")
            raise QuantizeError(f"the quantization worker failed (exit {rc}): {_last_words(run, self.stderr_tail)}")
        if run.rc != 0:
            reason = run.error or _last_words(run, self.stderr_tail)
            if "iostream error" in reason or "failbit" in reason:
                reason = f"could not write {tmp.parent} (disk full or a file size limit?) [{reason}]"
            raise QuantizeError(f"llama.cpp could not quantize to {lv.key}: {reason}")
        on_progress(Progress(task, total, total, "tensor", message="done"))
        return run


def _parse_log(run: _Run, line: str, *, task: str, total: int, meter: RateMeter, on_progress: ProgressCallback) -> None:
    run.tail.append(line)
    if m := _FAILED_RE.search(line):  # may share a line with the tensor it failed on
        run.error = m.group(1).strip()
    if m := _TENSOR_RE.match(line):
        done, n = int(m.group(1)), int(m.group(2))
        on_progress(Progress(task, done, n or total, "tensor", message=m.group(3), rate=meter.update(done)))
    elif m := _FALLBACK_RE.search(line):
        run.fallbacks.append((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4), m.group(5)))
    elif m := _N_FALLBACK_RE.search(line):
        run.n_fallback = int(m.group(1))


def _last_words(run: _Run, stderr_tail: deque) -> str:
    for line in list(run.tail)[::-1] + list(stderr_tail)[::-1]:
        text = line.strip(" =\n")
        if text and not text.startswith("["):
            return text[:300]
    return "no output"


def describe(result: QuantizeResult) -> str:
    """The text report for one output (the CLI prints it)."""
    types = ", ".join(f"{k} {v}" for k, v in sorted(result.tensor_types.items(), key=lambda kv: -kv[1]))
    lines = [
        f"{result.name}: {result.level}, {human_size(result.size_bytes)}, {result.bpw:.2f} bits/weight, {result.seconds:.1f} s",
        f"  {result.path}",
        f"  tensors: {types}",
    ]
    if result.fallback_tensors:
        lines.append(f"  fallback: {result.fallback_reason}")
    return "\n".join(lines)


__all__ = ["QuantizeResult", "quantize", "estimate_size", "is_quantized", "describe"]
