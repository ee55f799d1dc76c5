"""`edgellm worker`: a llama.cpp RPC worker in the foreground, and the --rpc/--split options the
model commands share."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import click

from edgellm import units
from edgellm.engine import rpc, rpc_native
from edgellm.engine.rpc import prepare
from edgellm.engine.runtime import default_threads
from edgellm.errors import RuntimeFailure, UsageError
from edgellm.fsutil import human_size

SECURITY = (
    "the RPC protocol has no authentication or encryption: anyone who can reach this port can "
    "allocate memory and run computations on this machine; keep it on a trusted LAN or behind an SSH tunnel "
    "(docs/rpc.md)"
)


def rpc_options(f: Callable) -> Callable:
    """--rpc and --split for chat, serve, bench, ppl and eval."""
    f = click.option(
        "--split",
        "rpc_split",
        metavar="A,B,...",
        help="With --rpc: layer shares for this machine, then each worker (default: by the memory each offers).",
    )(f)
    f = click.option(
        "--rpc", "rpc", metavar="HOST:PORT[,...]", help="Split the model across these `edgellm worker`s (and this machine)."
    )(f)
    return f


def prepare_rpc(
    path: Any,
    rpc: Optional[str],
    rpc_split: Optional[str],
    *,
    n_ctx: int,
    kv_type: str = "f16",
    force: bool = False,
    show: bool = True,
) -> Any:
    """Reach the workers and print the plan (stderr) before anything loads; None without --rpc."""
    if not rpc:
        if rpc_split:
            raise UsageError("--split needs --rpc")
        return None

    plan = prepare(path, rpc, n_ctx=n_ctx, kv_type=kv_type, split=rpc_split, force=force)
    if show:
        for line in plan.lines():
            click.echo(line, err=True)
    return plan


def parse_mem(text: Optional[str]) -> Optional[int]:
    """`--mem 4GB`, `512MiB` → bytes (edgellm.units' one convention); at least 1 MiB."""
    return units.parse_size(text, option="--mem", minimum=1 << 20)


def _listen_address(host: str) -> str:
    """The IPv4 address llama.cpp's RPC server binds for --host. It splits HOST:PORT at the first colon and
    opens an IPv4 socket (ggml-rpc.cpp), so IPv6 loopback is served on 127.0.0.1 (the same machine only) and
    any other IPv6 address is refused rather than misread."""
    h = host.strip().strip("[]")
    try:
        addr: Any = ipaddress.ip_address(h)
    except ValueError:
        addr = None
    if addr is not None and addr.version == 6:
        if addr.is_loopback:
            return "127.0.0.1"
        raise UsageError(f"--host {host}: llama.cpp's RPC server listens on IPv4 only; give an IPv4 address or name")
    try:
        return socket.gethostbyname(h)
    except OSError:
        raise UsageError(f"--host: cannot resolve {host!r}") from None


# long: the click options are the worker's interface, one decorator each; the body is under 60 lines
@click.command("worker")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (IPv4; ::1 listens on 127.0.0.1). Anything but loopback (127.x, localhost, ::1) "
    "needs --allow-network.",
)
@click.option("--port", default=50052, show_default=True, type=click.IntRange(1, 65535), help="TCP port.")
@click.option("--threads", type=click.IntRange(1, 1024), help="CPU threads (default: physical cores).")
@click.option(
    "--mem",
    "mem",
    metavar="SIZE",
    help=f"Memory to offer hosts, e.g. 4GB or 4GiB ({units.SIZE_HELP}; default: the RAM available now).",
)
@click.option(
    "--cache",
    "cache_dir",
    type=click.Path(file_okay=False),
    help="Keep received weights here, so a host that loads the same model again sends only hashes.",
)
@click.option("--allow-network", is_flag=True, help="Allow a non-loopback --host (the protocol has no authentication).")
@click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's RPC server log (connections).")
def worker_cmd(
    host: str, port: int, threads: Optional[int], mem: Optional[str], cache_dir: Optional[str], allow_network: bool, verbose: bool
) -> None:
    """Run a llama.cpp RPC worker: hosts split models onto it with --rpc HOST:PORT.

    \b
    Examples:
      edgellm worker                          # 127.0.0.1:50052, for a host on this machine or an SSH tunnel
      edgellm worker --host 192.168.1.20 --allow-network --mem 12GB
      edgellm chat MODEL --rpc 192.168.1.20:50052      # on the host
    """
    mem_bytes = parse_mem(mem)
    ip = _listen_address(host)
    if not units.is_loopback(ip) and not allow_network:
        raise UsageError(f"refusing to listen on {host} without --allow-network: {SECURITY}")
    _check_bind(ip, port)
    cache = None
    if cache_dir:
        cache = Path(cache_dir).expanduser().resolve()
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--cache: cannot create {cache}: {e.strerror or e}") from None

    n_threads = threads or default_threads()
    _dev, desc = rpc_native.cpu_device()
    failed: list[BaseException] = []
    if not verbose:
        _quiet_native_stdout()

    def serve() -> None:
        try:
            rpc_native.run_worker(ip, port, threads=n_threads, mem_bytes=mem_bytes, cache_dir=cache)
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            failed.append(e)

    t = threading.Thread(target=serve, name="edgellm-rpc-worker", daemon=True)
    t.start()
    info = _wait_ready(t, ip, port)
    if info is None:
        msg = failed[0] if failed else "it did not answer its own hello"
        raise RuntimeFailure(f"the RPC worker on {ip}:{port} did not start: {msg}")
    free, _total = info.devices[0]
    _stop_on_signals()  # before the banner: a supervisor may stop us as soon as it reads it
    try:
        click.echo(
            f"edgellm worker: listening on {ip}:{port} (llama.cpp RPC protocol {'.'.join(map(str, info.version))}); "
            f"offering {human_size(free)} on the CPU ({desc}, {n_threads} threads){'; cache ' + str(cache) if cache else ''}"
        )
        if not units.is_loopback(ip):
            click.echo(f"warning: {SECURITY}", err=True)
        click.echo("Ctrl-C to stop", err=True)
        while t.is_alive():
            t.join(0.5)
    except KeyboardInterrupt:
        click.echo("edgellm worker: stopped", err=True)
        sys.stdout.flush()
        # The server thread sits in accept() inside llama.cpp and has no stop call: leave without joining it.
        os._exit(0)
    raise RuntimeFailure(f"the RPC worker on {ip}:{port} stopped: {failed[0] if failed else 'llama.cpp gave up (see -v)'}")


def _stop_on_signals() -> None:
    """Ctrl-C, and SIGTERM from a supervisor (systemd, docker stop), raise KeyboardInterrupt in the main
    thread; set explicitly because a worker started in the background of a script inherits SIGINT ignored."""

    def stop(_signum, _frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def _check_bind(ip: str, port: int) -> None:
    """Bind once here: a busy port is a one-line error (llama.cpp would only print "Failed to create server socket")."""
    probe_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe_sock.bind((ip, port))
    except OSError as e:
        raise UsageError(f"cannot listen on {ip}:{port}: {e.strerror or e}") from None
    finally:
        probe_sock.close()


def _quiet_native_stdout() -> None:
    """llama.cpp's server printf()s every connection on fd 1: send fd 1 to /dev/null, our own lines to a copy of it."""
    sys.stdout.flush()
    out_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = os.fdopen(out_fd, "w", buffering=1)


def _wait_ready(thread: Any, ip: str, port: int, timeout: float = 15.0) -> Any:
    """The worker's own hello, answered: its protocol and the memory it offers (None if it never answered)."""
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        try:
            return rpc.probe(rpc.Endpoint(ip, port), timeout=2.0)
        except rpc.RpcError:
            time.sleep(0.1)
    return None
