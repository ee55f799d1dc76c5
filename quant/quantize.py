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

Several levels run two at a time, each worker getting half of `threads`:
llama_model_quantize keeps two threads busy only ~60% of the time (one
thread reads, converts and writes between the parallel parts), so two
levels side by side finish four levels in ~0.7x the time of one after
another with the same total threads, byte for byte the same files
(docs/quantize.md). A finished level is validated, hashed and registered on
a separate thread while the workers go on.

Fallbacks: K- and most i-quants pack 256 values per block. A tensor whose
rows are not a multiple of 256 (SmolLM2-135M is 576 wide: 180 of its 272
tensors) is stored by llama.cpp in a 32-block type instead (Q4_K → Q5_0,
Q5_K → Q5_1, Q6_K → Q8_0, ...). The report counts them from llama.cpp's own
log, because they are why such a model's Q4_K_M file is larger than its Q4_0.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from edgellm.engine.memory import available_ram, default_threads
from edgellm.errors import Cancelled, QuantizeError, UsageError
from edgellm.fsutil import check_free_disk, partial_path, sync_soon
from edgellm.gguf.reader import GGUFInfo
from edgellm.models.resolve import Resolved
from edgellm.models.store import Store
from edgellm.progress import CancelToken, Progress, ProgressCallback, RateMeter, no_progress
from quant._common import BaseInput, OutputPlan, check_writable, open_input, plan_output
from quant._workers import Job, Worker, llama_failure, parse_log
from quant.levels import Level, check_levels, estimate_size, parse_level
from quant.quantize_result import QuantizeResult, describe, finish
from quant.rounding import STOCK

if TYPE_CHECKING:  # annotations only: quant.imatrix loads numpy and the engine, which a plain level never needs
    from quant.imatrix import ImatrixChoice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorOverrides:
    """Per-tensor types for llama.cpp (its tt_overrides), what the output records about them, and its name."""

    pairs: list[tuple[str, int]]  # (regex over tensor names, ggml type id), first match wins
    lineage: dict[str, Any]  # the recipe's file, budget, ... as the store record keeps it
    label: str  # names the output in place of the level: `<base>-budget-90mb`
    rounding: str = STOCK  # how blocks are rounded (quant.rounding: BUDGET for --budget, a recipe's own for --recipe)
    # run on the finished temp file before it is validated and renamed (quant/feedback.py's error feedback)
    rewrite: Optional[Callable[[Path], None]] = None


