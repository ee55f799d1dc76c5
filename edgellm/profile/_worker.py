"""The benchmark child: `python -m edgellm.profile._worker` times one model.

`edgellm.profile.bench.bench` runs one of these per model, so that each model's
memory figures start from a clean process (no weights, KV caches or compute
buffers of a model loaded earlier) and so that a llama.cpp crash kills the
child, not the caller. The request is one JSON object on stdin; the child
answers with JSON lines on stdout (`progress`, `row`, `error`, `done`).

The timed loops replicate llama.cpp's `tools/llama-bench/llama-bench.cpp`:
a context per test with n_ctx = n_prompt + n_gen (unless the caller gives
one), n_batch 2048, n_ubatch 512, a thread pool attached as llama-bench does,
one warm-up (the whole prompt for pp, one token for tg), then per repetition
the KV cache is cleared and the clock runs from the first decode to the last
`llama_synchronize`. Batches are built before the clock starts and nothing is
sampled or copied inside the loop, so the only Python left in the hot path is
two ctypes calls per decode.

This module also owns the memory readers (`memory_snapshot`), which the
parent uses too.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

N_BATCH = 2048  # llama-bench's defaults
N_UBATCH = 512

_MIB = re.compile(r"(KV|compute|output) buffer size\s*=\s*([0-9.]+)\s*MiB")


# -- memory ------------------------------------------------------------------


def _kb_fields(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(path) as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _mapped_file_rss_linux(files: set[str]) -> int:
    """Resident bytes of the mappings of `files` in this process (from /proc/self/smaps)."""
    total = 0
    current: Optional[str] = None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                parts = line.split(None, 5)
                current = parts[5].strip() if len(parts) > 5 else None
            elif first == "Rss:" and current in files:
                total += int(line.split()[1]) * 1024
    return total


def memory_snapshot(model_files: tuple[str, ...] = ()) -> dict[str, Optional[int]]:
    """This process's memory: rss, peak rss, anonymous, file-backed (all) and of `model_files`.

    Linux: /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile) and
    /proc/self/smaps for the model file's own mappings. Elsewhere psutil:
    Windows and the BSDs list mappings with their resident size
    (`memory_maps`), which gives the same split; macOS does not, so there the
    split is None and only rss (and peak rss from getrusage) is reported.
    """
    files = {os.path.realpath(f) for f in model_files}
    if sys.platform.startswith("linux") and os.path.exists("/proc/self/smaps"):
        st = _kb_fields("/proc/self/status")
        return {
            "rss": st.get("VmRSS"),
            "peak_rss": st.get("VmHWM"),
            "anon": st.get("RssAnon"),
            "file": (st.get("RssFile") or 0) + (st.get("RssShmem") or 0),
            "model_file": _mapped_file_rss_linux(files) if files else 0,
        }
    import psutil  # psutil only where a process is measured

    proc = psutil.Process()
    rss = int(proc.memory_info().rss)
    peak = getattr(proc.memory_info(), "peak_wset", None)  # Windows
    if peak is None:
        try:
            import resource  # POSIX only

            ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = int(ru if sys.platform == "darwin" else ru * 1024)  # bytes on macOS, KiB elsewhere
        except Exception:
            peak = rss
    out: dict[str, Optional[int]] = {"rss": rss, "peak_rss": int(peak), "anon": None, "file": None, "model_file": None}
    try:
        maps = proc.memory_maps(grouped=False)
    except (AttributeError, NotImplementedError, psutil.Error):
        return out
    file_rss = model_rss = 0
    for m in maps:
        path = getattr(m, "path", "") or ""
        r = int(getattr(m, "rss", 0) or 0)
        if path and os.path.isabs(path) and os.path.exists(path):
            file_rss += r
            if os.path.realpath(path) in files:
                model_rss += r
    out.update(file=file_rss, anon=max(0, rss - file_rss), model_file=model_rss)
    return out


# -- llama-bench's statistics ---------------------------------------------------


def stats_ts(samples_ns: list[int], n_tokens: int) -> tuple[float, float]:
    """(avg_ts, stddev_ts) exactly as llama-bench: mean and sample sd of per-repetition tokens/s."""
    ts = [1e9 * n_tokens / t for t in samples_ns if t > 0]
    if not ts:
        return 0.0, 0.0
    mean = sum(ts) / len(ts)
    if len(ts) <= 1:
        return mean, 0.0
    sq = sum(x * x for x in ts)
    n = len(ts)
    var = sq / (n - 1) - mean * mean * n / (n - 1)
    return mean, max(0.0, var) ** 0.5


# -- the child ---------------------------------------------------------------


def _device_split(lines: list[str]) -> dict[str, Any]:
    """llama.cpp's allocations on the GPU device(s) vs the host, and the layers it offloaded."""
    from edgellm.engine.gpu_load import parse_buffers, split_bytes  # the bench child loads only what its run uses: it is timed

    text = "".join(lines)
    dev, host = split_bytes(text)
    off = parse_buffers(text)["offloaded"]
    return {"device_bytes": dev, "host_bytes": host, "offloaded_layers": off[0] if off else 0}


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Threadpool:
    """ggml's CPU thread pool, attached to a context as llama-bench does.

    llama-cpp-python binds neither ggml_threadpool_new nor
    llama_attach_threadpool, so they are bound here; if that fails (another
    build layout) ggml falls back to a per-graph pool, which costs little.
    """

    def __init__(self, llama_cpp, ctx, n_threads: int) -> None:
        from edgellm.engine import backends  # the bench child loads only what its run uses: it is timed

        self.ptr = None
        self.free = None
        try:
            # the folder llama_cpp really loaded from (LLAMA_CPP_LIB_PATH may move it): a pool made by
            # another copy of ggml would be foreign to this context
            libdir = Path(getattr(llama_cpp.llama_cpp, "_base_path", Path(llama_cpp.__file__).parent / "lib"))
            ext = {"darwin": "dylib", "win32": "dll"}.get(sys.platform, "so")
            # the portable build's CPU backend is the variant edgellm loaded, not any libggml-cpu-* file
            loaded = backends.current()
            cpu = ctypes.CDLL(loaded.path if loaded else str(next(p for p in libdir.glob(f"*ggml-cpu*.{ext}"))))
            base = ctypes.CDLL(str(next(p for p in libdir.glob(f"*ggml-base*.{ext}"))))

            class Params(ctypes.Structure):
                _fields_ = [
                    ("cpumask", ctypes.c_bool * 512),
                    ("n_threads", ctypes.c_int),
                    ("prio", ctypes.c_int),
                    ("poll", ctypes.c_uint32),
                    ("strict_cpu", ctypes.c_bool),
                    ("paused", ctypes.c_bool),
                ]

            base.ggml_threadpool_params_default.restype = Params
            base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
            cpu.ggml_threadpool_new.restype = ctypes.c_void_p
            cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(Params)]
            cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
            attach = llama_cpp.llama_cpp._lib.llama_attach_threadpool
            attach.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            attach.restype = None
            params = base.ggml_threadpool_params_default(n_threads)
            params.poll = 50  # llama-bench's default
            ptr = cpu.ggml_threadpool_new(ctypes.byref(params))
            if ptr:
                attach(ctx, ptr, None)
                self.ptr, self.free = ptr, cpu.ggml_threadpool_free
        except Exception:  # a missing symbol only costs the per-graph pool
            self.ptr = None

    def close(self) -> None:
        if self.ptr and self.free:
            self.free(self.ptr)
            self.ptr = None


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _fixed_mmap_threshold(nbytes: int = 64 << 10) -> None:
    """Serve every allocation above `nbytes` with its own mmap, as a fresh C program does.

    glibc raises its mmap threshold (up to 32 MiB) each time a large block is
    freed, which a Python process does all through its imports; llama.cpp's
    KV cache and compute buffers then land inside the heap instead of in
    fresh page-aligned mappings, and prompt processing ran ~3 % slower than
    the same llama-bench code in its own process (scripts/llama_bench_in_python.py,
    docs/bench.md). A fixed threshold also stops that adjustment.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, nbytes)
    except (OSError, AttributeError):  # not glibc: nothing to adjust
        pass


def _apply_rpc(mp, rpc: Optional[dict[str, Any]]) -> Any:
    """`edgellm bench --rpc`: the parent's plan (endpoints, n_gpu_layers, tensor_split) on these model params."""
    if not rpc:
        return None

    from edgellm.engine import rpc_native  # only with --rpc
    from edgellm.engine.rpc import parse_endpoints  # only with --rpc

    plan = SimpleNamespace(
        workers=[SimpleNamespace(endpoint=ep) for ep in parse_endpoints(rpc["endpoints"])],
        n_gpu_layers=int(rpc["n_gpu_layers"]),
        tensor_split=[float(x) for x in rpc["tensor_split"]],
    )
    return rpc_native.apply_to_params(mp, plan)


