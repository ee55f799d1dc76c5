#!/usr/bin/env python
"""Bounded load test for `edgellm serve` on loopback.

Starts `edgellm serve MODEL --port 0` (or uses --url, which must be a
loopback address), runs C concurrent clients that each send R short chat
requests through the official `openai` client, and prints how many were
answered, p50/p95 latency and tokens/s. Everything is bounded: C*R requests,
a per-request timeout and a total deadline; the server it started is stopped
at the end. Exit status 1 if any request was dropped or failed.

    .venv/bin/python scripts/load_test_server.py [--model NAME|PATH] [--clients 8] [--requests 10]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

PROMPTS = ["Say hello.", "Name a colour.", "What is 2+2?", "Name a fruit.", "Give me a word that rhymes with cat.",
           "Name a planet.", "What day comes after Monday?", "Name an animal.", "Say something kind.", "Count to three."]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def start_server(model: str, threads: int | None, queue: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "edgellm.cli", "serve", model, "--host", "127.0.0.1", "--port", "0", "--queue", str(queue)]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", line)
    if not m:
        proc.kill()
        sys.exit(f"error: the server did not start: {line.strip()} {proc.stderr.read().strip()}")
    return proc, m.group(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="store name, catalog ref or GGUF path")
    ap.add_argument("--url", default=None, help="an already running server (loopback only) instead of starting one")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=10, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="--threads for the server it starts")
    ap.add_argument("--deadline", type=float, default=900.0, help="give up after this many seconds in all")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (1 <= args.clients <= 64 and 1 <= args.requests <= 1000):
        sys.exit("error: --clients must be 1..64 and --requests 1..1000")

    import openai

    proc = None
    if args.url:
        host = urlparse(args.url).hostname or ""
        if not (host == "localhost" or host.startswith("127.") or host == "::1"):
            sys.exit("error: --url must be a loopback address")
        url = args.url.rstrip("/").removesuffix("/v1")
    else:
        proc, url = start_server(args.model, args.threads, queue=max(16, args.clients))
    client = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key, max_retries=0, timeout=300)
    deadline = time.monotonic() + args.deadline
    lock = threading.Lock()
    results: list[dict] = []
    failures: list[str] = []

    def worker(ci: int) -> None:
        for ri in range(args.requests):
            if time.monotonic() > deadline:
                with lock:
                    failures.append(f"client {ci} request {ri}: deadline passed, not sent")
                continue
            t0 = time.perf_counter()
            try:
                r = client.chat.completions.create(
                    model="", messages=[{"role": "user", "content": PROMPTS[(ci + ri) % len(PROMPTS)]}],
                    max_tokens=args.max_tokens, temperature=0.7, seed=ci * 1000 + ri)
                dt = time.perf_counter() - t0
                t = r.model_extra.get("timings", {})
                with lock:
                    results.append({"latency": dt, "completion_tokens": r.usage.completion_tokens,
                                    "prompt_tokens": r.usage.prompt_tokens, "queue_ms": t.get("queue_ms", 0.0),
                                    "predicted_per_second": t.get("predicted_per_second", 0.0)})
            except Exception as e:  # every failure is counted, never retried
                with lock:
                    failures.append(f"client {ci} request {ri}: {type(e).__name__}: {e}")

    try:
        # Warm up: the first request loads the model; it is not part of the figures.
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 1)
        wall = time.perf_counter() - t0
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    lat = [r["latency"] for r in results]
    tokens = sum(r["completion_tokens"] for r in results)
    report = {
        "clients": args.clients, "requests_per_client": args.requests, "sent": args.clients * args.requests,
        "answered": len(results), "failed": len(failures), "wall_seconds": round(wall, 2),
        "latency_p50_s": round(percentile(lat, 50), 3), "latency_p95_s": round(percentile(lat, 95), 3),
        "latency_max_s": round(max(lat), 3) if lat else None,
        "completion_tokens": tokens, "tokens_per_second": round(tokens / wall, 2) if wall > 0 else 0.0,
        "requests_per_second": round(len(results) / wall, 3) if wall > 0 else 0.0,
        "mean_queue_ms": round(statistics.fmean(r["queue_ms"] for r in results), 1) if results else None,
        "mean_decode_tokens_per_second": round(statistics.fmean(r["predicted_per_second"] for r in results), 1) if results else None,
        "cpu_count": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['answered']}/{report['sent']} answered, {report['failed']} failed, in {report['wall_seconds']} s "
              f"({args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens})")
        print(f"latency p50 {report['latency_p50_s']} s, p95 {report['latency_p95_s']} s, max {report['latency_max_s']} s")
        print(f"throughput {report['tokens_per_second']} completion tokens/s, {report['requests_per_second']} requests/s; "
              f"mean time queued {report['mean_queue_ms']} ms; decode speed per request {report['mean_decode_tokens_per_second']} tok/s")
        print(f"load average during the run: {report['load_average_1m']} on {report['cpu_count']} CPUs")
    for f in failures[:10]:
        print("failed:", f, file=sys.stderr)
    return 0 if not failures and len(results) == args.clients * args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
