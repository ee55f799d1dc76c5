"""GPU devices and the offload plan: how many layers go to which device.

`list_devices()` asks the loaded ggml library (ctypes; llama-cpp-python does
not bind the device registry) which GPU devices llama.cpp could use, with
their memory. Software devices (Mesa's llvmpipe/lavapipe, SwiftShader) are
real Vulkan devices that run on the CPU: offloading to them is slower than
the CPU path, so `auto` never picks one; they are used only when named with
`--gpu-device`. llama.cpp itself hides CPU-type Vulkan devices unless
GGML_VK_VISIBLE_DEVICES names them (e.g. GGML_VK_VISIBLE_DEVICES=0).

`plan_offload()` turns `--gpu-layers` (0, N, all, auto) and `--gpu-mem` into
the number llama.cpp gets and the bytes that land on the device and the host.
The sizes come from `edgellm.engine.memory.estimate()` (the RAM guard's
estimate: KV cache and compute buffers) split per layer with the real tensor
sizes from the GGUF: llama.cpp's N offloaded "layers" are the output layer
first, then the last N - 1 repeating blocks (of n_layer + 1 in all), each
block with its KV cache, plus one compute buffer on the device. The
token embeddings always stay on the host.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from edgellm import units
from edgellm.engine import backends
from edgellm.engine.memory import estimate
from edgellm.errors import UsageError
from edgellm.fsutil import human_size
from edgellm.gguf.layout import read_tensors

log = logging.getLogger(__name__)

SOFTWARE_MARKERS = ("llvmpipe", "lavapipe", "swiftshader", "softpipe")
SOFTWARE_NOTE = "software: no speed-up expected"
MiB = 1 << 20
# Room left on a device for the driver, other programs and allocation slack.
MARGIN_MIN_BYTES = 256 * MiB
MARGIN_FRACTION = 0.05

# ggml_backend_dev_type
_TYPE_NAMES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass
class GpuDevice:
    index: int  # position in list_devices(): what `--gpu-device N` means
    name: str  # ggml's name: Vulkan0, CUDA0, Metal
    description: str  # the driver's name for it: "llvmpipe (LLVM 15.0.6, 256 bits)"
    backend: str  # Vulkan, CUDA, Metal ...
    kind: str  # "gpu" or "igpu"
    total_bytes: int
    free_bytes: int
    software: bool

    @property
    def label(self) -> str:
        return f"{self.name} ({self.description})"

    def describe(self) -> str:
        s = (
            f"{self.index}: {self.name} [{self.backend}, {self.kind}] {self.description}: "
            f"{human_size(self.free_bytes)} free of {human_size(self.total_bytes)}"
        )
        return s + (f" ({SOFTWARE_NOTE})" if self.software else "")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["note"] = SOFTWARE_NOTE if self.software else ""
        return d


def is_software(description: str) -> bool:
    d = description.lower()
    return any(m in d for m in SOFTWARE_MARKERS)


def _ggml() -> Optional[ctypes.CDLL]:
    """The ggml library llama_cpp loaded (its dependency tree has the device registry)."""
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    # A portable build registers its backends (the CPU variant, Vulkan...) only when loaded; asked
    # before that, ggml's registry is empty and would stay so. A no-op for a host-flags build.
    backends.ensure()

    libdir = Path(llama_cpp.__file__).parent / "lib"
    # By soname first: the copy libllama loaded. A wheel may also hold a plain libggml.so that is a
    # separate file, whose registry (empty) is not the one the backends were loaded into.
    for name in ("libggml.so.0", "libggml.so", "libggml.dylib", "ggml.dll"):
        if (libdir / name).exists():
            lib = ctypes.CDLL(str(libdir / name))
            break
    else:
        return None
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    sigs = {
        "ggml_backend_dev_count": ([], sz),
        "ggml_backend_dev_get": ([sz], vp),
        "ggml_backend_dev_name": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_description": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_type": ([vp], ctypes.c_int),
        "ggml_backend_dev_backend_reg": ([vp], vp),
        "ggml_backend_reg_name": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_memory": ([vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
    }
    sigs.update({"ggml_backend_reg_count": ([], sz), "ggml_backend_reg_get": ([sz], vp)})
    try:
        for fn, (args, res) in sigs.items():
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, res
    except AttributeError:  # a ggml without the device registry
        return None
    return lib


def list_devices() -> list[GpuDevice]:
    """GPU devices llama.cpp could offload to, in registry order (RPC servers and the CPU left out)."""
    lib = _ggml()
    if lib is None:
        return []
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs
    from llama_cpp import _logger  # llama_cpp loads libllama: only where llama.cpp runs

    # The first registry call starts the backends; Vulkan's start-up chatter ("Found 1 Vulkan devices")
    # would reach the user's terminal through llama-cpp-python's logger.
    @llama_cpp.llama_log_callback
    def drop(level, text, _user):
        pass

    llama_cpp.llama_log_set(drop, None)
    try:
        return _enumerate(lib)
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, None)


def _enumerate(lib) -> list[GpuDevice]:
    out: list[GpuDevice] = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = _TYPE_NAMES.get(lib.ggml_backend_dev_type(dev), "?")
        backend = (lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)) or b"").decode("utf-8", "replace")
        if kind not in ("gpu", "igpu") or backend.upper() == "RPC":
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        desc = (lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace")
        out.append(
            GpuDevice(
                len(out),
                (lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
                desc,
                backend,
                kind,
                int(total.value),
                int(free.value),
                is_software(desc),
            )
        )
    return out


def gpu_backends() -> list[str]:
    """GPU backends compiled into this llama.cpp (Vulkan, CUDA, Metal ...): the CPU, RPC and BLAS ones left out."""
    lib = _ggml()
    if lib is None:
        return []
    names = [
        (lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)) or b"").decode() for i in range(lib.ggml_backend_reg_count())
    ]
    return [n for n in names if n.upper() not in ("CPU", "RPC", "BLAS", "")]


def no_device_reason() -> str:
    if not gpu_backends():
        return "no GPU device: this llama.cpp build has no GPU backend (CPU-only; scripts/setup.sh --gpu ... builds one)"
    hint = ""
    if "GGML_VK_VISIBLE_DEVICES" not in os.environ and any(
        any(Path(d).glob("lvp_icd*.json")) for d in ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d")
    ):
        hint = (
            "; Mesa's lavapipe (a software Vulkan device) is installed, which llama.cpp hides unless "
            "GGML_VK_VISIBLE_DEVICES names it (e.g. GGML_VK_VISIBLE_DEVICES=0)"
        )
    return "no GPU device: llama.cpp's GPU backend sees no device" + hint


def device_lines() -> list[str]:
    """For the TUI's System screen and doctor: one line per device, or why there is none."""
    devs = list_devices()
    return [d.describe() for d in devs] or [no_device_reason()]


