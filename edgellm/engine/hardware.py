"""What this machine and this llama.cpp build can do.

CPU SIMD features the OS exposes, the ones compiled into the installed
llama.cpp, GPU backends and devices, RAM and disk, and the self-test: a
subprocess that loads a model and generates a few tokens. The self-test is a
subprocess because a llama.cpp built for the wrong CPU does not raise, it
dies (SIGILL on the first matmul); only a child can die for us and let us
name the signal.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm import paths
from edgellm.engine import backends
from edgellm.engine import cpu_features as cpu_table
from edgellm.fsutil import free_bytes

log = logging.getLogger(__name__)

SIGNAL_HINTS = {
    "SIGILL": "this build uses instructions your CPU/OS does not allow; rerun scripts/setup.sh",
    "SIGSEGV": "llama.cpp crashed reading memory; the model file may be damaged (check `edgellm inspect`)",
    "SIGABRT": "llama.cpp aborted; the model file is probably malformed or unsupported",
    "SIGBUS": "the model file changed or was truncated while mapped",
    "SIGKILL": "the process was killed, most likely out of memory",
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """SIMD features the kernel reports as usable (XSAVE-enabled), ggml's spelling (the one table)."""
    return cpu_table.present(cpu_table.host_flags())


def _system_info() -> dict[str, str]:
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    raw = llama_cpp.llama_print_system_info()
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return {"raw": text}


def compiled_features() -> list[str]:
    """Features compiled into the installed llama.cpp (from llama_print_system_info)."""
    text = _system_info()["raw"]
    return [m.group(1) for m in re.finditer(r"([A-Z0-9_]+) = 1", text)]


def gpu_backends() -> dict[str, Any]:
    """GPU backends compiled in and the devices ggml sees."""
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    from edgellm.engine.gpu import (
        list_devices,
        no_device_reason,
    )  # gpu imports memory, which imports this module for the CPU features

    backends.load_devices()  # else llama.cpp would search for them where a portable build keeps none
    result: dict[str, Any] = {"offload_supported": bool(llama_cpp.llama_supports_gpu_offload()), "devices": []}
    # name, backend, memory, and "software: no speed-up expected" for llvmpipe/SwiftShader (edgellm.engine.gpu)
    result["devices"] = [d.to_json() for d in list_devices()]
    if not result["devices"]:
        result["note"] = no_device_reason()
    text = _system_info()["raw"]
    result["backends"] = sorted(
        {b for b in ("CUDA", "METAL", "VULKAN", "SYCL", "HIP", "MUSA", "OPENCL") if b in text.upper()}
        | {d["name"].rstrip("0123456789").upper() for d in result["devices"] if d["name"].upper() not in ("CPU",)}
    )
    return result


# Linux's transparent huge page mode, as the kernel shows it: "always madvise [never]"
THP_MODE_PATH = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# what "never" costs, measured on the 1.93B widened Q4_K_M (docs/scale.md, 2026-12-07)
HUGE_PAGES_OFF_COST = "~1.14x slower generation"


