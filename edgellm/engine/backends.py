"""The portable build's CPU backend: which variant this machine runs, and loading it.

`scripts/setup.sh --portable` builds llama.cpp with the CPU backend as one
loadable library per x86-64 level (libggml-cpu-x64.so ... -haswell, -zen4,
-sapphirerapids) in llama_cpp/lib. llama.cpp itself would look for them only
in the current folder and beside the Python binary, and would pick one by
CPUID alone; CPUID can advertise AVX-512 or AMX that the OS or a hypervisor
does not enable, and that variant dies with SIGILL on its first matmul.

So edgellm chooses: every variant is scored by llama.cpp's own
`ggml_backend_score` (in a child: scoring dlopens the library), variants whose
features the kernel does not list in /proc/cpuinfo are set aside, and the
best remaining one must pass the subprocess self-test (hardware.self_test);
one that crashes is skipped for the next. The choice is remembered per CPU and
build under the cache dir, and `ensure()` loads it (with the other backend
libraries, RPC included) through ggml_backend_load before any model.
`GGML_BACKEND_PATH` is set too, so a child process that never calls
`ensure()` still gets the same variant from llama.cpp's own loader.

The host-flags build (one libggml-cpu.so linked in) has no variants: every
function here is then a no-op and llama.cpp behaves as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Optional

from edgellm import paths
from edgellm.engine import cpu_features as cpu_table
from edgellm.engine.native_io import silence_native_stderr
from edgellm.errors import RuntimeFailure
from edgellm.fsutil import atomic_write_text

log = logging.getLogger(__name__)

_PREFIX = "libggml-cpu-"
# Forces a variant (name or path): the self-test child is told which one to try this way.
FORCE_ENV = "EDGELLM_CPU_BACKEND"
# Comma-separated variant names that die with SIGILL as soon as they are loaded, as a
# variant using instructions the OS does not enable would: proves the fallback on any CPU.
BREAK_ENV = "EDGELLM_BACKEND_BREAK"

# What each x86 variant is compiled for, in ggml's names, as ggml/src/CMakeLists.txt lists them
# (ggml_add_cpu_backend_variant); the kernel's spelling of each is the one table's (engine.cpu_features).
_HSW = "SSE42 AVX F16C FMA AVX2 BMI2"
_512 = _HSW + " AVX512"
VARIANT_FEATURES: dict[str, list[str]] = {
    name: feats.split()
    for name, feats in {
        "x64": "",
        "sse42": "SSE42",
        "sandybridge": "SSE42 AVX",
        "ivybridge": "SSE42 AVX F16C",
        "piledriver": "SSE42 AVX F16C FMA",
        "haswell": _HSW,
        "alderlake": _HSW + " AVX_VNNI",
        "skylakex": _512,
        "cannonlake": _512 + " AVX512_VBMI",
        "cascadelake": _512 + " AVX512_VNNI",
        "icelake": _512 + " AVX512_VBMI AVX512_VNNI",
        "cooperlake": _512 + " AVX512_VNNI AVX512_BF16",
        "zen4": _512 + " AVX512_VBMI AVX512_VNNI AVX512_BF16",
        "sapphirerapids": _512 + " AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8",
    }.items()
}


@dataclass
class Variant:
    name: str
    path: str
    score: Optional[int] = None  # llama.cpp's ggml_backend_score; 0: the CPU lacks what it needs
    status: str = ""  # "chosen", "passed", "crashed", "unsupported", "not enabled by the OS", "not tried"
    reason: str = ""


@dataclass
class Choice:
    variant: str
    path: str
    reason: str
    verified: bool  # passed the self-test on this machine (else chosen by score alone)
    source: str  # "self-test", "remembered", "forced", "score"
    variants: list[Variant] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_loaded: dict[str, Any] = {}


def lib_dir() -> Optional[Path]:
    """llama_cpp's lib folder, found without importing llama_cpp (that would load libllama)."""
    spec = find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def variants(lib: Optional[Path] = None) -> dict[str, Path]:
    """The CPU variants in a portable build, by name; empty for the host-flags build."""
    lib = lib or lib_dir()
    if lib is None or not lib.is_dir():
        return {}
    return {p.name[len(_PREFIX) : -3]: p for p in sorted(lib.glob(_PREFIX + "*.so"))}


