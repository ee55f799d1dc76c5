"""llama.cpp RPC workers: addresses, the hello before loading, and the split plan.

A worker is llama.cpp's RPC server (`edgellm worker`, or llama.cpp's own
`rpc-server` from the same version). The host lists the workers' devices,
puts some of the model's layers on each and sends them the weights; every
token then runs the layers where they live.

llama.cpp's client side aborts the whole process on any surprise (a refused
connection, a worker of another protocol version, a port that speaks
HTTP). So nothing reaches it before edgellm has talked to every worker
itself, in Python, with a timeout: `probe()` sends the RPC hello, checks the
protocol version and asks for the devices and their memory. Only then does
`edgellm.engine.rpc_native` register the workers with llama.cpp.

The protocol (ggml-rpc.cpp): a request is | cmd u8 | size u64 | payload |,
a reply is | size u64 | payload |, little-endian. A worker serves one host at
a time: a second host's connection waits in its accept queue, which is why a
hello that is never answered is reported as "busy with another host".

The plan (`plan()`): the local machine keeps the first layers, the workers
take the rest in order (the output layer counts as one more layer and sits on
the last device, as llama.cpp places it). Layers are shared by the memory
each device offers, or by `--split`. The plan's bytes come from the GGUF's
own tensor table and `edgellm.engine.memory`'s KV and compute estimate.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm.engine.memory import PROCESS_BYTES, available_ram, estimate, kv_bytes_per_token
from edgellm.errors import EdgeLLMError, InsufficientResources, UsageError
from edgellm.fsutil import human_size
from edgellm.gguf.layout import read_tensors
from edgellm.gguf.reader import read_gguf

DEFAULT_PORT = 50052
MAX_SERVERS = 16  # GGML_RPC_MAX_SERVERS
PROBE_TIMEOUT = 5.0

CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14  # fixed forever by ggml-rpc.cpp (static_assert), so any version answers it
CMD_DEVICE_COUNT = 15
CONN_CAPS_SIZE = 24
HELLO_REPLY_SIZE = 4 + CONN_CAPS_SIZE


class RpcError(EdgeLLMError):
    """A worker that cannot be used: unreachable, another protocol, not a worker at all."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class WorkerInfo:
    endpoint: Endpoint
    version: tuple[int, int, int]
    devices: list[tuple[int, int]]  # (free, total) bytes per device

    @property
    def free_bytes(self) -> int:
        return sum(f for f, _ in self.devices)


_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


def parse_endpoints(text: str | Sequence[str]) -> list[Endpoint]:
    """`HOST:PORT[,HOST:PORT...]` → endpoints; anything else is a one-line UsageError."""
    items = [p for part in ([text] if isinstance(text, str) else list(text)) for p in part.split(",")]
    out: list[Endpoint] = []
    for raw in items:
        item = raw.strip()
        host, sep, port_s = item.rpartition(":")
        if not item or not sep or not host or not port_s:
            raise UsageError(f"--rpc: {item!r} is not HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT})")
        if host.startswith("[") or ":" in host:
            raise UsageError(f"--rpc: {item!r}: llama.cpp's RPC client speaks IPv4 only; give an IPv4 address or a host name")
        if not _HOST_RE.match(host):
            raise UsageError(f"--rpc: {item!r}: {host!r} is not a host name or IPv4 address")
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise UsageError(f"--rpc: {item!r}: the port must be a number from 1 to 65535")
        ep = Endpoint(host, int(port_s))
        if ep in out:
            raise UsageError(f"--rpc: {ep} is listed twice")
        out.append(ep)
    if len(out) > MAX_SERVERS:
        raise UsageError(f"--rpc: at most {MAX_SERVERS} workers (llama.cpp's limit), got {len(out)}")
    return out


