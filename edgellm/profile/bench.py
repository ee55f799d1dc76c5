"""The profiler: tokens/s with llama-bench's definitions, and honest memory.

`bench()` measures prompt processing (pp) and generation (tg) tokens/s as
llama.cpp's `llama-bench` does (mean ± sd of per-repetition tokens/s), time to
first token and load time, and splits resident memory into the file-backed
pages of the mmapped weights and the anonymous pages (KV cache, compute
buffers) that are really private. Each model runs in its own child process
(`edgellm.profile._worker`), so its memory figures are not polluted by models
benchmarked before it.

It also owns the memory-bandwidth probe and the generation roofline it
implies, the comparison with a `llama-bench` built from the same vendored
llama.cpp, the results kept per model and machine under
`results_dir()/bench/` (read by `recommend` and the TUI through
`load_bench_results`), the `--plot` PNG, and `LiveSampler`, the tokens/s and
RSS meter that chat's `/stats` and the TUI show while generating.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from edgellm.engine.memory import kv_bytes_per_token
from edgellm.plot import pyplot
from edgellm.errors import BackendCrash, Cancelled, RuntimeFailure, UsageError
from edgellm.progress import CancelToken, Progress, ProgressCallback, no_progress

log = logging.getLogger(__name__)

BANDWIDTH_BYTES = 256 << 20


@dataclass
class BenchRow:
    """One test of one model; field names follow llama-bench's JSON where it has them."""

    model: str  # store name, or the file name for a bare path
    model_filename: str
    model_type: str  # the level, e.g. "q8_0"
    model_size: int  # weight bytes
    model_n_params: int
    test: str  # "pp512", "tg128"
    n_prompt: int
    n_gen: int
    n_threads: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_gpu_layers: int
    use_mmap: bool
    mlock: bool
    samples_ns: list[int]
    avg_ts: float
    stddev_ts: float
    rss_bytes: Optional[int]  # peak RSS of the benchmark process so far
    file_backed_bytes: Optional[int]  # resident pages of the model file's mappings
    anon_bytes: Optional[int]  # anonymous resident bytes the model added (KV, compute buffers, weights without mmap)
    kv_bytes: int  # KV cache for n_ctx, from the model's shape (f16)
    kv_buffer_bytes: int  # what llama.cpp reported allocating for the KV cache
    compute_buffer_bytes: int
    output_buffer_bytes: int
    load_seconds: float
    ttft_seconds: Optional[float]
    file_bytes: int = 0
    bandwidth_bytes_per_s: Optional[float] = None
    roofline_ts: Optional[float] = None  # tg only: bandwidth / weight bytes
    roofline_fraction: Optional[float] = None
    llama_bench_ts: Optional[float] = None
    llama_bench_stddev_ts: Optional[float] = None
    ratio: Optional[float] = None  # avg_ts / llama-bench's avg_ts
    machine_id: str = ""
    timestamp: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # GPU offload: the device, and llama.cpp's own allocations on it and on the host
    gpu_device: str = ""
    device_bytes: int = 0
    host_bytes: int = 0

    @property
    def samples_ts(self) -> list[float]:
        n = self.n_prompt + self.n_gen
        return [1e9 * n / t for t in self.samples_ns if t > 0]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples_ts"] = self.samples_ts
        return d


@dataclass
class Bandwidth:
    read_bytes_per_s: float
    copy_bytes_per_s: float  # bytes read + written per second
    threads: int
    size_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- the benchmark ---------------------------------------------------------------


