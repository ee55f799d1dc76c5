"""llama.cpp's RPC backend through ctypes: workers' devices for a model, the
in-process worker, and what happens when a worker dies.

llama-cpp-python 0.3.36 has no argument for RPC, so this module calls the
plain-C API of the libggml-rpc it ships (built with GGML_RPC=ON by
scripts/setup.sh):

- `add_servers()` registers workers (`ggml_backend_rpc_add_server`) and
  returns their devices; `model_devices()` hands them to the next model load
  as `llama_model_params.devices` (llama-cpp-python builds the params
  itself, so its default-params function is wrapped for that one call).
- `run_worker()` runs `ggml_backend_rpc_start_server` on the CPU device, with
  the memory it reports replaced by what `--mem` offers.
- A dead worker: ggml's RPC client has no error path, it calls `GGML_ABORT`,
  which would kill the host with a backtrace. `install_abort_handler()` puts a
  ggml abort callback in front of that. In "exit" mode (the CLI) it prints one
  line naming the lost worker and ends the process with status 1. In "park"
  mode (the server) it tells the listeners (the server answers the request
  with a 503 and refuses the model from then on) and then parks the failing
  thread forever instead of returning, since returning means abort(): the
  generation that was waiting on that worker never resumes, the rest of the
  process keeps serving. See docs/rpc.md.
- A worker that vanishes without closing its socket (power cut, cable) would
  leave recv() waiting forever: `harden_sockets()` turns on TCP keepalive
  (2 s idle, 1 s probes, 3 misses) and an 8 s TCP_USER_TIMEOUT on the host's
  RPC connections, so the kernel fails the socket within ~10 s and the abort
  path above runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

from edgellm.engine import backends
from edgellm.engine.rpc import Endpoint, RpcError, prepare

log = logging.getLogger(__name__)

_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_GET_MEMORY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_lock = threading.Lock()
_state: dict[str, Any] = {"mode": None, "cb": None, "endpoints": [], "listeners": [], "lost": set(), "infos": {}, "fds": {}}


def _lib_dir() -> Path:
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    return Path(llama_cpp.__file__).resolve().parent / "lib"


def _load(name: str) -> ctypes.CDLL:
    import llama_cpp  # noqa: F401  (loads libllama and its ggml libraries first)

    # By soname: the wheel ships each library three times as plain copies (.so, .so.0, .so.0.x), and
    # llama.cpp loaded the .so.0 ones; another copy would have its own globals (the abort callback, the
    # RPC connections) that llama.cpp never sees.
    path = _lib_dir() / f"{name}.0"
    if not path.exists():
        path = _lib_dir() / name
    if not path.exists():
        raise RpcError(
            f"this llama-cpp-python build has no RPC backend ({name} is missing): rebuild with scripts/setup.sh (GGML_RPC=ON)"
        )
    return ctypes.CDLL(str(path))


def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL, ctypes.CDLL]:
    cached = _state.get("libs")
    if cached is None:
        backends.ensure()  # a portable build registers RPC (a loadable backend) and its CPU variant here
        base, ggml, rpc = _load("libggml-base.so"), _load("libggml.so"), _load("libggml-rpc.so")
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        rpc.ggml_backend_rpc_add_server.argtypes, rpc.ggml_backend_rpc_add_server.restype = [ctypes.c_char_p], vp
        rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, sz, sz, ctypes.POINTER(vp)]
        rpc.ggml_backend_rpc_start_server.restype = None
        base.ggml_backend_reg_dev_count.argtypes, base.ggml_backend_reg_dev_count.restype = [vp], sz
        base.ggml_backend_reg_dev_get.argtypes, base.ggml_backend_reg_dev_get.restype = [vp, sz], vp
        base.ggml_backend_dev_name.argtypes, base.ggml_backend_dev_name.restype = [vp], ctypes.c_char_p
        base.ggml_backend_dev_description.argtypes, base.ggml_backend_dev_description.restype = [vp], ctypes.c_char_p
        base.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
        base.ggml_set_abort_callback.argtypes, base.ggml_set_abort_callback.restype = [_ABORT_CB], vp
        ggml.ggml_backend_reg_by_name.argtypes, ggml.ggml_backend_reg_by_name.restype = [ctypes.c_char_p], vp
        ggml.ggml_backend_dev_by_type.argtypes, ggml.ggml_backend_dev_by_type.restype = [ctypes.c_int], vp
        cached = _state["libs"] = (base, ggml, rpc)
    return cached


def compiled_in() -> bool:
    """Whether this llama.cpp build has the RPC backend (libggml-rpc and a registered "RPC" backend)."""
    try:
        _base, ggml, _rpc = _libs()
    except (RpcError, OSError):
        return False
    return bool(ggml.ggml_backend_reg_by_name(b"RPC"))


# -- the host side -------------------------------------------------------------


def add_servers(endpoints: Sequence[Endpoint]) -> list[int]:
    """Register workers with llama.cpp (probe them first: a failure here aborts); their devices in order."""
    base, _ggml, rpc = _libs()
    install_abort_handler(_state["mode"] or "exit")
    devices: list[int] = []
    for ep in endpoints:
        reg = rpc.ggml_backend_rpc_add_server(str(ep).encode())
        if not reg:
            raise RpcError(f"RPC worker {ep} offers no devices")
        devices += [base.ggml_backend_reg_dev_get(reg, i) for i in range(base.ggml_backend_reg_dev_count(reg))]
        with _lock:
            if ep not in _state["endpoints"]:
                _state["endpoints"].append(ep)
    return devices


@contextlib.contextmanager
def model_devices(devices: Sequence[int]) -> Iterator[None]:
    """The next `llama_cpp.Llama(...)` in this block loads onto `devices` (NULL-terminated list)."""
    import llama_cpp.llama_cpp as lc  # llama_cpp loads libllama: only where llama.cpp runs

    arr = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
    orig = lc.llama_model_default_params

    def with_devices():
        p = orig()
        p.devices = ctypes.cast(arr, ctypes.c_void_p)
        return p

    with _lock:
        lc.llama_model_default_params = with_devices
        try:
            yield
        finally:
            lc.llama_model_default_params = orig


def _fd_id(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")  # "socket:[inode]": tells a reused fd number apart
    except OSError:
        return ""


def _connections_to(ep: Endpoint) -> list[int]:
    """This process's TCP connections to `ep` (file descriptors, found by peer address)."""
    try:
        ip = socket.gethostbyname(ep.host)
    except OSError:
        return []
    fds = []
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        if not name.isdigit() or not _fd_id(int(name)).startswith("socket:"):
            continue
        try:
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with s:
            try:
                if s.family == socket.AF_INET and s.getpeername() == (ip, ep.port):
                    fds.append(int(name))
            except OSError:
                pass
    return fds