def local_version() -> tuple[int, int, int]:
    """The RPC protocol this build of llama.cpp speaks, from the ggml-rpc.h installed with it."""
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    pkg = Path(llama_cpp.__file__).resolve().parent
    for header in (pkg.parent / "include" / "ggml-rpc.h", pkg / "include" / "ggml-rpc.h"):
        try:
            text = header.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parts = [re.search(rf"#define\s+RPC_PROTO_{k}_VERSION\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
        if all(parts):
            return tuple(int(m.group(1)) for m in parts)  # type: ignore[return-value,union-attr]
    raise RpcError(
        "this llama-cpp-python install has no ggml-rpc.h: its RPC protocol version is unknown; rebuild with scripts/setup.sh"
    )


def compatible(remote: tuple[int, int, int], local: tuple[int, int, int]) -> bool:
    """llama.cpp's own rule (negotiate_hello): same major, a minor no newer than ours."""
    return remote[0] == local[0] and remote[1] <= local[1]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _call(sock: socket.socket, cmd: int, payload: bytes, reply_size: int) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    head = _recv_exact(sock, 8)
    if len(head) < 8:
        raise ConnectionAbortedError("closed")
    (size,) = struct.unpack("<Q", head)
    if size != reply_size:
        raise ValueError(f"a {size}-byte reply where {reply_size} bytes were expected")
    body = _recv_exact(sock, reply_size)
    if len(body) < reply_size:
        raise ConnectionAbortedError("closed")
    return body


def probe(ep: Endpoint, *, timeout: float = PROBE_TIMEOUT, local: Optional[tuple[int, int, int]] = None) -> WorkerInfo:
    """Reach a worker within `timeout`, check its protocol, list its devices and memory."""
    local = local or local_version()
    try:
        sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
    except socket.gaierror:
        raise RpcError(f"RPC worker {ep}: cannot resolve host {ep.host!r}") from None
    except ConnectionRefusedError:
        raise RpcError(f"RPC worker {ep}: connection refused (is `edgellm worker --port {ep.port}` running there?)") from None
    except TimeoutError:
        raise RpcError(f"RPC worker {ep}: no answer within {timeout:g} s (host down or port filtered)") from None
    except OSError as e:
        raise RpcError(f"RPC worker {ep}: cannot connect ({e.strerror or e})") from None
    with sock:
        sock.settimeout(timeout)
        try:
            sock.sendall(struct.pack("<BQ", CMD_HELLO, CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE))
            head = _recv_exact(sock, 8)
            if head[:5] in (b"HTTP/", b"<!DOC", b"<html") or head[:4] == b"SSH-":
                kind = "SSH" if head[:4] == b"SSH-" else "HTTP"
                raise RpcError(f"RPC worker {ep}: that port speaks {kind}, not llama.cpp RPC (wrong port?)")
            if len(head) < 8:
                raise RpcError(
                    f"RPC worker {ep}: closed the connection at the RPC hello: not a llama.cpp RPC worker, "
                    f"or one from an incompatible build (this one speaks protocol {'.'.join(map(str, local))})"
                )
            (size,) = struct.unpack("<Q", head)
            if size != HELLO_REPLY_SIZE:
                raise RpcError(
                    f"RPC worker {ep}: answered the RPC hello with {size} bytes, not {HELLO_REPLY_SIZE}: "
                    f"not a llama.cpp RPC worker of protocol {local[0]}.x"
                )
            body = _recv_exact(sock, HELLO_REPLY_SIZE)
            if len(body) < HELLO_REPLY_SIZE:
                raise RpcError(f"RPC worker {ep}: closed the connection in the middle of the RPC hello")
            version = (body[0], body[1], body[2])
            if not compatible(version, local):
                raise RpcError(
                    f"RPC worker {ep} speaks RPC protocol {'.'.join(map(str, version))}, this build speaks "
                    f"{'.'.join(map(str, local))}: run the same edgellm/llama.cpp version on both sides"
                )
            (count,) = struct.unpack("<I", _call(sock, CMD_DEVICE_COUNT, b"", 4))
            if not 0 < count <= 64:
                raise RpcError(f"RPC worker {ep} reports {count} devices")
            devices = []
            for i in range(count):
                free, total = struct.unpack("<QQ", _call(sock, CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16))
                devices.append((int(free), int(total)))
        except TimeoutError:
            if _speaks_http(ep, min(timeout, 2.0)):
                raise RpcError(f"RPC worker {ep}: that port speaks HTTP, not llama.cpp RPC (wrong port?)") from None
            raise RpcError(
                f"RPC worker {ep}: accepted the connection but did not answer the RPC hello within {timeout:g} s "
                "(a worker serves one host at a time: is another host using it?)"
            ) from None
        except ConnectionAbortedError:
            raise RpcError(f"RPC worker {ep}: closed the connection during the hello") from None
        except ValueError as e:
            raise RpcError(f"RPC worker {ep}: malformed reply ({e})") from None
        except OSError as e:
            raise RpcError(f"RPC worker {ep}: connection lost during the hello ({e.strerror or e})") from None
    return WorkerInfo(ep, version, devices)


def _speaks_http(ep: Endpoint, timeout: float) -> bool:
    """A silent port may be an HTTP server waiting for a request line (our hello has no newline): ask it.

    A busy RPC worker queues this connection and later drops it at the first
    byte ('G' is no RPC command), so asking costs it nothing.
    """
    try:
        with socket.create_connection((ep.host, ep.port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            return _recv_exact(s, 5) == b"HTTP/"
    except OSError:
        return False


def probe_all(
    endpoints: Sequence[Endpoint], *, timeout: float = PROBE_TIMEOUT, known: Optional[dict[Endpoint, WorkerInfo]] = None
) -> list[WorkerInfo]:
    """Probe each worker; `known` ones (this process already holds their connection, so a new one
    would wait behind it in the worker's accept queue) are taken as they were."""
    local = local_version()
    known = known or {}
    return [known[ep] if ep in known else probe(ep, timeout=timeout, local=local) for ep in endpoints]


# -- the plan -----------------------------------------------------------------


@dataclass
class DevicePlan:
    name: str  # "local" or "RPC0", "RPC1" ... (llama.cpp's names, in order)
    where: str  # "this machine" or HOST:PORT
    layers: tuple[int, int]  # [first, last) repeating layers; the output layer is position n_layer
    has_output: bool
    memory_bytes: int  # what it offers
    weights_bytes: int = 0
    kv_bytes: int = 0
    other_bytes: int = 0  # local: embeddings, compute buffer, the process

    @property
    def n_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.other_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.name,
            "where": self.where,
            "layers": list(self.layers),
            "n_layers": self.n_layers,
            "output_layer": self.has_output,
            "bytes": self.total_bytes,
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "other_bytes": self.other_bytes,
            "memory_bytes": self.memory_bytes,
        }


@dataclass
class Plan:
    n_layer: int
    devices: list[DevicePlan]
    workers: list[WorkerInfo] = field(default_factory=list)
    by: str = "memory"  # "memory" or "--split"

    @property
    def n_gpu_layers(self) -> int:
        """llama.cpp's n_gpu_layers: every position (layers + output) not kept locally."""
        return self.n_layer + 1 - self.devices[0].n_layers

    @property
    def tensor_split(self) -> list[float]:
        """Positions per RPC device, in llama.cpp's device order (the output counts on the last)."""
        return [float(d.n_layers + (1 if d.has_output else 0)) for d in self.devices[1:]]

    def lines(self) -> list[str]:
        out = [f"plan: {self.n_layer} layers + output over {len(self.devices)} devices (by {self.by}):"]
        for d in self.devices:
            span = f"layers {d.layers[0]}-{d.layers[1] - 1}" if d.n_layers else "no layers"
            out.append(
                f"  {d.name:<6} {d.where:<22} {span:<14}{' + output' if d.has_output else '':<9} "
                f"{human_size(d.total_bytes):>10} of {human_size(d.memory_bytes)} offered"
            )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "n_layer": self.n_layer,
            "by": self.by,
            "n_gpu_layers": self.n_gpu_layers,
            "tensor_split": self.tensor_split,
            "devices": [d.to_json() for d in self.devices],
            "workers": [
                {
                    "endpoint": str(w.endpoint),
                    "version": ".".join(map(str, w.version)),
                    "devices": [{"free": f, "total": t} for f, t in w.devices],
                }
                for w in self.workers
            ],
        }


def parse_split(text: Optional[str], n_devices: int) -> Optional[list[float]]:
    """`--split 2,1,1`: shares for the local machine, then each worker device in order."""
    if not text:
        return None
    try:
        parts = [float(p) for p in text.split(",")]
    except ValueError:
        raise UsageError(f"--split: {text!r} is not a list of numbers like 2,1,1") from None
    if len(parts) != n_devices:
        raise UsageError(f"--split: {len(parts)} shares for {n_devices} devices (this machine first, then each worker)")
    if any(p < 0 for p in parts) or sum(parts) <= 0:
        raise UsageError("--split: shares must be >= 0 and not all 0")
    return parts


def _shares(weights: Sequence[float], n: int) -> list[int]:
    """Split `n` positions by `weights`, largest remainder first; ties to the earlier device."""
    total = sum(weights)
    exact = [w / total * n for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def plan(
    path: Path | str,
    workers: Sequence[WorkerInfo],
    *,
    local_memory: int,
    n_ctx: int,
    kv_type: str = "f16",
    n_ubatch: int = 512,
    split: Optional[Sequence[float]] = None,
    force: bool = False,
) -> Plan:
    """Where each layer goes, and how many bytes that puts on each device."""

    info = read_gguf(path)
    n_layer = info.block_count
    if n_layer <= 0:
        raise UsageError(f"{Path(path).name}: no layer count in the GGUF; it cannot be split across workers")
    rpc_devs = [(w, i, free) for w in workers for i, (free, _total) in enumerate(w.devices)]
    mem = [local_memory] + [free for _, _, free in rpc_devs]
    weights = list(split) if split is not None else [float(max(m, 0)) for m in mem]
    if sum(weights) <= 0:
        raise InsufficientResources("no device offers any memory: nothing to split the model over")
    counts = _shares(weights, n_layer + 1)
    # The output position sits on the last device that gets any position, never on this machine
    # while a worker follows it (llama.cpp keeps the order local → RPC0 → RPC1 ...).
    if counts[0] == n_layer + 1 and len(counts) > 1:
        counts[0] -= 1
        counts[-1] += 1
    per_layer: dict[int, int] = {}
    output_bytes = 0
    other_bytes = 0
    tok_embd = 0
    has_output_tensor = False
    for t in read_tensors(path).tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + t.n_bytes
        elif t.name.startswith("output"):
            output_bytes += t.n_bytes
            has_output_tensor |= t.name == "output.weight"
        else:
            other_bytes += t.n_bytes
            if t.name == "token_embd.weight":
                tok_embd = t.n_bytes
    if not has_output_tensor:  # tied embeddings: llama.cpp loads token_embd a second time for the output
        output_bytes += tok_embd
    kv_layer = kv_bytes_per_token(info, kv_type) * n_ctx // max(1, n_layer)
    # flash attention is off with RPC workers (memory.flash_attn_default): the score buffer counts
    est = estimate(info, ctx=n_ctx, kv_type=kv_type, n_ubatch=n_ubatch, flash_attn=False)
    names = ["local"] + [f"RPC{k}" for k in range(len(rpc_devs))]
    wheres = ["this machine"] + [str(w.endpoint) + (f" dev {i}" if len(w.devices) > 1 else "") for w, i, _ in rpc_devs]
    devices: list[DevicePlan] = []
    start = 0
    for k, c in enumerate(counts):
        pos_end = start + c
        layers = (min(start, n_layer), min(pos_end, n_layer))
        has_out = pos_end > n_layer
        d = DevicePlan(names[k], wheres[k], layers, has_out, mem[k])
        d.weights_bytes = sum(per_layer.get(i, 0) for i in range(*layers)) + (output_bytes if has_out else 0)
        d.kv_bytes = kv_layer * (layers[1] - layers[0])
        if k == 0:
            d.other_bytes = other_bytes + est.compute_bytes + PROCESS_BYTES
        devices.append(d)
        start = pos_end
    result = Plan(n_layer, devices, list(workers), by="--split" if split is not None else "memory")
    for d in devices:
        if d.total_bytes > d.memory_bytes and not (force and d.name == "local"):
            fix = "use --force" if d.name == "local" else "give that worker more --mem, add a worker or change --split"
            raise InsufficientResources(
                f"the plan puts {human_size(d.total_bytes)} on {d.where} ({d.name}) but it offers "
                f"{human_size(d.memory_bytes)}; {fix}, or use a smaller level or --ctx"
            )
    return result


def prepare(
    path: Path | str,
    endpoints: Sequence[str] | str,
    *,
    n_ctx: int,
    kv_type: str = "f16",
    n_ubatch: int = 512,
    split: Optional[str] = None,
    force: bool = False,
    timeout: float = PROBE_TIMEOUT,
    known: Optional[dict[Endpoint, WorkerInfo]] = None,
) -> Plan:
    """Parse, reach and check every worker, then plan the split: everything before llama.cpp sees them."""

    eps = parse_endpoints(endpoints)
    if not eps:
        raise UsageError("--rpc: no workers given")
    workers = probe_all(eps, timeout=timeout, known=known)
    n_dev = 1 + sum(len(w.devices) for w in workers)
    return plan(
        path,
        workers,
        local_memory=available_ram(),
        n_ctx=n_ctx,
        kv_type=kv_type,
        n_ubatch=n_ubatch,
        split=parse_split(split, n_dev),
        force=force,
    )


__all__ = [
    "Endpoint",
    "WorkerInfo",
    "Plan",
    "DevicePlan",
    "RpcError",
    "parse_endpoints",
    "parse_split",
    "probe",
    "probe_all",
    "plan",
    "prepare",
    "local_version",
    "compatible",
    "DEFAULT_PORT",
]
