"""The profiler: tokens/s with llama-bench's definitions, and honest memory.

`bench()` measures prompt processing (pp) and generation (tg) tokens/s as
llama.cpp's `llama-bench` does (mean ± sd of per-repetition tokens/s), time to
first token and load time, and splits resident memory into the file-backed
pages of the mmapped weights and the anonymous pages (KV cache, compute
buffers) that are really private. Each model runs in its own child process
(`edgellm.profile._worker`), so its memory figures are not polluted by models
benchmarked before it.

It also owns the memory-bandwidth probe and the generation roofline it
implies (probed before and right after each model's runs, the mean of the
two: `Bandwidth.bracket`), the comparison with a `llama-bench` built from the same vendored
llama.cpp, the results kept per model and machine under
`results_dir()/bench/` (read by `recommend` and the TUI through
`load_bench_results`), the `--plot` PNG, and `LiveSampler`, the tokens/s and
RSS meter that chat's `/stats` and the TUI show while generating.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from edgellm.engine import backends, hardware
from edgellm.engine.gpu import plan_offload
from edgellm.engine.hardware import SIGNAL_HINTS
from edgellm.engine.memory import kv_bytes_per_token
from edgellm.errors import BackendCrash, Cancelled, RuntimeFailure, UsageError
from edgellm.gguf.reader import read_gguf, split_set
from edgellm.models.resolve import resolve
from edgellm.profile.llama_bench import _attach_llama_bench
from edgellm.profile.results import machine_id, save_results
from edgellm.profile.rows import Bandwidth, BenchRow
from edgellm.profile.settings import BenchSettings
from edgellm.progress import CancelToken, Progress, ProgressCallback, no_progress

log = logging.getLogger(__name__)

BANDWIDTH_BYTES = 256 << 20


# -- the benchmark ---------------------------------------------------------------


# long: per model: plan, run the child, collect rows, compare with llama-bench, save; one loop a reader follows top to bottom
def bench(
    paths_or_refs: Sequence[str | Path],
    settings: BenchSettings = BenchSettings(),
    *,
    use_mmap: bool = True,
    mlock: bool = False,
    n_gpu_layers: int | str = 0,
    gpu_device: Optional[str] = None,
    gpu_mem: Optional[int] = None,
    warn=None,
    measure_bandwidth: bool = True,
    compare_llama_bench: bool = False,
    save: bool = True,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> list[BenchRow]:
    """Benchmark each model (a store name, catalog ref or GGUF path): a pp row and a tg row per model."""

    settings.check()
    if not paths_or_refs:
        raise UsageError("name at least one model to benchmark")
    n_threads, repetitions = settings.n_threads, settings.repetitions
    targets = []
    for ref in paths_or_refs:
        res = resolve(str(ref))
        info = read_gguf(res.path)  # a bad file fails here, before llama.cpp sees it
        label = res.record.name if res.record else res.path.name
        targets.append((label, res.path, info, [str(p) for p in split_set(res.path)]))

    # the portable build: choose (and remember) its CPU variant here, self-tested in a child, so the
    # workers below load a variant known to run and spend none of their time on the choice
    backends.choose(targets[0][1], tester=hardware.self_test)
    bw = measure_bandwidth_now(threads=n_threads) if measure_bandwidth else None
    tests = settings.tests()
    mid, stamp = machine_id(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    all_rows: list[BenchRow] = []
    model_bw: dict[str, Bandwidth] = {}
    for mi, (label, path, info, files) in enumerate(targets):
        plan = _gpu_plan(
            path,
            info,
            n_gpu_layers,
            ctx=settings.n_ctx or max(settings.pp, settings.tg),
            gpu_device=gpu_device,
            gpu_mem=gpu_mem,
            warn=warn or (lambda m: log.warning("%s", m)),
        )
        req = {**settings.request(path, files, use_mmap=use_mmap, mlock=mlock), **plan.llama_kwargs()}
        total = len(tests) * repetitions * len(targets)

        def forward(ev: dict[str, Any], mi=mi, label=label, total=total) -> None:
            done = mi * len(tests) * repetitions + ev["done"] + (repetitions if ev["test"] != tests[0]["name"] else 0)
            on_progress(Progress("bench", done, total, "rep", f"{label} {ev['test']} {ev['done']}/{ev['total']}"))

        raw_rows, done = _run_worker(req, label=label, on_event=forward, cancel=cancel)
        row_bw = None
        if bw is not None:
            # again right after the runs (tg runs last): the host's bandwidth drifts while they run
            after = measure_bandwidth_now(threads=n_threads)
            row_bw, bw = Bandwidth.bracket(bw, after), after  # this probe is the next model's "before"
            model_bw[label] = row_bw
        for r in raw_rows:
            row = BenchRow(
                model=label,
                model_filename=str(path),
                model_type=info.level,
                model_size=int(info.tensor_bytes),
                model_n_params=int(info.parameters),
                test=r["test"],
                n_prompt=r["n_prompt"],
                n_gen=r["n_gen"],
                n_threads=n_threads,
                n_ctx=r["n_ctx"],
                n_batch=r["n_batch"],
                n_ubatch=r["n_ubatch"],
                n_gpu_layers=r.get("offloaded_layers", 0),
                use_mmap=use_mmap,
                mlock=mlock,
                samples_ns=r["samples_ns"],
                avg_ts=r["avg_ts"],
                stddev_ts=r["stddev_ts"],
                rss_bytes=r["rss_bytes"],
                file_backed_bytes=r["file_backed_bytes"],
                anon_bytes=r["anon_bytes"],
                kv_bytes=kv_bytes_per_token(info) * r["n_ctx"],
                kv_buffer_bytes=r["kv_buffer_bytes"],
                compute_buffer_bytes=r["compute_buffer_bytes"],
                output_buffer_bytes=r["output_buffer_bytes"],
                load_seconds=done["load_seconds"],
                ttft_seconds=done["ttft_seconds"],
                file_bytes=sum(Path(f).stat().st_size for f in files),
                machine_id=mid,
                timestamp=stamp,
                gpu_device=plan.device.label if plan.device and r.get("offloaded_layers") else "",
                device_bytes=r.get("device_bytes", 0),
                host_bytes=r.get("host_bytes", 0),
                extra={
                    k: r[k]
                    for k in ("process_anon_bytes", "process_file_bytes", "baseline_rss_bytes", "rss_now_bytes", "threadpool")
                    if k in r
                },
            )
            if row_bw is not None:
                row.bandwidth_bytes_per_s = row_bw.read_bytes_per_s
                if row.n_gen and not row.n_prompt and row.model_size:
                    row.read_bytes_per_token = token_read_bytes(info, row.n_gen)
                    row.roofline_ts = row_bw.read_bytes_per_s / row.read_bytes_per_token
                    row.roofline_fraction = row.avg_ts / row.roofline_ts
            all_rows.append(row)
    if compare_llama_bench:
        _attach_llama_bench(
            all_rows,
            [t[1] for t in targets],
            settings,
            use_mmap=use_mmap,
            mlock=mlock,
            n_gpu_layers=all_rows[0].n_gpu_layers if all_rows else 0,
            cancel=cancel,
        )
    if save:
        for label, *_ in targets:
            save_results(label, [r for r in all_rows if r.model == label], bandwidth=model_bw.get(label))
    return all_rows


def _gpu_plan(path: Path, info, request, *, ctx: int, gpu_device: Optional[str], gpu_mem: Optional[int], warn):
    """The same offload plan chat uses (edgellm.engine.gpu); its notes and, when offload was asked for, the plan go to `warn`."""

    plan = plan_offload(path, info, request, ctx=ctx, gpu_device=gpu_device, gpu_mem=gpu_mem)
    for note in plan.notes:
        warn(f"warning: {note}")
    if plan.n_gpu_layers or (plan.requested != "0" and not plan.notes):
        warn(plan.describe())
    return plan


def _run_worker(req: dict[str, Any], *, label: str, on_event, cancel: Optional[CancelToken]) -> tuple[list[dict], dict]:
    """Run one model in `python -m edgellm.profile._worker`; return its rows and its `done` record."""

    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgellm.profile._worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
        lines: queue.Queue[Optional[str]] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(req))
        proc.stdin.close()
        rows: list[dict] = []
        done: Optional[dict] = None
        error: Optional[dict] = None
        try:
            while True:
                if cancel is not None and cancel.cancelled:
                    raise Cancelled(cancel.reason)
                try:
                    line = lines.get(timeout=0.1)
                except queue.Empty:
                    continue
                if line is None:
                    break
                if not line.startswith("{"):
                    continue
                ev = json.loads(line)
                kind = ev.get("event")
                if kind == "progress":
                    on_event(ev)
                elif kind == "row":
                    rows.append(ev)
                elif kind == "done":
                    done = ev
                elif kind == "error":
                    error = ev
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if rc < 0:
            sig = signal.Signals(-rc).name
            raise BackendCrash(f"{sig} in llama.cpp while benchmarking {label}: {SIGNAL_HINTS.get(sig, 'llama.cpp crashed')}")
        if error is not None:
            raise RuntimeFailure(error["message"])
        if rc != 0 or done is None:
            err.seek(0)
            tail = [ln for ln in err.read().strip().splitlines() if ln.strip()]
            raise RuntimeFailure(f"benchmarking {label} failed: {tail[-1][:200] if tail else f'exit code {rc}'}")
    return rows, done


# -- memory bandwidth and the roofline ------------------------------------------


def token_read_bytes(info, n_gen: int) -> int:
    """What generating one token reads, on average over `n_gen` tokens from an empty context: the
    weights once (GGUFInfo.bytes_per_token) and the K and V cells of the tokens before it."""
    return int(info.bytes_per_token + kv_bytes_per_token(info) * (n_gen - 1) / 2)


def measure_bandwidth_now(*, threads: int = 1, size_bytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> Bandwidth:
    """Best-of-N read and copy bandwidth of a buffer larger than the caches, split over `threads` threads.

    The read is the faster of two scans that keep only loads in flight, as
    the matmuls do when they stream the weights for one token: the C
    library's memchr, and the CPU backend's own stream read
    (scripts/patches/ggml-cpu-token-kernels.patch), which prefetches as far
    ahead as its one-row kernels do. On Intel server cores that prefetch is
    most of the bandwidth one core can reach (20 against 12 GB/s here), so
    memchr alone put a roofline below what generation reads. numpy's float sum ran at half memchr's speed, compute-bound, and
    put generation at 135% of its "roofline". ctypes releases the GIL for the
    call, so the threads really run in parallel.
    """
    import ctypes

    import numpy as np

    n = max(1 << 16, size_bytes)
    src = np.zeros(n, dtype=np.uint8)
    src.fill(0)  # fault the pages in before timing (np.zeros may map them lazily)
    dst = np.empty_like(src)
    dst.fill(1)
    k = max(1, int(threads))
    bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]
    try:
        libc = ctypes.CDLL(None)
        memchr = libc.memchr
        memchr.restype, memchr.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        base = src.ctypes.data

        def read(a: int, b: int) -> None:
            memchr(base + a, 1, b - a)
    except (OSError, AttributeError):  # no C library to call (not seen on Linux or macOS): numpy's SIMD max

        def read(a: int, b: int) -> None:
            src[a:b].max()

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            ths = [threading.Thread(target=fn, args=b) for b in bounds]
            t0 = time.perf_counter()
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            best = min(best, time.perf_counter() - t0)
        return best

    t_read, reader = timed(read), "memchr"
    stream = backends.cpu_proc("ggml_backend_cpu_stream_read")
    if stream:
        ggml_read = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)(stream)
        t_stream = timed(lambda a, b: ggml_read(src.ctypes.data + a, b - a))
        if t_stream < t_read:
            t_read, reader = t_stream, "ggml"
    t_copy = timed(lambda a, b: np.copyto(dst[a:b], src[a:b]))
    return Bandwidth(n / t_read, 2 * n / t_copy, k, n, reader)