def harden_sockets(endpoints: Sequence[Endpoint]) -> int:
    """Keepalive and a user timeout on every connection to the workers: a vanished host fails within ~10 s.

    The connections are also recorded here, while they are up: once reset, a
    socket has no peer address left to be found by.
    """
    n = 0
    for ep in endpoints:
        fds = _connections_to(ep)
        with _lock:
            _state["fds"][ep] = [(fd, _fd_id(fd)) for fd in fds]
        for fd in fds:
            with contextlib.suppress(OSError, AttributeError), socket.socket(fileno=os.dup(fd)) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", 18), 8000)
                n += 1
    return n


def connected(ep: Endpoint) -> bool:
    """Whether this process still holds its recorded connection to `ep`."""
    return any(ident and _fd_id(fd) == ident for fd, ident in _state["fds"].get(ep, []))


def lost_endpoints(endpoints: Optional[Sequence[Endpoint]] = None) -> list[Endpoint]:
    """Workers whose recorded connection is closed or reset (read when nothing is due from them).

    A worker with no live recorded connection (its model was unloaded here) is
    not counted: the next load probes it.
    """
    eps = list(endpoints) if endpoints is not None else list(_state["endpoints"])
    lost = []
    for ep in eps:
        if ep in _state["lost"]:
            lost.append(ep)
            continue
        dead = False
        for fd, ident in _state["fds"].get(ep, []):
            if not ident or _fd_id(fd) != ident:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as s:
                    dead |= s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                dead = True
        if dead:
            lost.append(ep)
    return lost


def on_worker_lost(listener: Callable[[str, list[Endpoint]], None]) -> None:
    """Call `listener(message, lost)` when a worker dies under a running generation ("park" mode)."""
    with _lock:
        _state["listeners"].append(listener)


def install_abort_handler(mode: str) -> None:
    """Route ggml's aborts: "exit" (one line, status 1) or "park" (listeners, then the thread waits forever)."""
    base, _ggml, _rpc = _libs()
    with _lock:
        if _state["cb"] is not None and (_state["mode"] == mode or mode == "exit"):
            return
        _state["mode"] = mode

        def on_abort(message: Optional[bytes]) -> None:
            text = (message or b"").decode("utf-8", "replace").strip()
            reason = text.split(": ", 1)[-1] if ": " in text else text
            try:
                lost = lost_endpoints()
            except Exception:  # never raise out of a C callback
                lost = []
            who = ", ".join(map(str, lost)) or "(one of " + ", ".join(map(str, _state["endpoints"])) + ")"
            msg = (
                f"RPC worker {who} went away during a generation ({reason})"
                if ("RPC" in text or lost)
                else f"llama.cpp aborted: {reason}"
            )
            if _state["mode"] == "park":
                _state["lost"].update(lost)
                for fn in list(_state["listeners"]):
                    with contextlib.suppress(Exception):
                        fn(msg, lost)
                while True:  # returning would abort() the whole server; this thread's work is lost anyway
                    time.sleep(3600)
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            os.write(2, f"error: {msg}\n".encode("utf-8", "replace"))
            os._exit(1)

        _state["cb"] = _ABORT_CB(on_abort)
        base.ggml_set_abort_callback(_state["cb"])


