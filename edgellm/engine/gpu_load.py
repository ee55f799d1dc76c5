"""Loading with the offload plan: llama.cpp's log read for what it really put
on the device, and the one-line warning and CPU path when the device fails."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from typing import Any, Optional

from edgellm.engine.gpu import GpuPlan
from edgellm.errors import RuntimeFailure, one_line

log = logging.getLogger(__name__)
MiB = 1 << 20


_BUF = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size\s*=\s*([0-9.]+)\s*MiB")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def parse_buffers(log_text: str) -> dict[str, Any]:
    """llama.cpp's own allocation lines, per buffer owner: {"Vulkan0": {"model": b, "KV": b, ...}, "CPU": ...}.

    Owners are ggml buffer names: Vulkan0, CUDA0, CPU, CPU_Mapped, Vulkan_Host
    (pinned host memory, which is host RAM)."""
    out: dict[str, dict[str, int]] = {}
    for m in _BUF.finditer(log_text):
        d = out.setdefault(m.group(1), {})
        d[m.group(2)] = d.get(m.group(2), 0) + int(float(m.group(3)) * MiB)
    off = _OFFLOADED.search(log_text)
    return {"buffers": out, "offloaded": (int(off.group(1)), int(off.group(2))) if off else None}


def is_device_buffer(owner: str) -> bool:
    o = owner.lower()
    return not (o.startswith("cpu") or o.endswith("_host") or "host" in o)


def split_bytes(log_text: str) -> tuple[int, int]:
    """(device bytes, host bytes) llama.cpp reported allocating."""
    bufs = parse_buffers(log_text)["buffers"]
    dev = sum(sum(v.values()) for k, v in bufs.items() if is_device_buffer(k))
    host = sum(sum(v.values()) for k, v in bufs.items() if not is_device_buffer(k))
    return dev, host


def allocation_report(plan: Optional[GpuPlan], log_text: str, n_gpu_layers: int) -> dict[str, Any]:
    """For --json and the TUI: the plan beside llama.cpp's own figures."""
    parsed = parse_buffers(log_text)
    dev, host = split_bytes(log_text)
    off = parsed["offloaded"]
    return {
        "n_gpu_layers": n_gpu_layers,
        "plan": plan.to_json() if plan else None,
        "allocated": {
            "device_bytes": dev,
            "host_bytes": host,
            "buffers": parsed["buffers"],
            "offloaded_layers": off[0] if off else None,
            "max_layers": off[1] if off else None,
        },
    }


# -- loading with the plan, and the CPU fallback ------------------------------------


def _failure_reason(log_text: str, exc: BaseException) -> str:
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if re.search(r"error|unable|failed|lost|out of (device )?memory", ln, re.I)]
    placed = [m.group(1) for m in _BUF.finditer(log_text) if m.group(2) == "model" and is_device_buffer(m.group(1))]
    if hits:
        reason = hits[0].split("error loading model:", 1)[-1].strip()[:200]
        return reason + (f", after the weights were placed on {placed[0]}" if placed else "")
    return one_line(exc, 200)


class _LoadFailed(Exception):
    """Llama() refused: its exception and what llama.cpp logged before it (where the reason is)."""

    def __init__(self, exc: Exception, log_text: str) -> None:
        super().__init__(str(exc))
        self.reason = _failure_reason(log_text, exc)


def _load_logged(llama_cpp, kw: dict[str, Any], *, verbose: bool, quiet):
    """Llama(**kw) with llama.cpp's log captured (the buffer sizes and any failure reason are in it).
    Raises _LoadFailed when llama.cpp refuses the load."""
    from llama_cpp import _logger  # llama_cpp loads libllama: only where llama.cpp runs

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def on_log(level, text, _user):
        lines.append(text.decode("utf-8", "replace") if text else "")

    llama_cpp.llama_log_set(on_log, None)
    try:
        with quiet(enabled=not verbose):
            try:
                llm = llama_cpp.Llama(**kw)
            except (ValueError, RuntimeError, OSError) as e:
                raise _LoadFailed(e, "".join(lines)) from e
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, None)
    text = "".join(lines)
    if verbose:
        sys.stderr.write(text)
    return llm, text


def load_llama(kw: dict[str, Any], plan: Optional[GpuPlan], *, name: str, quiet=None, verbose: bool = False, warn=log.warning):
    """Load with the plan; when the device fails (allocation refused, device lost, context not created)
    warn once and load again on the CPU. Returns (llm, llama.cpp's load log, the plan that ran).
    `quiet(enabled=)` silences native stderr (runtime.silence_native_stderr; passed in, runtime imports this module)."""

    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    quiet = quiet or (lambda enabled: contextlib.nullcontext())
    try:
        llm, text = _load_logged(llama_cpp, kw, verbose=verbose, quiet=quiet)
        return llm, text, plan
    except _LoadFailed as e:
        reason = e.reason
        # no plan: layers placed by someone else (--rpc), whose failures are theirs to report
        if plan is None or not plan.n_gpu_layers:
            raise RuntimeFailure(f"llama.cpp could not load {name}: {reason}") from None
    where = plan.device.label if plan.device is not None else "the GPU"
    msg = f"GPU offload to {where} failed ({reason}); loading on the CPU"
    warn(msg)
    plan = GpuPlan(
        plan.requested,
        0,
        plan.max_layers,
        None,
        0,
        plan.host_bytes + plan.device_bytes,
        None,
        f"fallback: {msg}",
        plan.notes + [msg],
        plan._device_count,
    )
    kw = {**kw, **plan.llama_kwargs()}
    try:
        llm, text = _load_logged(llama_cpp, kw, verbose=verbose, quiet=quiet)
    except _LoadFailed as e:
        raise RuntimeFailure(f"llama.cpp could not load {name}: {e.reason}") from None
    return llm, text, plan
