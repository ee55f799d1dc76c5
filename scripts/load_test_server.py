#!/usr/bin/env python
"""Bounded load test for `edgellm serve` on loopback, alone or against llama-server.

Runs C concurrent clients that each send R chat requests (streamed, through
the official `openai` client) and prints, per server, answered/failed,
aggregate completion tokens/s, p50/p95 latency and time to first token.
Everything is bounded: C*R requests per round, a per-request timeout and a
total deadline; every server it started is stopped at the end. Exit status 1
if any request was dropped or failed.

    # edgellm serve alone (or --url for a running one, loopback only)
    .venv/bin/python scripts/load_test_server.py [--model NAME|PATH] [--clients 8] [--requests 10] [--parallel 8]
    # edgellm serve --parallel 8 vs llama-server --parallel 8 (and edgellm --parallel 1), alternating, 3 rounds
    .venv/bin/python scripts/load_test_server.py --compare [--rounds 3] [--threads 2]
    # 200 requests mixing valid and bad ones; RSS after the run vs after the warm-up
    .venv/bin/python scripts/load_test_server.py --mixed 200

llama-server comes from scripts/build_llama_tools.sh (the same vendored
llama.cpp and CPU flags as the bindings) or $EDGELLM_LLAMA_TOOLS.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

PROMPTS = [
    "Tell me about the sea.",
    "Describe a city at night.",
    "Explain how rain forms.",
    "Write about a forest walk.",
    "Describe your favourite meal.",
    "Explain what a computer does.",
    "Tell me a story about a cat.",
    "Describe the moon.",
    "Explain why we sleep.",
    "Write about a mountain.",
]
# The shape RAG front ends and agents send: one long system prompt every request shares, short replies.
# Generated, not read from a file: the script must run from a bare clone.
_FACTS = [
    ("the north depot", "opens at 6:30", "closes at 22:00", "holds 140 pallets"),
    ("the river terminal", "opens at 5:00", "closes at 23:30", "holds 320 pallets"),
    ("the airport hub", "opens at 4:45", "closes at 01:00", "holds 90 pallets"),
    ("the east warehouse", "opens at 7:00", "closes at 19:00", "holds 610 pallets"),
    ("the harbour shed", "opens at 6:00", "closes at 20:30", "holds 75 pallets"),
    ("the rail yard", "opens at 5:30", "closes at 21:00", "holds 260 pallets"),
]
SHARED_SYSTEM = (
    "You are the dispatch assistant of a regional delivery company. Answer the driver's question in one or two "
    "short sentences, using only the handbook below. If the handbook does not say, answer that you do not know.\n\n"
    + "\n".join(
        f"Section {i + 1}. {name.capitalize()} {opens} on weekdays and {closes}; it {holds}. Drivers arriving at "
        f"{name} must check in at the gate, show their route sheet, and wait for a bay number. Fragile parcels for "
        f"{name} travel in the upper racks, and refrigerated goods are handed over within ten minutes of arrival. "
        f"Fuel cards are accepted at the pump beside {name}, and a damaged parcel is reported on form D-{i + 7}."
        for i, (name, opens, closes, holds) in enumerate(_FACTS)
    )
)
SHARED_QUESTIONS = [f"When does {name} {verb}?" for name, *_ in _FACTS for verb in ("open", "close")] + [
    f"How many pallets does {name} hold?" for name, *_ in _FACTS
]
WORKLOADS = {
    # name: (requests per client, max_tokens, messages for client ci's request ri, extra request fields)
    "chat": (10, 64, lambda ci, ri: [{"role": "user", "content": PROMPTS[(ci + ri) % len(PROMPTS)]}], {}),
    # Replies of exactly max_tokens (llama-server's `ignore_eos`, which edgellm takes too): the two servers'
    # samplers draw different replies from the same seed, and with replies of 11-48 tokens a latency
    # percentile compared which server happened to stop early more than how fast it served.
    "shared-prefix": (
        3,
        48,
        lambda ci, ri: [
            {"role": "system", "content": SHARED_SYSTEM},
            {"role": "user", "content": SHARED_QUESTIONS[(ci * 3 + ri) % len(SHARED_QUESTIONS)]},
        ],
        {"ignore_eos": True},
    ),
}
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.serve_proc import start_serve, stop_process  # noqa: E402  (the serve tests' own start and stop)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_edgellm(
    model: str, threads: int | None, queue: int, parallel: int | None, ctx: int | None
) -> tuple[subprocess.Popen, str]:
    args = [model, "--host", "127.0.0.1", "--queue", str(queue)]
    for flag, v in (("--threads", threads), ("--parallel", parallel), ("--ctx", ctx)):
        if v:
            args += [flag, str(v)]
    try:
        return start_serve(*args, cwd=ROOT)
    except RuntimeError as e:
        sys.exit(f"error: {e}")


def start_llama_server(path: Path, threads: int | None, parallel: int, ctx: int) -> tuple[subprocess.Popen, str]:
    tools = (
        os.environ.get("EDGELLM_LLAMA_TOOLS")
        or subprocess.run(
            [str(ROOT / "scripts" / "build_llama_tools.sh"), "llama-server", "llama-completion"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    port = _free_port()
    cmd = [
        str(Path(tools) / "llama-server"),
        "-m",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(parallel),
        "-c",
        str(ctx),
        "--no-webui",
        "-fa",
        "auto",  # llama-server's default, as edgellm's: on where every layer runs on the CPU
    ]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: llama-server exited ({proc.returncode}): {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("error: llama-server did not come up in 120 s")


def run_load(
    url: str, model: str, clients: int, requests: int, max_tokens: int, deadline_s: float, workload: str = "chat"
) -> dict:
    """C clients x R streamed chat requests of `workload`; the figures of one round."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)  # warm-up / load
    messages, extra = WORKLOADS[workload][2:]
    deadline = time.monotonic() + deadline_s
    lock = threading.Lock()
    results: list[dict] = []
    failures: list[str] = []

    def worker(ci: int) -> None:
        for ri in range(requests):
            if time.monotonic() > deadline:
                with lock:
                    failures.append(f"client {ci} request {ri}: deadline passed, not sent")
                continue
            t0 = time.perf_counter()
            ttft, n, usage = None, 0, None
            try:
                stream = client.chat.completions.create(
                    model=model,
                    messages=messages(ci, ri),
                    max_tokens=max_tokens,
                    temperature=0.7,
                    seed=ci * 1000 + ri,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=extra or None,
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        n += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                    if chunk.usage is not None:
                        usage = chunk.usage
                dt = time.perf_counter() - t0
                with lock:
                    results.append(
                        {
                            "latency": dt,
                            "ttft": ttft if ttft is not None else dt,
                            "completion_tokens": usage.completion_tokens if usage else n,
                        }
                    )
            except Exception as e:  # every failure is counted, never retried
                with lock:
                    failures.append(f"client {ci} request {ri}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1)
    wall = time.perf_counter() - t0
    lat = [r["latency"] for r in results]
    ttft = [r["ttft"] for r in results]
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "workload": workload,
        "sent": clients * requests,
        "answered": len(results),
        "failed": len(failures),
        "wall_seconds": round(wall, 2),
        "completion_tokens": tokens,
        "tokens_per_second": round(tokens / wall, 2) if wall > 0 else 0.0,
        "latency_p50_s": round(percentile(lat, 50), 3),
        "latency_p95_s": round(percentile(lat, 95), 3),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p95_s": round(percentile(ttft, 95), 3),
        "failures": failures[:10],
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def _shape(args, workload: str) -> tuple[int, int]:
    """Requests per client and max_tokens of a workload: the options when given, else the workload's own."""
    requests, max_tokens = WORKLOADS[workload][:2]
    return args.requests or requests, args.max_tokens or max_tokens


def _goals(med: dict[str, dict], p: int) -> dict[str, float]:
    """The issue's ratios for one workload (tokens/s and p50 latency medians)."""
    ours, theirs, one, their_one = (
        med[f"edgellm --parallel {p}"],
        med[f"llama-server --parallel {p}"],
        med["edgellm --parallel 1"],
        med["llama-server --parallel 1"],
    )
    tps = "tokens_per_second"
    return {
        # goal >= 1.05: against llama-server's better setting on this workload
        "tokens_per_second_vs_llama_server_best": round(ours[tps] / max(theirs[tps], their_one[tps]), 3),
        "tokens_per_second_vs_llama_server": round(ours[tps] / theirs[tps], 3),
        "p50_latency_vs_llama_server": round(ours["latency_p50_s"] / theirs["latency_p50_s"], 3),  # goal <= 1.0
        "ttft_p50_vs_llama_server": round(ours["ttft_p50_s"] / theirs["ttft_p50_s"], 3),
        "tokens_per_second_vs_parallel_1": round(ours[tps] / one[tps], 3),  # goal >= 1.0
        "parallel_1_vs_llama_server_parallel_1": round(one[tps] / their_one[tps], 3),  # goal >= 1.0
        "llama_server_tokens_per_second_vs_its_parallel_1": round(theirs[tps] / their_one[tps], 3),
    }


def compare(args) -> int:
    """edgellm and llama-server, each at --parallel P and --parallel 1, alternating, `rounds` times, on each workload."""
    sys.path.insert(0, str(ROOT))
    from edgellm.models.resolve import resolve

    path = resolve(args.model).path
    ctx = args.ctx or 1024 * args.parallel
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    queue = args.clients * max(_shape(args, w)[0] for w in workloads)
    servers = {
        f"edgellm --parallel {args.parallel}": lambda: start_edgellm(args.model, args.threads, queue, args.parallel, ctx),
        f"llama-server --parallel {args.parallel}": lambda: start_llama_server(path, args.threads, args.parallel, ctx),
        "edgellm --parallel 1": lambda: start_edgellm(args.model, args.threads, queue, 1, 1024),
        # Where batching's ceiling lies on this machine: llama.cpp's own server against itself.
        "llama-server --parallel 1": lambda: start_llama_server(path, args.threads, 1, 1024),
    }
    runs: dict[str, dict[str, list[dict]]] = {w: {k: [] for k in servers} for w in workloads}
    for rnd in range(args.rounds):
        for name, start in servers.items():
            proc, url = start()  # one start per server and round; its workloads run back to back
            try:
                for w in workloads:
                    requests, max_tokens = _shape(args, w)
                    model = "" if name.startswith("edgellm") else "default"
                    r = run_load(url, model, args.clients, requests, max_tokens, args.deadline, w)
                    runs[w][name].append(r)
                    print(
                        f"round {rnd + 1} {w} {name}: {r['answered']}/{r['sent']} answered, {r['tokens_per_second']} tok/s, "
                        f"p50 {r['latency_p50_s']} s, p95 {r['latency_p95_s']} s, ttft p50 {r['ttft_p50_s']} s "
                        f"(load {r['load_average_1m']})",
                        file=sys.stderr,
                    )
            finally:
                stop_process(proc)
    keys = ("tokens_per_second", "latency_p50_s", "latency_p95_s", "ttft_p50_s", "ttft_p95_s")
    report: dict = {
        "model": args.model,
        "clients": args.clients,
        "threads": args.threads,
        "ctx": ctx,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "workloads": {},
    }
    ok = True
    for w in workloads:
        med = {
            name: {k: statistics.median(r[k] for r in rs) for k in keys}
            | {"answered": sum(r["answered"] for r in rs), "failed": sum(r["failed"] for r in rs)}
            for name, rs in runs[w].items()
        }
        ok = ok and all(m["failed"] == 0 for m in med.values())
        requests, max_tokens = _shape(args, w)
        report["workloads"][w] = {
            "requests_per_client": requests,
            "max_tokens": max_tokens,
            "medians": med,
            **_goals(med, args.parallel),
            "runs": runs[w],
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if ok else 1
    for w, rep in report["workloads"].items():
        print(
            f"{w}: {args.clients} clients x {rep['requests_per_client']} chat requests, max_tokens {rep['max_tokens']}, "
            f"{args.rounds} alternating rounds (medians)"
        )
        print(
            f"{'server':28s} {'answered':>9s} {'failed':>7s} {'tok/s':>8s} {'p50 s':>7s} {'p95 s':>7s} {'ttft50':>7s} {'ttft95':>7s}"
        )
        for name, m in rep["medians"].items():
            print(
                f"{name:28s} {m['answered']:9d} {m['failed']:7d} {m['tokens_per_second']:8.1f} {m['latency_p50_s']:7.2f} "
                f"{m['latency_p95_s']:7.2f} {m['ttft_p50_s']:7.2f} {m['ttft_p95_s']:7.2f}"
            )
        print(
            f"  edgellm --parallel {args.parallel}: {rep['tokens_per_second_vs_llama_server_best']}x llama-server's better "
            f"setting (goal >= 1.05), {rep['tokens_per_second_vs_parallel_1']}x its --parallel 1 (goal >= 1.0), p50 latency "
            f"{rep['p50_latency_vs_llama_server']}x llama-server's (goal <= 1.0); edgellm --parallel 1: "
            f"{rep['parallel_1_vs_llama_server_parallel_1']}x llama-server's (goal >= 1.0)"
        )
    return 0 if ok else 1


def mixed(args) -> int:
    """`--mixed N` requests, every third one bad, 8 at a time; RSS after vs after a warm-up round."""
    import psutil

    sys.path.insert(0, str(ROOT / "tests"))
    from test_server import PAR, PAR_CTX, _bad_requests, _mixed_round  # noqa: F401  (one definition of the bad kinds)

    proc, url = start_edgellm(args.model, args.threads, 64, PAR, PAR_CTX)
    try:
        reference: dict = {}
        problems = _mixed_round(url, 24, reference)
        rss0 = psutil.Process(proc.pid).memory_info().rss
        problems += _mixed_round(url, args.mixed, reference)
        rss1 = psutil.Process(proc.pid).memory_info().rss
    finally:
        stop_process(proc)
    drift = (rss1 - rss0) / rss0
    print(
        f"{args.mixed} mixed requests: {len(problems)} wrong answers; RSS {rss0 / 2**20:.1f} MiB after the warm-up, "
        f"{rss1 / 2**20:.1f} MiB after the run ({drift * 100:+.2f}%)"
    )
    for p in problems[:10]:
        print("wrong:", p, file=sys.stderr)
    return 0 if not problems and abs(drift) <= 0.05 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="store name, catalog ref or GGUF path")
    ap.add_argument("--url", default=None, help="an already running server (loopback only) instead of starting one")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument(
        "--requests", type=int, default=None, help="requests per client [default: the workload's: chat 10, shared-prefix 3]"
    )
    ap.add_argument("--max-tokens", type=int, default=None, help="[default: the workload's: chat 64, shared-prefix 48]")
    ap.add_argument(
        "--workload",
        choices=[*WORKLOADS, "both"],
        default=None,
        help="chat: short distinct prompts; shared-prefix: a ~735-token system prompt every request shares [default: "
        "both with --compare, else chat]",
    )
    ap.add_argument("--threads", type=int, default=None, help="threads of every server it starts")
    ap.add_argument("--parallel", type=int, default=8, help="--parallel of the servers it starts")
    ap.add_argument("--ctx", type=int, default=None, help="KV cells per server [default: 1024 per slot]")
    ap.add_argument("--compare", action="store_true", help="edgellm and llama-server, each at --parallel P and 1, alternating")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mixed", type=int, default=0, metavar="N", help="N mixed valid/bad requests and the RSS check")
    ap.add_argument("--deadline", type=float, default=900.0, help="give up a round after this many seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.workload is None:
        args.workload = "both" if args.compare else "chat"
    if args.workload == "both" and not args.compare:
        sys.exit("error: --workload both needs --compare")
    if not (1 <= args.clients <= 64 and 1 <= (args.requests or 1) <= 1000):
        sys.exit("error: --clients must be 1..64 and --requests 1..1000")
    if args.compare:
        return compare(args)
    if args.mixed:
        return mixed(args)
    proc = None
    if args.url:
        host = urlparse(args.url).hostname or ""
        if not (host == "localhost" or host.startswith("127.") or host == "::1"):
            sys.exit("error: --url must be a loopback address")
        url = args.url.rstrip("/").removesuffix("/v1")
    else:
        proc, url = start_edgellm(args.model, args.threads, max(16, args.clients), args.parallel, args.ctx)
    requests, max_tokens = _shape(args, args.workload)
    try:
        r = run_load(url, "", args.clients, requests, max_tokens, args.deadline, args.workload)
    finally:
        stop_process(proc)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(
            f"{r['answered']}/{r['sent']} answered, {r['failed']} failed, in {r['wall_seconds']} s "
            f"({args.clients} clients x {requests} {args.workload} requests, max_tokens {max_tokens})"
        )
        print(
            f"latency p50 {r['latency_p50_s']} s, p95 {r['latency_p95_s']} s; first token p50 {r['ttft_p50_s']} s, "
            f"p95 {r['ttft_p95_s']} s; {r['tokens_per_second']} completion tokens/s; load average {r['load_average_1m']}"
        )
    for f in r["failures"]:
        print("failed:", f, file=sys.stderr)
    return 0 if not r["failed"] and r["answered"] == r["sent"] else 1


if __name__ == "__main__":
    sys.exit(main())