def _llama_order(devices: Sequence[GpuDevice]) -> list[GpuDevice]:
    """The device list llama.cpp builds by default (discrete GPUs; integrated ones only without those):
    `main_gpu` indexes into it."""
    gpus = [d for d in devices if d.kind == "gpu"]
    return gpus or [d for d in devices if d.kind == "igpu"]


def find_device(ref: Union[str, int], devices: Sequence[GpuDevice]) -> GpuDevice:
    """`--gpu-device`: an index into list_devices(), or a name (Vulkan0) / description substring (llvmpipe)."""
    s = str(ref).strip()
    if s.isdigit():
        i = int(s)
        if i < len(devices):
            return devices[i]
    else:
        for d in devices:
            if d.name.lower() == s.lower():
                return d
        hits = [d for d in devices if s.lower() in d.description.lower()]
        if len(hits) == 1:
            return hits[0]
    have = ", ".join(f"{d.index}={d.name} ({d.description})" for d in devices) or "none"
    raise UsageError(f"no GPU device {s!r} (devices: {have}; see `edgellm doctor`)")


# -- the plan ---------------------------------------------------------------------


@dataclass
class LayerCosts:
    """Bytes llama.cpp puts on a device per offloaded unit, from the GGUF's tensors and the memory estimate."""

    block_weights: list[int]  # per repeating layer blk.i
    block_kv: int  # KV cache of one layer at the context
    output_weights: int  # output layer: output.weight + output_norm
    output_copy: int  # tied embeddings: llama.cpp's device copy of token_embd for the output layer
    host_only_weights: int  # token_embd and anything llama.cpp keeps on the CPU
    compute_bytes: int  # one compute buffer on the device once any layer is offloaded
    host_compute_offloaded: int  # what stays on the host then (input rows; measured 4 MB on lavapipe)

    @property
    def n_layers(self) -> int:
        return len(self.block_weights)

    def device_bytes(self, n_gpu_layers: int) -> int:
        """Device bytes for llama.cpp's n_gpu_layers: the output layer goes first, then the last
        n_gpu_layers - 1 blocks, each with its KV cache, and one compute buffer (llama-model.cpp)."""
        k = max(0, min(n_gpu_layers, self.n_layers + 1))
        if k == 0:
            return 0
        blocks = k - 1
        return (
            self.output_weights
            + self.output_copy
            + sum(self.block_weights[self.n_layers - blocks :])
            + blocks * self.block_kv
            + self.compute_bytes
        )

    def host_bytes(self, n_gpu_layers: int) -> int:
        """Host bytes: the weights and KV cache not offloaded, and the host's compute buffer."""
        k = max(0, min(n_gpu_layers, self.n_layers + 1))
        if k == 0:
            return self.total_bytes() + self.compute_bytes
        moved = self.device_bytes(k) - self.compute_bytes - self.output_copy
        return self.total_bytes() - moved + self.host_compute_offloaded

    def total_bytes(self) -> int:
        """Weights + KV of the whole model (compute buffers aside), each tensor counted once."""
        return sum(self.block_weights) + self.n_layers * self.block_kv + self.output_weights + self.host_only_weights