# long: the public entry point: its keyword arguments are the API (15 lines), then workers set up and always closed
def quantize(
    model_ref_or_path: str | Path | BaseInput,
    levels: Sequence[str] | str,
    *,
    output: Optional[Path | str] = None,
    threads: Optional[int] = None,
    allow_requantize: bool = False,
    force: bool = False,
    jobs: Optional[int] = None,
    imatrix: Optional[str | ImatrixChoice] = None,
    overrides: Optional[TensorOverrides] = None,
    store: Optional[Store] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> list[QuantizeResult]:
    """Quantize a model to each of `levels` ("q4_k_m", "Q8_0", ...); one result per level.

    `threads` is the total for llama.cpp; `jobs` how many levels run side by
    side, sharing those threads (default: 2 when there are several levels,
    at least 2 threads and RAM for both; 1 runs them one after another).

    Outputs go to `<models>/<name>/<name>.gguf` with `name` the input's name
    with its level suffix swapped (`smollm2-135m-instruct-q4_k_m`). `output`
    is a file path (one level) or a folder. Every level is checked (known,
    no importance matrix needed, not the input's own type, output free or
    `force`, disk space) before the first one starts; levels then run in
    order (two at a time, see `jobs`), and each finished level stays
    registered if another one fails. Results come back in the order asked.

    `imatrix` (a stored matrix's name, an imatrix GGUF file, or "auto": see
    quant.imatrix.choose_imatrix, or the ImatrixChoice it returned) is passed
    to llama.cpp as llama-quantize --imatrix passes it; it makes the levels
    that need one available and names the outputs `<base>-<level>-imat`.
    `overrides` (quant/budget.py's and quant/recipe.py's per-tensor types) go
    to llama.cpp as tt_overrides, and their label names the output.
    `model_ref_or_path` may be a BaseInput (quant._common.open_input) that the
    caller already resolved and parsed: it is not parsed again.

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
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs must be at least 1, not {jobs}")
    nthread = threads or _default_threads()
    n_slots = min(len(wanted), nthread, jobs if jobs is not None else MAX_JOBS)
    # started before the checks, so their start-up is not on the critical path
    events: queue.Queue = queue.Queue()
    workers: list[Worker] = []
    try:
        for n in _split(nthread, n_slots):
            workers.append(Worker.get(events, n))
        return _quantize_all(
            model_ref_or_path,
            wanted,
            workers,
            events,
            output=output,
            nthread=nthread,
            allow_requantize=allow_requantize,
            force=force,
            imatrix=imatrix,
            store=store,
            on_progress=on_progress,
            cancel=cancel,
            overrides=overrides,
        )
    finally:
        for w in workers:
            w.close()


MAX_JOBS = 2  # more side-by-side levels only multiply llama.cpp's buffers: two fill the idle thread


def _split(nthread: int, n: int) -> list[int]:
    """`nthread` threads over `n` workers, the first ones getting the remainder."""
    return [nthread // n + (1 if i < nthread % n else 0) for i in range(n)]


def _quantize_all(
    model_ref_or_path: str | Path | BaseInput,
    wanted: list[Level],
    workers: list[Worker],
    events: queue.Queue,
    *,
    output: Optional[Path | str],
    nthread: int,
    allow_requantize: bool,
    force: bool,
    imatrix: Optional[str | ImatrixChoice],
    store: Store,
    on_progress: ProgressCallback,
    cancel: Optional[CancelToken],
    overrides: Optional[TensorOverrides] = None,
) -> list[QuantizeResult]:
    src = open_input(model_ref_or_path, store)
    resolved, info, label = src.resolved, src.info, src.label
    if info.split_count > 1:
        raise QuantizeError(f"{label} is a split GGUF; merge it first (llama-gguf-split --merge)")
    warnings = check_levels(wanted, info, label, allow_requantize=allow_requantize, has_imatrix=imatrix is not None)
    choice = None
    if imatrix is not None:
        from quant.imatrix import choose_imatrix

        choice = (
            imatrix
            if not isinstance(imatrix, str)
            else choose_imatrix(imatrix, resolved, store=store, on_progress=on_progress, cancel=cancel)
        )

    if output is not None and len(wanted) > 1:
        out = Path(output).expanduser()
        if not out.is_dir():
            raise UsageError(f"-o {output}: with several levels, -o must be an existing folder")
    suffix = "-imat" if choice is not None else ""
    plans = [
        plan_output(
            resolved, info, overrides.label if overrides else lv.key + suffix, output=output, name=None, force=force, store=store
        )
        for lv in wanted
    ]
    if len({p.path for p in plans}) != len(plans):
        raise UsageError("two levels would write the same file; give -o a folder")
    need: dict[Path, int] = {}
    for lv, plan in zip(wanted, plans, strict=False):
        check_writable(plan.path.parent)
        need[plan.path.parent] = need.get(plan.path.parent, 0) + estimate_size(info, lv)
    for folder, n in need.items():
        check_free_disk(folder, n, what=f"quantizing {label} to {', '.join(lv.key for lv in wanted)}")
    for w in warnings:
        log.warning("%s", w)
    if len(workers) > 1 and not _fits_side_by_side(info, len(workers)):
        log.info("not enough free RAM for %d levels side by side: one at a time", len(workers))
        for spare in workers[1:]:
            spare.close()
        del workers[1:]
        workers[0].threads = nthread
    if cancel is not None:
        cancel.check()
    return _run_levels(
        resolved,
        info,
        list(zip(wanted, plans, strict=False)),
        workers,
        events,
        nthread=nthread,
        allow_requantize=allow_requantize,
        warnings=warnings,
        store=store,
        on_progress=on_progress,
        cancel=cancel,
        imatrix=choice,
        overrides=overrides,
    )


def _fits_side_by_side(info: GGUFInfo, n: int) -> bool:
    """Whether n llama_model_quantize calls fit in free RAM at once.

    Each holds its largest tensor as F32 (plus the input and output copies of
    it) while working on it; the weights themselves are mmapped and shared.
    The largest is the token embedding in practice (vocab x width), else a
    layer's share of the weights.
    """

    largest = max(info.vocab_size * info.embedding_length, info.parameters // max(1, 4 * info.block_count))
    per_job = largest * (4 + 2 + 2) + (64 << 20)
    return available_ram() > n * per_job + (512 << 20)


def _default_threads() -> int:
    return default_threads()


# long: the scheduler of the side-by-side workers: start, stream progress, cancel and finish in one loop, so the order of events is visible
def _run_levels(
    resolved: Resolved,
    info: GGUFInfo,
    todo: list[tuple[Level, OutputPlan]],
    workers: list[Worker],
    events: queue.Queue,
    *,
    nthread: int,
    allow_requantize: bool,
    warnings: list[str],
    store: Store,
    on_progress: ProgressCallback,
    cancel: Optional[CancelToken],
    imatrix: Optional[ImatrixChoice] = None,
    overrides: Optional[TensorOverrides] = None,
) -> list[QuantizeResult]:
    """Feed the levels to the workers; finish each one on a side thread as it completes."""
    per_level = info.tensor_count
    total = per_level * len(todo)
    task = f"quantize {resolved.label} -> {', '.join(lv.key for lv, _p in todo)}"
    # slowest first, so that the last level to finish is a short one and no
    # worker idles long at the end (K- and i-quants search; the rest just round)
    pending = deque(sorted(range(len(todo)), key=lambda i: -_cost(todo[i][0])))
    active: dict[Worker, Job] = {}
    finishing: dict[int, Future] = {}
    meter = RateMeter()
    finisher = ThreadPoolExecutor(1, thread_name_prefix="quantize-finish")

    def start(worker: Worker) -> None:
        index = pending.popleft()
        lv, plan = todo[index]
        job = Job(index, lv, plan, partial_path(plan.path), worker.threads, time.perf_counter())
        spec = {
            "input": str(resolved.path),
            "output": str(job.tmp),
            "ftype": lv.ftype,
            "nthread": worker.threads,
            "allow_requantize": allow_requantize,
        }
        if imatrix is not None:
            spec.update(imatrix=str(imatrix.path), imatrix_label=str(imatrix.path))
        if overrides is not None and overrides.pairs:
            spec["tt_overrides"] = [list(p) for p in overrides.pairs]
        if overrides is not None and overrides.rounding:
            spec["rounding"] = overrides.rounding
        worker.submit(spec)
        active[worker] = job

    def report(message: str) -> None:
        done = per_level * len(finishing) + sum(j.done for j in active.values())
        on_progress(Progress(task, done, total, "tensor", message=message, rate=meter.update(done)))

    on_progress(Progress(task, 0, total, "tensor", message="loading"))
    flushed, syncing = time.perf_counter(), None
    try:
        for w in workers:
            if pending:
                start(w)
        finisher.submit(store.prepare_write)  # while llama.cpp works, not after it
        while active:
            if cancel is not None and cancel.cancelled:
                raise Cancelled(cancel.reason)
            if time.perf_counter() - flushed > 0.25 and not (syncing and syncing.is_alive()):
                # the outputs go to disk as they grow: finish's fsync is then short
                flushed, syncing = time.perf_counter(), sync_soon([j.tmp for j in active.values()])
            for f in finishing.values():
                if f.done() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            try:
                worker, raw = events.get(timeout=0.1)
            except queue.Empty:
                continue
            job = active.get(worker)
            if job is None:
                continue
            if raw is None:
                raise worker.death(job)
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if "log" in msg:
                tensor = parse_log(job.run, msg["log"])
                if tensor is not None:
                    job.done = min(tensor[0], per_level)
                    report(f"{job.level.key}: {tensor[1]}")
            elif "done" in msg:
                job.run.rc, job.run.seconds = int(msg["done"]), float(msg.get("seconds", 0.0))
                if job.run.rc != 0:
                    raise llama_failure(job, worker, resolved.label)
                del active[worker]
                finishing[job.index] = finisher.submit(
                    _rewrite_then_finish,
                    overrides.rewrite if overrides else None,
                    job,
                    resolved=resolved,
                    info=info,
                    nthread=nthread,
                    warnings=warnings,
                    store=store,
                    cancel=cancel,
                    imatrix=imatrix,
                    recipe=overrides.lineage if overrides else None,
                )
                if pending:
                    start(worker)
                report(f"{job.level.key}: written")
        results = [finishing[i].result() for i in sorted(finishing)]
    except BaseException:
        for w in workers:
            w.kill()
        for job in active.values():
            job.tmp.unlink(missing_ok=True)
        # a level llama.cpp already finished is still validated and registered (as
        # when levels ran one after another), unless this is a cancel, which stops
        # its hashing too; then the error goes up
        finisher.shutdown(wait=True)
        raise
    finisher.shutdown(wait=True)
    on_progress(Progress(task, total, total, "tensor", message="done"))
    return results


def _rewrite_then_finish(rewrite: Optional[Callable[[Path], None]], job: Job, **kw: Any) -> QuantizeResult:
    if rewrite is not None:
        try:
            rewrite(job.tmp)
        except BaseException:
            job.tmp.unlink(missing_ok=True)
            raise
    return finish(job, **kw)


def _cost(lv: Level) -> float:
    """Relative llama_model_quantize time of a level (for ordering only)."""
    if lv.is_float:
        return 0.5
    return 3.0 if lv.base_type.endswith("_K") or lv.base_type.startswith("IQ") else 1.0


__all__ = ["QuantizeResult", "TensorOverrides", "quantize", "describe"]