def cpu_flags() -> set[str]:
    """The flags the kernel lists: it leaves out what XSAVE/XCR0 does not enable (AVX-512, AMX state)."""
    host = cpu_table.host_flags()
    return set(host.flags) if host is not None else set()


def os_missing(name: str, flags: Optional[set[str]] = None) -> list[str]:
    """Features variant `name` is built for that the kernel does not list, in its spelling (unknown names: none)."""
    host = cpu_table.host_flags() if flags is None else cpu_table.HostFlags("linux", frozenset(flags), "given")
    if host is None or host.arch != "x86" or name not in VARIANT_FEATURES:
        return []
    return [f.linux for f in cpu_table.missing(VARIANT_FEATURES[name], host)]


_SCORE = (
    "import ctypes, os, sys\n"
    "d = os.path.dirname(sys.argv[1])\n"
    "base = os.path.join(d, 'libggml-base.so.0')\n"
    "ctypes.CDLL(base if os.path.exists(base) else os.path.join(d, 'libggml-base.so'), mode=ctypes.RTLD_GLOBAL)\n"
    "f = ctypes.CDLL(sys.argv[1]).ggml_backend_score\n"
    "f.restype = ctypes.c_int\n"
    "print(f())\n"
)


def score(path: Path) -> tuple[Optional[int], str]:
    """llama.cpp's score for one variant (0: unsupported), in a child: loading it runs its code."""
    try:
        proc = subprocess.run([sys.executable, "-S", "-c", _SCORE, str(path)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None, "scoring timed out"
    if proc.returncode < 0:
        return None, f"{signal.Signals(-proc.returncode).name} while loading it"
    try:
        return int(proc.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, "could not be loaded: " + ((proc.stderr.strip().splitlines() or ["no output"])[-1])[:160]


def _choice_file(found: dict[str, Path]) -> Path:
    ident = {
        "machine": platform.machine(),
        "flags": sorted(cpu_flags()),
        "variants": {n: p.stat().st_size for n, p in found.items()},
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return paths.cache_dir() / "cpu-backend" / f"{key}.json"


def _forced(found: dict[str, Path]) -> Optional[Choice]:
    want = os.environ.get(FORCE_ENV)
    if not want:
        return None
    for name, path in found.items():
        if want in (name, str(path)):
            return Choice(name, str(path), f"forced by {FORCE_ENV}", False, "forced")
    raise RuntimeFailure(f"{FORCE_ENV}={want} is not one of this build's CPU variants ({', '.join(found)})")


# hardware.self_test(model, env=...): passed in, since hardware (doctor) needs this module
Tester = Callable[..., Any]


def choose(model_path: Optional[Path] = None, *, refresh: bool = False, tester: Optional[Tester] = None) -> Optional[Choice]:
    """The variant this machine should run (None for a host-flags build).

    Remembered choices are reused unless `refresh`. Otherwise the variants are
    scored and, with a model and a `tester`, the best ones self-tested in
    order until one passes; only such a verified choice is remembered.
    """
    found = variants()
    if not found:
        return None
    forced = _forced(found)
    if forced is not None:
        return forced
    memo = _choice_file(found)
    if not refresh:
        try:
            data = json.loads(memo.read_text())
            data["variants"] = [Variant(**v) for v in data.get("variants", [])]
            if data.get("variant") in found:  # the path from this install: the same wheel may sit in several venvs
                return Choice(**{**data, "path": str(found[data["variant"]]), "source": "remembered"})
        except (OSError, ValueError, TypeError):
            pass
    flags = cpu_flags()
    rows = []
    for name, path in found.items():
        s, err = score(path)
        v = Variant(name, str(path), s)
        if s is None:
            v.status, v.reason = "crashed", err
        elif s <= 0:
            v.status, v.reason = "unsupported", "the CPU lacks what it is built for"
        elif missing := os_missing(name, flags):
            v.status, v.reason = "not enabled by the OS", f"CPUID has it, but the kernel does not list {', '.join(missing)}"
        rows.append(v)
    rows.sort(key=lambda v: -(v.score or 0))
    candidates = [v for v in rows if not v.status]
    if not candidates:
        raise RuntimeFailure(
            "no CPU variant of this llama.cpp build can run on this CPU: " + "; ".join(f"{v.name}: {v.reason}" for v in rows)
        )
    skipped: list[str] = []
    chosen: Optional[Variant] = None
    verified = False
    for v in candidates:
        if chosen is not None:
            v.status = "not tried"
            continue
        if model_path is None or tester is None:
            chosen = v
            continue
        res = tester(Path(model_path), env={**os.environ, FORCE_ENV: v.path, "GGML_BACKEND_PATH": v.path})
        if res.ok:
            chosen, verified, v.status = v, True, "passed"
        else:
            v.status, v.reason = "crashed" if res.signal else "failed", res.message
            skipped.append(f"{v.name} {v.status} ({res.signal or res.message})")
    if chosen is None:
        raise RuntimeFailure("every CPU variant failed the self-test: " + "; ".join(skipped))
    chosen.status = "chosen"
    why = f"highest llama.cpp score ({chosen.score}) among the variants this CPU and OS support"
    if skipped:
        why = f"best variant that passed the self-test; skipped {', '.join(skipped)}"
    elif verified:
        why += ", self-test passed"
    else:
        why += "; not self-tested yet (no model)"
    result = Choice(chosen.name, chosen.path, why, verified, "self-test" if verified else "score", rows)
    if verified:
        memo.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(memo, json.dumps(result.to_json(), indent=1) + "\n")
    return result


def keep_batch_invariant(small_batch: int) -> bool:
    """Make a row's logits independent of the batch it is decoded in, for batches under `small_batch` rows.

    Stock ggml rounds the same token differently alone and in a small batch (a speculative
    verify batch, a row beside other sequences), so temperature 0 would change with `--draft`:
    at 512+ cached cells and 2+ threads it sums a lone query row's attention in per-thread
    chunks and merges them (scripts/patches/ggml-cpu-fa-split-kv.patch turns that off); from
    8 rows it multiplies K-quant weights with a tiled kernel that sums in another order than
    the one-row kernel, and where it repacks Q4_K (x86) its one-row kernel sums a super block
    otherwise than its 4-row one (scripts/patches/ggml-cpu-matmul-batch-invariant.patch moves
    the tiled floor to `small_batch` rows and makes the one-row kernel sum as the 4-row one).
    Both switches are reached like llama.cpp's other CPU switches, through the backend's proc
    address, and hold for the process; llama.cpp's tools keep ggml's own behaviour.
    False where the build lacks either.
    """
    if "invariant" in _loaded:
        return bool(_loaded["invariant"])
    split = cpu_proc("ggml_backend_cpu_set_fa_split_kv")
    small = cpu_proc("ggml_backend_cpu_set_small_batch_invariant")
    if split:
        ctypes.CFUNCTYPE(None, ctypes.c_bool)(split)(False)
    if small:
        ctypes.CFUNCTYPE(None, ctypes.c_int64)(small)(small_batch)
    ok = bool(split and small)
    if not ok:
        log.debug("this llama.cpp build cannot keep small batches invariant (no edgellm patches)")
    _loaded["invariant"] = ok
    return ok


def cpu_proc(name: str) -> Optional[int]:
    """The address of one of the CPU backend's extra functions (llama.cpp's switches, edgellm's patches); None if absent."""
    lib = lib_dir()
    if lib is None or not (lib / "libggml.so").exists():
        return None
    ggml = _load_lib(lib, "libggml.so")
    base = _load_lib(lib, "libggml-base.so")
    ggml.ggml_backend_reg_by_name.argtypes, ggml.ggml_backend_reg_by_name.restype = [ctypes.c_char_p], ctypes.c_void_p
    get = base.ggml_backend_reg_get_proc_address
    get.argtypes, get.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
    reg = ggml.ggml_backend_reg_by_name(b"CPU")
    return get(reg, name.encode()) if reg else None


def _load_lib(lib: Path, name: str) -> ctypes.CDLL:
    # By soname, the copy libllama loaded: another copy of libggml would keep its own registry.
    path = lib / f"{name}.0"
    return ctypes.CDLL(str(path if path.exists() else lib / name))


def ensure(model_path: Optional[Path] = None, *, tester: Optional[Tester] = None) -> Optional[Choice]:
    """Load the chosen CPU variant and the other backend libraries into this process, once.

    Must run before llama.cpp's first model load or device query (either would
    otherwise make llama.cpp look for backends where they are not). A no-op,
    returning None, for the host-flags build.
    """
    if "choice" in _loaded:
        return _loaded["choice"]
    choice = choose(model_path, tester=tester)
    if choice is None:
        _loaded["choice"] = None
        return None
    import llama_cpp  # noqa: F401  (loads libllama and the ggml libraries it needs)

    lib = Path(choice.path).parent
    # The other backends first: llama.cpp lists devices in registration order, GPUs before the CPU.
    load_devices(lib)
    ggml = _loader(lib)
    ggml.ggml_backend_reg_by_name.argtypes, ggml.ggml_backend_reg_by_name.restype = [ctypes.c_char_p], ctypes.c_void_p
    os.environ["GGML_BACKEND_PATH"] = choice.path
    if not ggml.ggml_backend_reg_by_name(b"CPU"):
        with silence_native_stderr(), _quiet_llama_logger():  # ggml logs each load ("load_backend: loaded ...")
            if choice.variant in os.environ.get(BREAK_ENV, "").split(","):
                os.kill(os.getpid(), signal.SIGILL)
            ok = ggml.ggml_backend_load(choice.path.encode())
        if not ok:
            raise RuntimeFailure(f"llama.cpp could not load its CPU backend {choice.path}")
    _loaded["choice"] = choice
    return choice


def load_devices(lib: Optional[Path] = None) -> None:
    """Register the portable build's backends other than the CPU (GPU, RPC) in this process, once.

    A device query (llama_supports_gpu_offload, which `--gpu-layers auto` asks before any
    model) finds nothing registered in a portable build until then, and llama.cpp answers
    that by searching for every backend in folders where this build keeps none, logging
    each miss to stderr, and would pick a CPU variant by CPUID alone. With these loaded, it
    sees the GPUs without choosing the CPU variant, which `ensure()` still does, self-tested.
    A no-op for the host-flags build.
    """
    lib = lib or lib_dir()
    if lib is None or "devices" in _loaded or not variants(lib):
        return
    import llama_cpp  # noqa: F401  (loads libllama and the ggml libraries it needs)

    ggml = _loader(lib)
    with silence_native_stderr(), _quiet_llama_logger():
        for other in sorted(lib.glob("libggml-*.so")):
            if not other.name.startswith(_PREFIX) and other.name != "libggml-base.so":
                ggml.ggml_backend_load(str(other).encode())
    _loaded["devices"] = True


def _loader(lib: Path) -> ctypes.CDLL:
    """libggml, with ggml_backend_load typed: it registers one backend library."""
    ggml = _load_lib(lib, "libggml.so")
    ggml.ggml_backend_load.argtypes, ggml.ggml_backend_load.restype = [ctypes.c_char_p], ctypes.c_void_p
    return ggml


@contextlib.contextmanager
def _quiet_llama_logger() -> Iterator[None]:
    # llama_cpp routes ggml's log through its Python logger to sys.stderr, at every level until a Llama sets it
    try:
        from llama_cpp._logger import logger  # llama_cpp loads libllama: only where llama.cpp runs
    except ImportError:
        yield
        return
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def current() -> Optional[Choice]:
    """The variant `ensure()` loaded in this process, if any."""
    return _loaded.get("choice")