_BLK = re.compile(r"^blk\.(\d+)\.")


def layer_costs(path: Path | str, info, *, ctx: int, kv_type: str = "f16", n_ubatch: int = 512) -> LayerCosts:
    """Split the RAM guard's estimate per layer with the GGUF's own tensor sizes."""

    # with GPU layers flash attention is off unless asked (memory.flash_attn_default): the score buffer counts
    est = estimate(info, ctx=ctx, kv_type=kv_type, n_ubatch=n_ubatch, flash_attn=False)
    n = int(info.block_count or 0)
    blocks = [0] * n
    output = host = embd = 0
    has_output = False
    for t in read_tensors(path).tensors:
        m = _BLK.match(t.name)
        if m and int(m.group(1)) < n:
            blocks[int(m.group(1))] += t.n_bytes
        elif t.name.startswith("output"):
            output += t.n_bytes
            has_output = has_output or t.name == "output.weight"
        else:
            host += t.n_bytes
            if t.name == "token_embd.weight":
                embd = t.n_bytes
    # tied embeddings: llama.cpp loads a second copy of token_embd for the output layer
    copy = 0 if has_output else embd
    # Once a layer is offloaded the logits and attention run on the device (llama.cpp offloads the
    # big matmuls too); the host keeps a buffer of input rows, the estimate's activation term.
    host_compute = min(est.compute_bytes, 3 * 4 * min(n_ubatch, ctx) * int(info.embedding_length or 0))
    return LayerCosts(blocks, est.kv_bytes // n if n else 0, output, copy, host, est.compute_bytes, host_compute)


@dataclass
class GpuPlan:
    requested: str  # what the user asked: "0", "12", "all", "auto"
    n_gpu_layers: int  # what llama.cpp gets
    max_layers: int  # the model's n_layer + 1 (llama.cpp counts the output layer)
    device: Optional[GpuDevice]
    device_bytes: int
    host_bytes: int
    budget_bytes: Optional[int]  # what the device may take (free less margin, capped by --gpu-mem)
    reason: str
    notes: list[str] = field(default_factory=list)  # warnings for the user (clamped, fallbacks)
    # devices llama.cpp knows about; when the plan is 0, keep them out entirely (no compute buffer there)
    _device_count: int = 0
    _main_gpu: int = -1

    def llama_kwargs(self) -> dict[str, Any]:
        """Arguments for llama_cpp.Llama / llama_model_params."""
        if self._device_count == 0:
            return {"n_gpu_layers": 0}
        if self.n_gpu_layers == 0 or self.device is None:
            # split NONE with main_gpu -1 empties llama.cpp's device list: a true CPU run
            return {"n_gpu_layers": 0, "split_mode": 0, "main_gpu": -1}
        return {"n_gpu_layers": self.n_gpu_layers, "split_mode": 0, "main_gpu": self._main_gpu}

    def describe(self) -> str:
        if self.n_gpu_layers == 0:
            return f"GPU offload: none ({self.reason})"
        assert self.device is not None
        return (
            f"GPU offload: {self.n_gpu_layers}/{self.max_layers} layers on {self.device.label}: "
            f"{human_size(self.device_bytes)} on the device, {human_size(self.host_bytes)} on the host ({self.reason})"
        )

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}  # the _fields are llama.cpp's, not the user's
        d["device"] = self.device.to_json() if self.device else None
        return d


def parse_size(text: Optional[str]) -> Optional[int]:
    """`--gpu-mem`: 512MB, 1.5GB, 2GiB, or bytes (edgellm.units' one convention)."""
    return units.parse_size(text, option="--gpu-mem")


