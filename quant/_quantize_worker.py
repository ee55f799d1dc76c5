"""The child process that runs one `llama_model_quantize` call.

`llama_model_quantize` is a single blocking C call: it cannot be interrupted
from Python, and llama.cpp aborts the whole process on some malformed
inputs. Running it here lets the parent (quant/quantize.py) kill it on
Ctrl-C/SIGTERM, survive an abort, and rename the temp output only when this
process reports success.

Protocol: argv[1] is the parent's pid. The parent starts the worker early
(its start-up overlaps the parent's validation) and then sends jobs on stdin,
one JSON object per line: {input, output, ftype, nthread, allow_requantize}
and optionally imatrix (a GGUF imatrix file), imatrix_label (the file name
recorded in the output, as llama-quantize records its --imatrix argument),
tt_overrides ([[regex, ggml type id], ...]), rounding (quant.rounding's name of
the refine level: --budget and --recipe files; stock otherwise) and dry_run.
For each, on a private copy of stdout, the child writes one JSON object per
line: {"log": text, "level": n} for every complete llama.cpp log line
(captured with `llama_log_set`), then {"done": rc, "seconds": s}. It exits
when stdin closes. Anything else printed to fd 1 goes to stderr, so it cannot
corrupt the protocol.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import sys
import threading
import time
import types

_PR_SET_PDEATHSIG = 1


def _die_with_parent(ppid: int) -> None:
    """If the parent is killed (kill -9), stop at once instead of finishing a
    file nobody will rename."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != ppid:
        os._exit(3)

    def watch() -> None:  # for systems without PDEATHSIG
        while True:
            time.sleep(0.5)
            if os.getppid() != ppid:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _bindings():
    """llama-cpp-python's ctypes bindings (`llama_cpp.llama_cpp`).

    Importing the `llama_cpp` package also imports its high-level API (numpy,
    jinja2, the chat formats): ~0.3 s this process does not need and that
    would count against every quantization. So the package module is
    registered without running its __init__, and only the bindings module
    (the same functions `llama_cpp.llama_model_quantize` re-exports) loads.
    """

    if "llama_cpp" not in sys.modules:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is not None and spec.submodule_search_locations:
            pkg = types.ModuleType("llama_cpp")
            pkg.__path__ = list(spec.submodule_search_locations)
            pkg.__spec__ = spec
            pkg.__file__ = spec.origin
            sys.modules["llama_cpp"] = pkg
            try:
                import llama_cpp.llama_cpp as bindings  # llama_cpp loads libllama: only where llama.cpp runs

                return bindings
            except Exception:
                del sys.modules["llama_cpp"]
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    return llama_cpp


def _extra_params(L, params, job: dict) -> list:
    """The C arrays llama-quantize builds for --imatrix, --tensor-type and
    --dry-run (tools/quantize/quantize.cpp), in its order, so the output is
    byte-identical. Returns the Python objects the pointers point into."""
    keep: list = []
    if job.get("imatrix"):
        from quant.imatrix_file import read_imatrix  # only with an imatrix: the worker starts in ~0.1 s

        m = read_imatrix(job["imatrix"])
        arr = (L.llama_model_imatrix_data * (len(m.entries) + 1))()
        for i, (name, e) in enumerate(m.entries.items()):
            data = e.normalized()
            key = name.encode()
            keep += [data, key]
            arr[i].name, arr[i].size = key, data.size
            arr[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        arr[len(m.entries)].name = None
        params.imatrix = arr
        kvs = [("quantize.imatrix.file", 3, job.get("imatrix_label") or job["imatrix"])]
        if m.datasets:
            kvs.append(("quantize.imatrix.dataset", 3, m.datasets[0]))
        kvs.append(("quantize.imatrix.entries_count", 0, len(m.entries)))
        if m.chunk_count > 0:
            kvs.append(("quantize.imatrix.chunks_count", 0, m.chunk_count))
        kv = (L.llama_model_kv_override * (len(kvs) + 1))()
        for i, (k, tag, v) in enumerate(kvs):
            kv[i].key, kv[i].tag = k.encode(), tag
            if tag == 3:
                kv[i].value.val_str = v.encode()[:127]
            else:
                kv[i].value.val_i64 = int(v)
        kv[len(kvs)].key = b""
        params.kv_overrides = kv
        keep += [arr, kv]
    if job.get("tt_overrides"):
        tt = (L.llama_model_tensor_override * (len(job["tt_overrides"]) + 1))()
        for i, (pattern, type_id) in enumerate(job["tt_overrides"]):
            b = pattern.encode()
            keep.append(b)
            tt[i].pattern, tt[i].type = b, int(type_id)
        tt[len(job["tt_overrides"])].pattern = None
        tt[len(job["tt_overrides"])].type = 43  # GGML_TYPE_COUNT, llama-quantize's terminator
        params.tt_overrides = tt
        keep.append(tt)
    if job.get("dry_run"):
        params.dry_run = True
    return keep


def main() -> int:
    _die_with_parent(int(sys.argv[1]))
    # The parent decides about Ctrl-C; a file size limit must become a write
    # error llama.cpp reports, not a silent SIGXFSZ kill.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)

    def emit(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    L = _bindings()
    L.llama_backend_init()
    pending: list[str] = []

    def on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        pending.append(text.decode("utf-8", "replace") if text else "")
        joined = "".join(pending)
        if "\n" not in joined:
            return
        *lines, rest = joined.split("\n")
        pending[:] = [rest] if rest else []
        for line in lines:
            emit({"log": line, "level": int(level)})

    callback = L.llama_log_callback(on_log)
    prev_cb = L.llama_log_callback()
    prev_ud = ctypes.c_void_p()
    try:
        L.llama_log_get(ctypes.byref(prev_cb), ctypes.byref(prev_ud))
    except Exception:
        prev_cb, prev_ud = None, ctypes.c_void_p(0)
    emit({"ready": True})
    base_lib: list = []
    for raw in sys.stdin:
        if not raw.strip():
            continue
        job = json.loads(raw)
        L.llama_log_set(callback, ctypes.c_void_p(0))
        try:
            params = L.llama_model_quantize_default_params()
            params.ftype = int(job["ftype"])
            params.nthread = int(job["nthread"])
            params.allow_requantize = bool(job["allow_requantize"])
            keep = _extra_params(L, params, job)  # noqa: F841 (C pointers into these must outlive the call)
            if job.get("rounding") or base_lib:
                # the worker is reused: a stock level after a --budget file must round as llama.cpp does again
                from quant.rounding import base_library, set_rounding

                base_lib = base_lib or [base_library()]
                set_rounding(base_lib[0], job.get("rounding") or "")
            t0 = time.perf_counter()
            rc = L.llama_model_quantize(job["input"].encode(), job["output"].encode(), ctypes.byref(params))
            seconds = time.perf_counter() - t0
            if pending:
                emit({"log": "".join(pending), "level": 1})
                pending.clear()
            emit({"done": int(rc), "seconds": seconds})
        finally:
            # restore what was there (llama.cpp's stderr logger, or llama-cpp-python's)
            L.llama_log_set(prev_cb if prev_cb else None, prev_ud)
    proto.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