def bench(
    paths_or_refs: Sequence[str | Path],
    *,
    pp: int = 512,
    tg: int = 128,
    repetitions: int = 5,
    threads: Optional[int] = None,
    n_ctx: Optional[int] = None,
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
    from edgellm.gguf.reader import read_gguf, split_set
    from edgellm.models.resolve import resolve
    from edgellm.engine.runtime import default_threads

    _validate(pp=pp, tg=tg, repetitions=repetitions, threads=threads, n_ctx=n_ctx)
    if not paths_or_refs:
        raise UsageError("name at least one model to benchmark")
    n_threads = int(threads or default_threads())
    targets = []
    for ref in paths_or_refs:
        res = resolve(str(ref))
        info = read_gguf(res.path)  # a bad file fails here, before llama.cpp sees it
        label = res.record.name if res.record else res.path.name
        targets.append((label, res.path, info, [str(p) for p in split_set(res.path)]))
    bw = measure_bandwidth_now(threads=n_threads) if measure_bandwidth else None
    tests = [{"name": f"pp{pp}", "n_prompt": pp, "n_gen": 0}]
    if tg:
        tests.append({"name": f"tg{tg}", "n_prompt": 0, "n_gen": tg})
    mid, stamp = machine_id(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    all_rows: list[BenchRow] = []
    for mi, (label, path, info, files) in enumerate(targets):
        plan = _gpu_plan(path, info, n_gpu_layers, ctx=n_ctx or max(pp, tg), gpu_device=gpu_device, gpu_mem=gpu_mem,
                         warn=warn or (lambda m: log.warning("%s", m)))
        req = {"path": str(path), "files": files, "threads": n_threads, "repetitions": repetitions, "tests": tests,
               "n_ctx": n_ctx, "use_mmap": use_mmap, "mlock": mlock, **plan.llama_kwargs()}
        total = len(tests) * repetitions * len(targets)

        def forward(ev: dict[str, Any], mi=mi, label=label) -> None:
            done = mi * len(tests) * repetitions + ev["done"] + (repetitions if ev["test"] != tests[0]["name"] else 0)
            on_progress(Progress("bench", done, total, "rep", f"{label} {ev['test']} {ev['done']}/{ev['total']}"))

        raw_rows, done = _run_worker(req, label=label, on_event=forward, cancel=cancel)
        for r in raw_rows:
            row = BenchRow(
                model=label, model_filename=str(path), model_type=info.level, model_size=int(info.tensor_bytes),
                model_n_params=int(info.parameters), test=r["test"], n_prompt=r["n_prompt"], n_gen=r["n_gen"],
                n_threads=n_threads, n_ctx=r["n_ctx"], n_batch=r["n_batch"], n_ubatch=r["n_ubatch"],
                n_gpu_layers=r.get("offloaded_layers", 0), use_mmap=use_mmap, mlock=mlock, samples_ns=r["samples_ns"],
                avg_ts=r["avg_ts"], stddev_ts=r["stddev_ts"], rss_bytes=r["rss_bytes"],
                file_backed_bytes=r["file_backed_bytes"], anon_bytes=r["anon_bytes"],
                kv_bytes=kv_bytes_per_token(info) * r["n_ctx"], kv_buffer_bytes=r["kv_buffer_bytes"],
                compute_buffer_bytes=r["compute_buffer_bytes"], output_buffer_bytes=r["output_buffer_bytes"],
                load_seconds=done["load_seconds"], ttft_seconds=done["ttft_seconds"],
                file_bytes=sum(Path(f).stat().st_size for f in files), machine_id=mid, timestamp=stamp,
                gpu_device=plan.device.label if plan.device and r.get("offloaded_layers") else "",
                device_bytes=r.get("device_bytes", 0), host_bytes=r.get("host_bytes", 0),
                extra={k: r[k] for k in ("process_anon_bytes", "process_file_bytes", "baseline_rss_bytes", "rss_now_bytes", "threadpool") if k in r},
            )
            if bw is not None:
                row.bandwidth_bytes_per_s = bw.read_bytes_per_s
                if row.n_gen and not row.n_prompt and row.model_size:
                    row.roofline_ts = bw.read_bytes_per_s / row.model_size
                    row.roofline_fraction = row.avg_ts / row.roofline_ts
            all_rows.append(row)
    if compare_llama_bench:
        _attach_llama_bench(all_rows, [t[1] for t in targets], pp=pp, tg=tg, repetitions=repetitions, threads=n_threads,
                            use_mmap=use_mmap, mlock=mlock, n_gpu_layers=all_rows[0].n_gpu_layers if all_rows else 0,
                            cancel=cancel)
    if save:
        for label, *_ in targets:
            save_results(label, [r for r in all_rows if r.model == label], bandwidth=bw)
    return all_rows


def _gpu_plan(path: Path, info, request, *, ctx: int, gpu_device: Optional[str], gpu_mem: Optional[int], warn):
    """The same offload plan chat uses (edgellm.engine.gpu); its notes and, when offload was asked for, the plan go to `warn`."""
    from edgellm.engine.gpu import plan_offload

    plan = plan_offload(path, info, request, ctx=ctx, gpu_device=gpu_device, gpu_mem=gpu_mem)
    for note in plan.notes:
        warn(f"warning: {note}")
    if plan.n_gpu_layers or (plan.requested != "0" and not plan.notes):
        warn(plan.describe())
    return plan


def _validate(*, pp: int, tg: int, repetitions: int, threads: Optional[int], n_ctx: Optional[int]) -> None:
    if pp is None or pp < 1:
        raise UsageError(f"--pp must be at least 1 (got {pp}): the prompt test needs a prompt")
    if tg is None or tg < 0:
        raise UsageError(f"--tg must be 0 or more (got {tg})")
    if repetitions < 1:
        raise UsageError(f"-r/--repetitions must be at least 1 (got {repetitions})")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1 (got {threads})")
    if n_ctx is not None:
        if n_ctx < pp:
            raise UsageError(f"--ctx {n_ctx} is smaller than --pp {pp}: the prompt would not fit in the context")
        if n_ctx < tg:
            raise UsageError(f"--ctx {n_ctx} is smaller than --tg {tg}: the generated tokens would not fit in the context")


def _run_worker(req: dict[str, Any], *, label: str, on_event, cancel: Optional[CancelToken]) -> tuple[list[dict], dict]:
    """Run one model in `python -m edgellm.profile._worker`; return its rows and its `done` record."""
    from edgellm.engine.hardware import SIGNAL_HINTS

    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "edgellm.profile._worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        lines: "queue.Queue[Optional[str]]" = queue.Queue()

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


def measure_bandwidth_now(*, threads: int = 1, size_bytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> Bandwidth:
    """Best-of-N read (sum) and copy bandwidth of a large numpy array, split over `threads` threads.

    numpy releases the GIL inside both loops, so threads really run in
    parallel, as llama.cpp's do when it streams the weights.
    """
    import numpy as np

    n = max(1 << 16, size_bytes // 8)
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    dst.fill(0.0)  # fault the pages in before timing
    k = max(1, int(threads))
    bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]

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

    t_read = timed(lambda a, b: float(np.add.reduce(src[a:b])))
    t_copy = timed(lambda a, b: np.copyto(dst[a:b], src[a:b]))
    nbytes = n * 8
    return Bandwidth(nbytes / t_read, 2 * nbytes / t_copy, k, nbytes)


# -- llama-bench ------------------------------------------------------------------


def find_llama_bench() -> Path:
    """llama-bench from EDGELLM_LLAMA_TOOLS, else scripts/build_llama_tools.sh (cached), else the tools cache."""
    return find_llama_tool("llama-bench")


def find_llama_tool(name: str) -> Path:
    """One of llama.cpp's reference tools (llama-bench, llama-perplexity, llama-quantize), found as find_llama_bench says."""
    exe = f"{name}.exe" if os.name == "nt" else name
    env = os.environ.get("EDGELLM_LLAMA_TOOLS")
    if env:
        p = Path(env).expanduser() / exe
        if p.is_file():
            return p
        raise UsageError(f"EDGELLM_LLAMA_TOOLS={env} holds no {exe}; point it at the bin folder of scripts/build_llama_tools.sh")
    script = Path(__file__).resolve().parents[2] / "scripts" / "build_llama_tools.sh"
    if script.is_file() and shutil.which("bash"):
        log.info("locating %s with %s (builds it the first time)", exe, script)
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True)
        out = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and out and (Path(out[-1]) / exe).is_file():
            return Path(out[-1]) / exe
        log.warning("scripts/build_llama_tools.sh failed: %s", (proc.stderr.strip().splitlines() or ["?"])[-1])
    from edgellm.paths import cache_dir

    found = sorted((cache_dir() / "llama-tools").glob(f"*/bin/{exe}"), key=lambda p: p.stat().st_mtime)
    if found:
        return found[-1]
    raise UsageError(f"{exe} not found: run scripts/build_llama_tools.sh, or set EDGELLM_LLAMA_TOOLS to its bin folder")


def run_llama_bench(
    paths: Sequence[Path], *, pp: int, tg: int, repetitions: int, threads: int, use_mmap: bool = True,
    mlock: bool = False, n_gpu_layers: int = 0, exe: Optional[Path] = None, cancel: Optional[CancelToken] = None,
    extra_args: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """llama-bench's own JSON records for `paths`, same tests, threads and load mode."""
    exe = exe or find_llama_bench()
    mode = {(True, False): "mmap", (True, True): "mmap+mlock", (False, True): "mlock", (False, False): "none"}[(use_mmap, mlock)]
    cmd = [str(exe)]
    for p in paths:
        cmd += ["-m", str(p)]
    cmd += ["-p", str(pp), "-n", str(tg), "-r", str(repetitions), "-t", str(threads), "-lm", mode,
            "-ngl", str(n_gpu_layers), "-o", "json"]
    if extra_args:  # e.g. --rpc with the split's -ngl/-ts (edgellm.profile.bench_rpc); a later -ngl wins
        cmd += list(extra_args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if cancel is not None and cancel.cancelled:
                    raise Cancelled(cancel.reason) from None
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = [ln for ln in err.strip().splitlines() if ln.strip()]
        raise RuntimeFailure(f"llama-bench failed (exit {proc.returncode}): {tail[-1][:200] if tail else 'no output'}")
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        raise RuntimeFailure("llama-bench printed no JSON") from None


def _attach_llama_bench(rows: list[BenchRow], paths: list[Path], **kw) -> None:
    records = run_llama_bench(paths, **kw)
    by_key = {(os.path.realpath(r["model_filename"]), int(r["n_prompt"]), int(r["n_gen"])): r for r in records}
    for row in rows:
        r = by_key.get((os.path.realpath(row.model_filename), row.n_prompt, row.n_gen))
        if r is None:
            continue
        row.llama_bench_ts = float(r["avg_ts"])
        row.llama_bench_stddev_ts = float(r.get("stddev_ts", 0.0))
        row.ratio = row.avg_ts / row.llama_bench_ts if row.llama_bench_ts > 0 else None


# -- results in the store --------------------------------------------------------


def machine_id() -> str:
    """A short stable id of this machine: host, CPU, core count and RAM."""
    from edgellm.engine.hardware import cpu_model, memory

    try:
        ram = memory().total_bytes
    except Exception:
        ram = 0
    key = f"{platform.node()}|{platform.machine()}|{cpu_model()}|{os.cpu_count()}|{ram >> 30}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _results_folder() -> Path:
    from edgellm.paths import results_dir

    return results_dir() / "bench"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def save_results(model: str, rows: list[BenchRow], *, bandwidth: Optional[Bandwidth] = None) -> Path:
    """Write this model's latest figures on this machine (atomic; one file per model and machine)."""
    from edgellm.fsutil import atomic_write_text
    from edgellm.engine.hardware import cpu_model

    mid = rows[0].machine_id if rows else machine_id()
    doc = {
        "model": model, "machine_id": mid, "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "timestamp": rows[0].timestamp if rows else time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "bandwidth": bandwidth.to_json() if bandwidth else None, "rows": [r.to_json() for r in rows],
    }
    target = _results_folder() / f"{_safe(model)}-{mid}.json"
    atomic_write_text(target, json.dumps(doc, indent=2))
    return target


def load_bench_results(model_name: Optional[str] = None, *, all_machines: bool = False) -> list[dict[str, Any]]:
    """Saved rows (dicts, newest file first), of this machine unless `all_machines`; unreadable files are skipped."""
    folder = _results_folder()
    if not folder.is_dir():
        return []
    mid = machine_id()
    out: list[dict[str, Any]] = []
    for f in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            log.warning("skipping unreadable bench result %s", f)
            continue
        if model_name is not None and doc.get("model") != model_name:
            continue
        if not all_machines and doc.get("machine_id") != mid:
            continue
        for row in doc.get("rows", []):
            out.append(dict(row, model=doc.get("model"), machine_id=doc.get("machine_id")))
    return out


# -- plot -----------------------------------------------------------------------


def write_plot(rows: Sequence[BenchRow], path: Path | str) -> Path:
    """A PNG of tokens/s per model (level): pp and tg bars with ± sd; matplotlib if installed."""
    from edgellm.fsutil import atomic_path

    path = Path(path)
    if not rows:
        raise UsageError("nothing to plot")
    labels: list[str] = []
    for r in rows:
        if r.model not in labels:
            labels.append(r.model)
    tests = sorted({r.test for r in rows}, key=lambda t: (not t.startswith("pp"), t))
    series = {t: [next(((r.avg_ts, r.stddev_ts) for r in rows if r.model == m and r.test == t), (0.0, 0.0)) for m in labels] for t in tests}
    levels = [next(r.model_type for r in rows if r.model == m) for m in labels]
    if len(set(levels)) == len(levels) and all(levels):
        labels = levels  # "tokens/s per level" reads best with the level alone
    plt = pyplot()
    with atomic_path(path) as tmp:
        fig, axes = plt.subplots(1, len(tests), figsize=(4 * len(tests), 3.5), squeeze=False)
        for ax, t in zip(axes[0], tests):
            vals = series[t]
            ax.bar(range(len(labels)), [v for v, _ in vals], yerr=[s for _, s in vals], capsize=3)
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
            ax.set_title(f"{t} tokens/s")
        fig.tight_layout()
        fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
    return path


# -- live sampler ---------------------------------------------------------------


@dataclass
class LiveSnapshot:
    tokens: int  # fed so far
    elapsed_seconds: float
    tokens_per_second: float  # over the last `window` seconds
    average_tokens_per_second: float  # since start
    rss_bytes: int
    peak_rss_bytes: int
    samples: list[tuple[float, float, int]]  # (seconds since start, tokens/s, rss) at each tick

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class LiveSampler:
    """Tokens/s (fed by the caller with `.tokens(n)`) and RSS of `pid`, sampled every `interval` s on a thread."""

    def __init__(self, pid: Optional[int] = None, interval: float = 0.5, *, window: float = 3.0, max_samples: int = 600) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.interval = interval
        self.window = window
        self.max_samples = max_samples
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = time.monotonic()
        self._count = 0
        self._events: list[tuple[float, int]] = []  # (time, cumulative tokens)
        self._samples: list[tuple[float, float, int]] = []
        self._rss = self._peak = self._read_rss()

    def _read_rss(self) -> int:
        try:
            return int(self.proc.memory_info().rss)
        except Exception:
            return 0

    def start(self) -> "LiveSampler":
        if self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="edgellm-live-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 2 * self.interval))
            self._thread = None

    def __enter__(self) -> "LiveSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def tokens(self, n: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self._count += int(n)
            self._events.append((now, self._count))
            cut = now - self.window
            while len(self._events) > 2 and self._events[1][0] < cut:
                self._events.pop(0)

    def reset(self) -> None:
        with self._lock:
            self._t0 = time.monotonic()
            self._count = 0
            self._events.clear()
            self._samples.clear()

    def _rate(self, now: float) -> float:
        ev = [e for e in self._events if e[0] >= now - self.window]
        if len(ev) >= 2 and ev[-1][0] > ev[0][0]:
            return (ev[-1][1] - ev[0][1]) / (ev[-1][0] - ev[0][0])
        return 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = self._read_rss()
            now = time.monotonic()
            with self._lock:
                self._rss = rss
                self._peak = max(self._peak, rss)
                self._samples.append((now - self._t0, self._rate(now), rss))
                if len(self._samples) > self.max_samples:
                    del self._samples[: len(self._samples) - self.max_samples]

    def snapshot(self) -> LiveSnapshot:
        rss = self._read_rss()
        now = time.monotonic()
        with self._lock:
            self._rss = rss
            self._peak = max(self._peak, rss)
            elapsed = now - self._t0
            return LiveSnapshot(
                tokens=self._count, elapsed_seconds=elapsed, tokens_per_second=self._rate(now),
                average_tokens_per_second=self._count / elapsed if elapsed > 0 else 0.0,
                rss_bytes=rss, peak_rss_bytes=self._peak, samples=list(self._samples),
            )


__all__ = [
    "BenchRow", "Bandwidth", "bench", "measure_bandwidth_now", "find_llama_bench", "run_llama_bench",
    "machine_id", "save_results", "load_bench_results", "write_plot", "LiveSampler", "LiveSnapshot",
]