def _parse_request(value: Union[int, str, None]) -> tuple[str, Optional[int]]:
    """('auto'|'all'|'N', N or None)."""
    s = "0" if value is None else str(value).strip().lower()
    if s in ("auto", "all"):
        return s, None
    try:
        n = int(s)
    except ValueError:
        raise UsageError(f"--gpu-layers takes a number, all, auto or 0, not {value!r}") from None
    if n < 0:
        return "all", None  # llama.cpp's -1
    return str(n), n


def budget_for(device: GpuDevice, gpu_mem: Optional[int]) -> int:
    margin = max(MARGIN_MIN_BYTES, int(device.total_bytes * MARGIN_FRACTION))
    room = max(0, device.free_bytes - margin)
    return room if gpu_mem is None else min(room, gpu_mem)


def plan_offload(
    path: Path | str,
    info,
    request: Union[int, str, None],
    *,
    ctx: int,
    kv_type: str = "f16",
    n_ubatch: int = 512,
    gpu_device: Union[str, int, None] = None,
    gpu_mem: Optional[int] = None,
    devices: Optional[Sequence[GpuDevice]] = None,
) -> GpuPlan:
    """Decide n_gpu_layers and the device for one load. Never raises for a missing device: the plan is 0 with a reason."""
    kind, n = _parse_request(request)
    costs = layer_costs(path, info, ctx=ctx, kv_type=kv_type, n_ubatch=n_ubatch)
    max_layers = costs.n_layers + 1
    host_all = costs.host_bytes(0)
    devs = list(list_devices() if devices is None else devices)
    notes: list[str] = []

    def none(reason: str, *, warn: bool) -> GpuPlan:
        if warn:
            notes.append(f"{reason}; running on the CPU")
        return GpuPlan(kind, 0, max_layers, None, 0, host_all, None, reason, notes, len(devs))

    if kind == "0" and gpu_device is None:
        return none("--gpu-layers 0", warn=False)
    if not devs:
        return none(no_device_reason(), warn=kind != "auto")
    if gpu_device is not None:
        dev = find_device(gpu_device, devs)
        if kind == "0":
            return none("--gpu-layers 0", warn=False)
    else:
        hw = [d for d in devs if not d.software]
        if not hw:
            soft = ", ".join(d.label for d in devs)
            return none(
                f"the only GPU device is {soft}, {SOFTWARE_NOTE}; name it with --gpu-device to use it anyway", warn=kind != "auto"
            )
        dev = max(hw, key=lambda d: d.free_bytes)
    order = _llama_order(devs)
    if dev not in order:
        return none(f"{dev.label} is an integrated GPU beside a discrete one; llama.cpp does not offload to it", warn=True)
    budget = budget_for(dev, gpu_mem)
    if kind == "auto":
        k = max((k for k in range(max_layers + 1) if costs.device_bytes(k) <= budget), default=0)
        if k == 0:
            one = costs.device_bytes(1)
            return none(
                f"one layer needs {human_size(one)} on {dev.name} (weights, KV cache and compute buffer), "
                f"more than the {human_size(budget)} it may use" + (" (--gpu-mem)" if gpu_mem is not None else ""),
                warn=False,
            )
        reason = (
            f"auto: all that fit in {human_size(budget)}"
            if k == max_layers
            else f"auto: the most that fit in {human_size(budget)}"
        )
    else:
        k = max_layers if kind == "all" else int(n or 0)
        reason = "all layers" if kind == "all" else f"--gpu-layers {k}"
        if k > max_layers:
            notes.append(
                f"--gpu-layers {k} is more than the model's {max_layers} layers "
                f"({costs.n_layers} blocks + output); offloading all {max_layers}"
            )
            k = max_layers
            reason = "all layers"
        if costs.device_bytes(k) > budget:
            notes.append(
                f"{k} layers need ~{human_size(costs.device_bytes(k))} on {dev.name}, more than the "
                f"{human_size(budget)} it may use; if allocation fails edgellm falls back to the CPU"
            )
    return GpuPlan(
        kind, k, max_layers, dev, costs.device_bytes(k), costs.host_bytes(k), budget, reason, notes, len(devs), order.index(dev)
    )


__all__ = [
    "GpuDevice",
    "GpuPlan",
    "LayerCosts",
    "list_devices",
    "gpu_backends",
    "no_device_reason",
    "device_lines",
    "find_device",
    "plan_offload",
    "layer_costs",
    "parse_size",
    "is_software",
    "SOFTWARE_NOTE",
    "budget_for",
]