# long: the timed run stays in one frame, like llama-bench's main loop: nothing between the samples but the decode calls
def run(req: dict[str, Any]) -> int:
    _fixed_mmap_threshold()
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs
    import numpy as np  # imported before the baseline so it is not counted as the model's

    log_lines: list[str] = []

    @llama_cpp.llama_log_callback
    def on_log(level: int, text: bytes, _ud) -> None:
        if len(log_lines) < 5000:
            log_lines.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
    from edgellm.engine import backends  # the bench child loads only what its run uses: it is timed

    backends.ensure()  # the portable build's CPU variant (bench() chose and remembered it), before llama.cpp looks
    llama_cpp.llama_backend_init()

    path = str(req["path"])
    files = tuple(req.get("files") or [path])
    threads = int(req["threads"])
    reps = int(req["repetitions"])
    rng = random.Random(int(req.get("seed", 1234)))
    baseline = memory_snapshot(files)

    def fail(kind: str, message: str) -> int:
        # llama.cpp's own reason ("error loading model: unknown model architecture ...") beats its "failed to load"
        errs = [ln.strip() for ln in log_lines if "error" in ln.lower()] or [
            ln.strip() for ln in log_lines if "failed" in ln.lower()
        ]
        reason = errs[-1].split("error loading model:", 1)[-1].strip() if errs else ""
        detail = f": {reason[:200]}" if reason else ""
        _emit({"event": "error", "kind": kind, "message": message + detail})
        return 2

    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = int(req.get("n_gpu_layers", 0))
    if "split_mode" in req:  # the GPU plan's device choice (edgellm.engine.gpu.GpuPlan.llama_kwargs)
        mp.split_mode, mp.main_gpu = int(req["split_mode"]), int(req["main_gpu"])
    _rpc_keep = _apply_rpc(mp, req.get("rpc"))  # noqa: F841  (alive until the load returns)
    mmap, mlock = bool(req.get("use_mmap", True)), bool(req.get("mlock", False))
    mp.load_mode = {
        (True, False): llama_cpp.LLAMA_LOAD_MODE_MMAP,
        (True, True): llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
        (False, True): llama_cpp.LLAMA_LOAD_MODE_MLOCK,
        (False, False): llama_cpp.LLAMA_LOAD_MODE_NONE,
    }[(mmap, mlock)]
    t0 = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    load_seconds = time.perf_counter() - t0
    n_model_log = len(log_lines)  # the model buffers' lines; each context adds its own
    if not model:
        return fail("RuntimeFailure", f"llama.cpp could not load {Path(path).name}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    bos = llama_cpp.llama_vocab_bos(vocab) if llama_cpp.llama_vocab_get_add_bos(vocab) else -1
    decode, sync = llama_cpp.llama_decode, llama_cpp.llama_synchronize
    ttft: Optional[float] = None

    def prompt_batches(n_prompt: int, n_batch: int) -> list[tuple[Any, Any]]:
        # (token array, batch) pairs; the batch points into the array, so both are kept alive.
        out, done = [], 0
        while done < n_prompt:
            n = min(n_prompt - done, n_batch)
            toks = [rng.randrange(n_vocab) for _ in range(n)]
            if done == 0 and bos >= 0:
                toks[0] = bos
            arr = (llama_cpp.llama_token * n)(*toks)
            out.append((arr, llama_cpp.llama_batch_get_one(arr, n)))
            done += n
        return out

    def gen_batches(n_gen: int) -> list[tuple[Any, Any]]:
        out = []
        for i in range(n_gen):
            arr = (llama_cpp.llama_token * 1)(bos if i == 0 and bos >= 0 else rng.randrange(n_vocab))
            out.append((arr, llama_cpp.llama_batch_get_one(arr, 1)))
        return out

    for ti, test in enumerate(req["tests"]):
        n_prompt, n_gen = int(test["n_prompt"]), int(test["n_gen"])
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = int(req.get("n_ctx") or (n_prompt + n_gen))
        cp.n_batch, cp.n_ubatch = N_BATCH, N_UBATCH
        cp.n_threads = cp.n_threads_batch = threads
        n_log = len(log_lines)
        ctx = llama_cpp.llama_init_from_model(model, cp)
        if not ctx:
            llama_cpp.llama_model_free(model)
            return fail("RuntimeFailure", f"llama.cpp could not create a context of {cp.n_ctx} tokens for {Path(path).name}")
        pool = _Threadpool(llama_cpp, ctx, threads)
        llama_cpp.llama_set_n_threads(ctx, threads, threads)
        mem = llama_cpp.llama_get_memory(ctx)
        n_batch = llama_cpp.llama_n_batch(ctx)

        def run(batches, *, prompt: bool, ctx=ctx) -> bool:
            # llama-bench's test_prompt syncs once at the end, its test_gen after every token
            for _arr, b in batches:
                if decode(ctx, b) != 0:
                    return False
                if not prompt:
                    sync(ctx)
            if prompt:
                sync(ctx)
            return True

        # warm-up, as llama-bench: the whole prompt, or one generated token
        ok = run(prompt_batches(n_prompt, n_batch), prompt=True) if n_prompt else run(gen_batches(1), prompt=False)
        samples: list[int] = []
        for rep in range(reps):
            batches = prompt_batches(n_prompt, n_batch) if n_prompt else gen_batches(n_gen)
            llama_cpp.llama_memory_clear(mem, False)
            start = time.perf_counter_ns()
            ok = ok and run(batches, prompt=bool(n_prompt))
            samples.append(time.perf_counter_ns() - start)
            if not ok:
                break
            _emit({"event": "progress", "test": test["name"], "done": rep + 1, "total": reps})
        if ok and n_prompt and ttft is None:
            # time to first token: a fresh prompt of n_prompt tokens until the greedy first token is known
            batches = prompt_batches(n_prompt, n_batch)
            llama_cpp.llama_memory_clear(mem, False)
            start = time.perf_counter_ns()
            ok = run(batches, prompt=True)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            int(np.argmax(logits))
            ttft = (time.perf_counter_ns() - start) / 1e9
        if not ok:
            pool.close()
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)
            return fail("RuntimeFailure", f"llama_decode failed during {test['name']}")
        snap = memory_snapshot(files)
        buffers: dict[str, int] = {"KV": 0, "compute": 0, "output": 0}
        for line in log_lines[n_log:]:
            for m in _MIB.finditer(line):
                buffers[m.group(1)] += int(float(m.group(2)) * (1 << 20))
        avg, sd = stats_ts(samples, n_prompt + n_gen)
        anon = snap["anon"] - baseline["anon"] if snap["anon"] is not None and baseline["anon"] is not None else None
        _emit(
            {
                "event": "row",
                "index": ti,
                "test": test["name"],
                "n_prompt": n_prompt,
                "n_gen": n_gen,
                "n_ctx": int(llama_cpp.llama_n_ctx(ctx)),
                "n_batch": n_batch,
                "n_ubatch": N_UBATCH,
                "samples_ns": samples,
                "avg_ts": avg,
                "stddev_ts": sd,
                "rss_bytes": snap["peak_rss"],
                "rss_now_bytes": snap["rss"],
                "file_backed_bytes": snap["model_file"],
                "anon_bytes": anon,
                "process_anon_bytes": snap["anon"],
                "process_file_bytes": snap["file"],
                "baseline_rss_bytes": baseline["rss"],
                "baseline_anon_bytes": baseline["anon"],
                "kv_buffer_bytes": buffers["KV"],
                "compute_buffer_bytes": buffers["compute"],
                "output_buffer_bytes": buffers["output"],
                "threadpool": pool.ptr is not None,
                **_device_split(log_lines[:n_model_log] + log_lines[n_log:]),
            }
        )
        pool.close()
        llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    _emit({"event": "done", "load_seconds": load_seconds, "ttft_seconds": ttft})
    return 0


def main() -> int:
    req = json.loads(sys.stdin.read())
    try:
        return run(req)
    except Exception as e:  # reported as one line by the parent
        _emit({"event": "error", "kind": "RuntimeFailure", "message": f"benchmark failed: {type(e).__name__}: {e}"})
        return 2


if __name__ == "__main__":
    sys.exit(main())
