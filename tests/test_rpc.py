"""llama.cpp RPC workers (issue 17): real `edgellm worker` processes on loopback ports, the real
default model (Q4_1) and its F16, real `edgellm chat` / `edgellm serve` processes.

Threads are kept at 1 per process: three llama.cpp thread pools spinning on a
2-core machine would measure the scheduler, not the split.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from support.helpers import DEFAULT_NAME, assert_one_line_error, cli_argv, run_cli
from support.quant_fixtures import F16_NAME

PROMPT = "Name three colours of the rainbow."
GiB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One `edgellm worker` child process on a loopback port."""

    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            cli_argv("worker", "--port", self.port, "--threads", "1", *extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = _readline(self.proc.stdout, 60)
        assert f"listening on 127.0.0.1:{self.port}" in line, (line, self.proc.poll())
        self.banner = line

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> tuple[int, str]:
        """Ctrl-C: the worker must stop cleanly and say so."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _out, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _out, err = self.proc.communicate()
        return self.proc.returncode, err


def _readline(stream, timeout: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else ""


@pytest.fixture(scope="module")
def workers():
    ws = [Worker("--mem", "8GiB"), Worker("--mem", "8GiB")]
    yield ws
    for w in ws:
        rc, err = w.stop()
        assert rc == 0 and "edgellm worker: stopped" in err, (rc, err)


# Flash attention is on by default only where every layer runs on this CPU (memory.flash_attn_default) and off
# over RPC; its kernel rounds differently, so the local reference runs with the attention the split runs with.
LOCAL_AS_SPLIT = ("--flash-attn", "off")


def _chat(model: str, *extra: str, max_tokens: int = 16):
    return run_cli(
        "chat",
        model,
        "-p",
        PROMPT,
        "--temperature",
        "0",
        "--max-tokens",
        max_tokens,
        "--no-history",
        "--threads",
        "1",
        "--ctx",
        "512",
        "--json",
        *extra,
        timeout=900,
    )


@pytest.mark.parametrize("which", ["q4_1", "f16"])
def test_chat_over_two_workers_gives_the_local_reply(request, workers, default_model, which):
    model = DEFAULT_NAME
    if which == "f16":
        request.getfixturevalue("f16_model")
        model = F16_NAME
    local = _chat(model, *LOCAL_AS_SPLIT)
    split = _chat(model, "--rpc", ",".join(w.address for w in workers))
    assert local.exit_code == 0 and split.exit_code == 0, (local, split)
    assert local.json()["reply"].strip() and split.json()["reply"] == local.json()["reply"]
    plan = split.json()["rpc_plan"]
    devs = plan["devices"]
    assert [d["device"] for d in devs] == ["local", "RPC0", "RPC1"]
    assert [d["where"] for d in devs[1:]] == [w.address for w in workers]
    assert all(d["n_layers"] > 0 and d["bytes"] > 0 for d in devs), devs
    assert sum(d["n_layers"] for d in devs) == plan["n_layer"] == 30
    assert devs[-1]["output_layer"] and not devs[0]["output_layer"]
    assert [d["memory_bytes"] for d in devs[1:]] == [8 * GiB, 8 * GiB]  # what --mem offered
    # llama.cpp's split: the local layers stay on the CPU, the rest (and the output) by tensor_split
    assert plan["n_gpu_layers"] == 31 - devs[0]["n_layers"] and plan["tensor_split"] == [
        devs[1]["n_layers"],
        devs[2]["n_layers"] + 1,
    ]
    # the plan is printed before loading, naming every device
    assert "plan: 30 layers + output over 3 devices" in split.stderr
    assert all(w.address in split.stderr for w in workers)


def test_plan_by_memory_and_by_split(default_gguf):
    from edgellm.engine.rpc import Endpoint, WorkerInfo, parse_split, plan
    from edgellm.errors import InsufficientResources, UsageError

    ws = [
        WorkerInfo(Endpoint("10.0.0.2", 50052), (7, 0, 0), [(4 * GiB, 4 * GiB)]),
        WorkerInfo(Endpoint("10.0.0.3", 50052), (7, 0, 0), [(4 * GiB, 4 * GiB)]),
    ]
    p = plan(default_gguf, ws, local_memory=4 * GiB, n_ctx=512)
    # 31 positions (30 layers + output) in thirds; the leftover one to the first device
    assert [d.n_layers for d in p.devices] == [11, 10, 9] and p.devices[2].has_output
    assert p.n_gpu_layers == 20 and p.tensor_split == [10.0, 10.0]
    assert p.devices[0].layers == (0, 11) and p.devices[1].layers == (11, 21) and p.devices[2].layers == (21, 30)
    p = plan(default_gguf, ws, local_memory=8 * GiB, n_ctx=512)  # this machine offers twice as much
    assert [d.n_layers for d in p.devices] == [15, 8, 7]
    p = plan(default_gguf, ws, local_memory=4 * GiB, n_ctx=512, split=parse_split("0,1,3", 3))
    assert [d.n_layers for d in p.devices] == [0, 8, 22] and p.n_gpu_layers == 31
    with pytest.raises(UsageError, match="3 devices"):
        parse_split("1,1", 3)
    tiny = [WorkerInfo(Endpoint("10.0.0.9", 1234), (7, 0, 0), [(1 << 20, 1 << 20)])]
    with pytest.raises(InsufficientResources, match="10.0.0.9:1234"):
        plan(default_gguf, tiny, local_memory=4 * GiB, n_ctx=512, split=[1, 1])


@pytest.mark.parametrize(
    "address, needle",
    [
        ("nonsense", "is not HOST:PORT"),
        ("127.0.0.1:0", "port must be a number from 1 to 65535"),
        ("127.0.0.1:http", "port must be a number"),
        ("[::1]:50052", "IPv4 only"),
        ("bad host!:50052", "not a host name"),
        ("127.0.0.1:5000,127.0.0.1:5000", "listed twice"),
    ],
)
def test_malformed_rpc_address_is_one_line(cli, default_model, address, needle):
    res = cli("chat", DEFAULT_NAME, "-p", "hi", "--no-history", "--rpc", address)
    assert_one_line_error(res)
    assert res.exit_code == 2 and needle in res.stderr


def test_closed_port_is_one_line(cli, default_model):
    port = free_port()
    res = cli("chat", DEFAULT_NAME, "-p", "hi", "--no-history", "--rpc", f"127.0.0.1:{port}")
    assert_one_line_error(res)
    assert f"RPC worker 127.0.0.1:{port}: connection refused" in res.stderr


def _serve_in_thread(server) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return t


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    # The handler logs each request to stderr from its own thread, which the CLI run captures:
    # its "400 Bad request" line landed after (and once inside) the error line under test.
    def log_message(self, format, *args):  # noqa: A002  (the base class's name)
        pass


def test_a_port_that_speaks_http_is_one_line(cli, default_model):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    _serve_in_thread(httpd)
    try:
        res = cli("chat", DEFAULT_NAME, "-p", "hi", "--no-history", "--rpc", f"127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
    assert_one_line_error(res)
    assert "speaks HTTP, not llama.cpp RPC" in res.stderr


class _FakeWorker:
    """A TCP server that answers the RPC hello like a worker of another build would."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(1 + 8 + 24)
                    if self.reply is not None:
                        conn.sendall(self.reply)
                        conn.recv(1)  # hold the connection until the client gives up
                except OSError:
                    pass


@pytest.mark.parametrize(
    "reply, needle",
    [
        (struct.pack("<Q", 28) + bytes([6, 0, 0, 0]) + bytes(24), "speaks RPC protocol 6.0.0, this build speaks 7.0.0"),
        (struct.pack("<Q", 28) + bytes([7, 9, 0, 0]) + bytes(24), "speaks RPC protocol 7.9.0"),
        (None, "closed the connection at the RPC hello"),  # an older build drops a hello of the wrong size
        (struct.pack("<Q", 3) + bytes([3, 0, 0]), "answered the RPC hello with 3 bytes"),
    ],
)
def test_a_worker_of_an_incompatible_build_is_one_line(cli, default_model, reply, needle):
    fake = _FakeWorker(reply)
    try:
        res = cli("chat", DEFAULT_NAME, "-p", "hi", "--no-history", "--rpc", f"127.0.0.1:{fake.port}")
    finally:
        fake.sock.close()
    assert_one_line_error(res)
    assert f"127.0.0.1:{fake.port}" in res.stderr and needle in res.stderr


def test_worker_refuses_network_bind_without_allow_network_and_a_busy_port(cli):
    res = cli("worker", "--host", "0.0.0.0")
    assert_one_line_error(res)
    assert res.exit_code == 2 and "--allow-network" in res.stderr and "no authentication" in res.stderr
    with socket.create_server(("127.0.0.1", 0)) as busy:
        res = cli("worker", "--port", busy.getsockname()[1])
    assert_one_line_error(res)
    assert "cannot listen on 127.0.0.1" in res.stderr
    res = cli("worker", "--mem", "lots")
    assert_one_line_error(res)


def _kill_when_output_starts(proc: subprocess.Popen, victim: Worker) -> float:
    first = proc.stdout.read(1)  # chat flushes every piece: the reply is being generated
    assert first, proc.stderr.read()
    victim.proc.kill()  # SIGKILL: no goodbye on the socket beyond the kernel's
    return time.monotonic()


def test_killing_a_worker_mid_reply_ends_chat_with_one_line(default_model):
    a, b = Worker(), Worker()
    try:
        proc = subprocess.Popen(
            cli_argv(
                "chat",
                DEFAULT_NAME,
                "-p",
                "Count from 1 to 300, separated by commas.",
                "--temperature",
                "0",
                "--max-tokens",
                "600",
                "--no-history",
                "--threads",
                "1",
                "--ctx",
                "1024",
                "--rpc",
                f"{a.address},{b.address}",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        t0 = _kill_when_output_starts(proc, b)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("chat did not exit within 10 s of the worker's death")
        elapsed = time.monotonic() - t0
        err = proc.stderr.read()
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert proc.returncode == 1 and elapsed < 10, (proc.returncode, elapsed, err)
        assert len(lines) == 1 and f"RPC worker {b.address} went away during a generation" in lines[0], err
        assert "Traceback" not in err and "ggml-rpc.cpp" not in err
    finally:
        a.stop()
        b.stop()


def _post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _active(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return sum(m.get("active", 0) for m in json.loads(r.read())["models"].values())


@contextlib.contextmanager
def serve_over_two_workers(ctx: int):
    """`edgellm serve` of the default model split over two workers of its own, for a test that
    kills one. On the way out Ctrl-C must stop serve within 30 s; its stderr is then in `.err`."""
    a, b = Worker(), Worker()
    port = free_port()
    server = subprocess.Popen(
        cli_argv(
            "serve",
            DEFAULT_NAME,
            "--port",
            port,
            "--threads",
            "1",
            "--ctx",
            ctx,
            "--parallel",
            "1",
            "--rpc",
            f"{a.address},{b.address}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    s = SimpleNamespace(a=a, b=b, port=port, url=f"http://127.0.0.1:{port}/v1/chat/completions", server=server, err="")
    try:
        assert "listening on" in _readline(server.stdout, 120)
        yield s
    finally:
        server.send_signal(signal.SIGINT)
        try:
            _out, s.err = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
            pytest.fail("serve did not stop within 30 s of Ctrl-C after losing a worker")
        a.stop()
        b.stop()


def test_killing_a_worker_mid_request_gives_serve_a_503_and_no_hang(default_model):
    with serve_over_two_workers(ctx=2048) as s:
        b, port, url = s.b, s.port, s.url
        status, body = _post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # loads the model
        assert status == 200, body
        box: list = []
        long_req = {
            "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
            "max_tokens": 1500,
            "temperature": 0,
        }
        t = threading.Thread(target=lambda: box.append(_post(url, long_req)), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _active(port):  # seated in the engine: llama.cpp is on the workers
            time.sleep(0.1)
        time.sleep(0.5)
        assert t.is_alive(), box
        b.proc.kill()
        t0 = time.monotonic()
        t.join(10)
        assert box, "the request in flight got no answer within 10 s of the worker's death"
        status, body = box[0]
        assert status == 503 and body["error"]["code"] == "rpc_worker_lost", body
        assert b.address in body["error"]["message"] and time.monotonic() - t0 < 10
        t1 = time.monotonic()
        status, body = _post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=10)
        assert status == 503 and body["error"]["code"] == "rpc_worker_lost" and b.address in body["error"]["message"]
        assert time.monotonic() - t1 < 5
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:  # the server itself lives on
            assert r.status == 200


def test_doctor_shows_rpc_and_the_protocol_a_worker_speaks(cli, workers):
    from edgellm.engine.rpc import Endpoint, probe

    res = cli("doctor", "--no-self-test", "--json")
    rpc = res.json()["rpc"]
    assert rpc["compiled_in"] is True
    info = probe(Endpoint("127.0.0.1", workers[0].port))
    assert rpc["protocol"] == ".".join(map(str, info.version)) == "7.0.0"
    assert info.devices == [(8 * GiB, 8 * GiB)]
    text = cli("doctor", "--no-self-test")
    assert "rpc               compiled in, protocol 7.0.0" in text.stdout


def test_ppl_over_two_workers_equals_the_local_ppl(workers, default_model):
    """The workers run the same CPU kernels on the same layers: the split changes where, not what."""
    args = ["ppl", DEFAULT_NAME, "--corpus", "python-docs", "--chunks", "1", "--threads", "1", "--json", "--no-progress"]
    local = run_cli(*args, timeout=900)
    split = run_cli(*args, "--rpc", ",".join(w.address for w in workers), timeout=900)
    assert local.exit_code == 0 and split.exit_code == 0, (local, split)
    assert split.json()["ppl"] == local.json()["ppl"] and local.json()["n_tokens_scored"] == 255
    assert [d["device"] for d in split.json()["rpc_plan"]["devices"]] == ["local", "RPC0", "RPC1"]


def test_bench_over_two_workers_reports_both_speeds_and_the_network_share(workers, default_model):
    from edgellm.profile.bench_rpc import llama_bench_args

    res = run_cli(
        "bench",
        DEFAULT_NAME,
        "--rpc",
        ",".join(w.address for w in workers),
        "--pp",
        "32",
        "--tg",
        "8",
        "-r",
        "1",
        "--threads",
        "1",
        "--json",
        timeout=900,
    )
    assert res.exit_code == 0, res
    out = res.json()
    assert [r["test"] for r in out["rows"]] == ["pp32", "tg8"]
    for r in out["rows"]:
        assert r["rpc_ts"] > 0 and r["local_ts"] > 0
        assert r["network_share"] == pytest.approx(max(0.0, 1 - r["rpc_ts"] / r["local_ts"]))
    plan = out["rpc_plan"]
    assert [d["device"] for d in plan["devices"]] == ["local", "RPC0", "RPC1"]

    # llama-bench gets the same split: RPC devices first, -ngl and -ts from the plan
    args = llama_bench_args(
        SimpleNamespace(
            workers=[SimpleNamespace(endpoint=w.address) for w in workers],
            n_gpu_layers=plan["n_gpu_layers"],
            tensor_split=plan["tensor_split"],
        )
    )
    assert args[:2] == ["--rpc", ",".join(w.address for w in workers)]
    assert args[3] == str(plan["n_gpu_layers"]) and args[5] == "/".join(f"{x:g}" for x in plan["tensor_split"])


def test_a_worker_that_died_while_serve_was_idle_is_a_503_before_any_work(default_model):
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serve_over_two_workers(ctx=1024) as s:
        a, url = s.a, s.url
        assert _post(url, hi)[0] == 200
        a.proc.kill()
        a.proc.wait()
        time.sleep(0.5)
        t0 = time.monotonic()
        status, body = _post(url, hi, timeout=10)
        assert status == 503 and body["error"]["code"] == "rpc_worker_lost", body
        assert f"RPC worker {a.address} is gone" in body["error"]["message"] and time.monotonic() - t0 < 5
    assert s.server.returncode == 0 and "edgellm serve: stopped" in s.err


def test_llama_cpps_own_rpc_server_serves_an_edgellm_host(workers, default_model, llama_tools):
    """Same protocol both ways: llama.cpp's ggml-rpc-server (same vendored tree) beside an edgellm worker."""
    port = free_port()
    srv = subprocess.Popen(
        [str(llama_tools / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from edgellm.engine.rpc import Endpoint, RpcError, probe

        deadline = time.monotonic() + 30
        while True:
            try:
                info = probe(Endpoint("127.0.0.1", port), timeout=2)
                break
            except RpcError:
                assert time.monotonic() < deadline and srv.poll() is None, "rpc-server did not start"
                time.sleep(0.2)
        assert info.version == (7, 0, 0)
        local = _chat(DEFAULT_NAME, *LOCAL_AS_SPLIT)
        split = _chat(DEFAULT_NAME, "--rpc", f"{workers[0].address},127.0.0.1:{port}")
        assert local.exit_code == 0 and split.exit_code == 0, (local, split)
        assert split.json()["reply"] == local.json()["reply"]
        assert [d["where"] for d in split.json()["rpc_plan"]["devices"]][1:] == [workers[0].address, f"127.0.0.1:{port}"]
    finally:
        srv.kill()
        srv.wait()