def huge_pages_mode(path: Path = THP_MODE_PATH) -> Optional[str]:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"); None where it has none.

    ggml's big buffers ask for huge pages (scripts/patches/ggml-huge-pages.patch), which "always" and
    "madvise" grant and "never" refuses. Under "never" the weights a CPU repacks are read through 4 KiB
    pages, a TLB miss every 4 KiB of every token (HUGE_PAGES_OFF_COST), so the doctor says so.
    """
    try:
        match = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


@dataclass
class Memory:
    total_bytes: int
    available_bytes: int


def memory() -> Memory:
    import psutil  # psutil only where a process is measured

    vm = psutil.virtual_memory()
    return Memory(int(vm.total), int(vm.available))


@dataclass
class SelfTestResult:
    ok: bool
    model: Optional[str] = None
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    text: str = ""
    signal: Optional[str] = None
    returncode: Optional[int] = None
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def self_test(
    model_path: Optional[Path],
    *,
    n_tokens: int = 8,
    timeout: float = 180.0,
    threads: Optional[int] = None,
    env: Optional[dict[str, str]] = None,
) -> SelfTestResult:
    """Load `model_path` and generate `n_tokens` in a child process."""
    if model_path is None:
        return SelfTestResult(False, message="no model to test with: run `edgellm pull` first")
    cmd = [sys.executable, "-m", "edgellm.engine.selftest", str(model_path), "--tokens", str(n_tokens)]
    if threads:
        cmd += ["--threads", str(threads)]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            preexec_fn=_no_core_dumps if os.name == "posix" else None,
        )
    except subprocess.TimeoutExpired:
        return SelfTestResult(False, model=str(model_path), message=f"self-test timed out after {timeout:.0f} s")
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        hint = SIGNAL_HINTS.get(sig, "llama.cpp crashed")
        return SelfTestResult(
            False, model=str(model_path), signal=sig, returncode=proc.returncode, message=f"{sig} in llama.cpp: {hint}"
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return SelfTestResult(False, model=str(model_path), returncode=proc.returncode, message=f"self-test failed: {last[:200]}")
    data = json.loads(lines[-1])
    return SelfTestResult(
        True,
        model=str(model_path),
        returncode=0,
        **{k: v for k, v in data.items() if k in ("tokens", "seconds", "tokens_per_second", "text")},
    )


def _no_core_dumps() -> None:
    # A deliberate crash in the child must not litter the working folder with cores.
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@dataclass
class DoctorReport:
    python: str
    platform: str
    llama_cpp_python: str
    llama_cpp_system_info: str
    cpu: str
    cpu_features: list[str]
    compiled_features: list[str]
    missing_in_build: list[str]
    unsupported_in_build: list[str]
    gpu: dict[str, Any]
    ram_total_bytes: int
    ram_available_bytes: int
    home: str
    disk_free_bytes: int
    self_test: SelfTestResult
    warnings: list[str] = field(default_factory=list)
    cpu_backend: Optional[dict[str, Any]] = None  # the portable build's CPU variant (engine.backends); None: host-flags build
    huge_pages: Optional[str] = None  # huge_pages_mode(); None off Linux

    @property
    def ok(self) -> bool:
        return self.self_test.ok and not self.unsupported_in_build

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def doctor(*, model_path: Optional[Path] = None, run_self_test: bool = True) -> DoctorReport:
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    # Before any llama.cpp query: a portable build has no CPU backend until one is loaded.
    choice = backends.ensure(model_path, tester=self_test if run_self_test else None)
    cpu_f = cpu_features()
    info = _system_info()["raw"]
    comp = compiled_features()
    comp_simd = [f for f in comp if f in cpu_table.BY_GGML]
    warnings = []
    # only what llama.cpp's system info would name can be missing from it; AMX is never built (scripts/_cpu_flags.sh)
    missing = [f for f in cpu_f if f not in comp_simd and cpu_table.BY_GGML[f].shown and not f.startswith("AMX")]
    unsupported = [f for f in comp_simd if f not in cpu_f and f not in ("SSE3", "SSSE3", "NEON")]
    if missing:
        warnings.append(f"the CPU has {', '.join(missing)} but this build does not use them (slower than it could be)")
    if unsupported:
        warnings.append(
            f"this build uses {', '.join(unsupported)}, which this CPU/OS does not expose: it will crash; rerun scripts/setup.sh"
        )
    thp = huge_pages_mode()
    if thp == "never":
        warnings.append(
            "transparent huge pages are off (never): repacked weights are read through 4 KiB pages, "
            f"{HUGE_PAGES_OFF_COST}; as root: echo madvise > {THP_MODE_PATH}"
        )
    mem = memory()
    st = self_test(model_path) if run_self_test else SelfTestResult(False, message="skipped")
    home = paths.home()
    return DoctorReport(
        python=platform.python_version(),
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
        llama_cpp_python=getattr(llama_cpp, "__version__", "?"),
        llama_cpp_system_info=info.strip(),
        cpu=cpu_model(),
        cpu_features=cpu_f,
        compiled_features=comp_simd,
        missing_in_build=missing,
        unsupported_in_build=unsupported,
        gpu=gpu_backends(),
        ram_total_bytes=mem.total_bytes,
        ram_available_bytes=mem.available_bytes,
        home=str(home),
        disk_free_bytes=free_bytes(home),
        self_test=st,
        warnings=warnings,
        cpu_backend=choice.to_json() if choice is not None else None,
        huge_pages=thp,
    )