# -- the worker side -----------------------------------------------------------


def cpu_device() -> tuple[int, str]:
    base, ggml, _rpc = _libs()
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        raise RpcError("llama.cpp has no CPU device")
    return dev, (base.ggml_backend_dev_description(dev) or b"CPU").decode("utf-8", "replace")


def offer_memory(dev: int, mem_bytes: Optional[int]) -> None:
    """Make the device report `mem_bytes` (free and total), or the machine's available RAM when None.

    ggml's CPU device reports all physical RAM as free, and the RPC server
    passes that on; a host then plans as if the worker's whole RAM were its.
    The device struct is ggml's static `ggml_backend_device`: its interface
    (a table of function pointers, get_memory third) comes first.
    """
    import psutil  # psutil only where a process is measured

    def get_memory(_dev, free, total) -> None:
        if mem_bytes is not None:
            free[0] = total[0] = mem_bytes
        else:
            vm = psutil.virtual_memory()
            free[0], total[0] = int(vm.available), int(vm.total)

    cb = _GET_MEMORY(get_memory)
    _state.setdefault("keep", []).append(cb)
    ctypes.c_void_p.from_address(dev + 2 * ctypes.sizeof(ctypes.c_void_p)).value = ctypes.cast(cb, ctypes.c_void_p).value


def run_worker(host: str, port: int, *, threads: int, mem_bytes: Optional[int], cache_dir: Optional[Path]) -> None:
    """ggml_backend_rpc_start_server on the CPU device; blocks for as long as the server runs."""
    _base, _ggml, rpc = _libs()
    dev, _desc = cpu_device()
    offer_memory(dev, mem_bytes)
    devs = (ctypes.c_void_p * 1)(dev)
    rpc.ggml_backend_rpc_start_server(f"{host}:{port}".encode(), str(cache_dir).encode() if cache_dir else None, threads, 1, devs)


__all__ = [
    "plan_for",
    "loading",
    "apply_to_params",
    "compiled_in",
    "add_servers",
    "model_devices",
    "harden_sockets",
    "lost_endpoints",
    "on_worker_lost",
    "install_abort_handler",
    "cpu_device",
    "offer_memory",
    "run_worker",
]


def plan_for(path: Path | str, options: Any) -> Any:
    """The split plan for a `RuntimeOptions` with `rpc` set (probes the workers)."""

    known = {ep: info for ep, info in _state["infos"].items() if connected(ep) and ep not in _state["lost"]}
    return prepare(
        path,
        options.rpc,
        n_ctx=options.n_ctx,
        kv_type=options.kv_type,
        n_ubatch=options.n_ubatch,
        split=options.rpc_split,
        force=options.force,
        known=known,
    )


@contextlib.contextmanager
def loading(plan: Any, kw: dict[str, Any]) -> Iterator[None]:
    """Load the model in this block onto the plan's devices: workers registered, llama.cpp's
    layer split set in `kw`, and the connections hardened once the weights are sent."""
    devices = add_servers([w.endpoint for w in plan.workers])
    with _lock:
        _state["infos"].update({w.endpoint: w for w in plan.workers})
    kw.update(
        n_gpu_layers=plan.n_gpu_layers, tensor_split=plan.tensor_split, split_mode=1, main_gpu=0
    )  # 1: LLAMA_SPLIT_MODE_LAYER
    with model_devices(devices):
        yield
    harden_sockets([w.endpoint for w in plan.workers])


def apply_to_params(mp: Any, plan: Any) -> list[Any]:
    """Point a raw `llama_model_params` at the plan's devices (for code that loads without
    llama_cpp.Llama: perplexity, the bench worker). Keep the returned arrays alive until the load."""
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    devices = add_servers([w.endpoint for w in plan.workers])
    with _lock:
        _state["infos"].update({w.endpoint: w for w in plan.workers})
    arr = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
    split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*plan.tensor_split)
    mp.devices = ctypes.cast(arr, ctypes.c_void_p)
    mp.n_gpu_layers, mp.split_mode, mp.main_gpu = plan.n_gpu_layers, 1, 0  # 1: LLAMA_SPLIT_MODE_LAYER
    mp.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
    return [arr, split]
