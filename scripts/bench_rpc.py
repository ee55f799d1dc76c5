#!/usr/bin/env python3
"""`edgellm bench --rpc` over loopback vs local, with llama.cpp's `llama-bench --rpc` against the
same two workers and the same split as the anchor (issue 17).

Starts two `edgellm worker` processes on free loopback ports, runs
`edgellm bench MODEL --rpc A,B --compare-llama-bench --json` (each test here, split, and
llama-bench with -ngl/-ts from the plan), and prints pp and tg: split/local and
edgellm/llama-bench ratios. Refuses to run on a busy machine (1-minute load >= 2.5):
one run on a shared VM moves by more than the 3% the goal allows.

Usage: scripts/bench_rpc.py [MODEL] [--pp 512] [--tg 128] [-r 5] [--threads N] [--force]
Needs llama-bench (scripts/build_llama_tools.sh, or EDGELLM_LLAMA_TOOLS).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EDGELLM = [sys.executable, "-m", "edgellm.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="threads for the host and each worker (default 1)")
    ap.add_argument("--force", action="store_true", help="run even on a busy machine")
    a = ap.parse_args()
    load = os.getloadavg()[0]
    if load >= 2.5 and not a.force:
        print(f"not run: the machine is busy (1-minute load {load:.2f} >= 2.5)", file=sys.stderr)
        return 3
    workers = []
    try:
        for _ in range(2):
            port = free_port()
            p = subprocess.Popen(
                EDGELLM + ["worker", "--port", str(port), "--threads", str(a.threads)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                cwd=ROOT,
            )
            line = p.stdout.readline()
            if "listening" not in line:
                print(f"error: worker on {port} did not start: {line.strip()}", file=sys.stderr)
                return 1
            workers.append((p, f"127.0.0.1:{port}"))
        rpc = ",".join(addr for _, addr in workers)
        cmd = EDGELLM + [
            "bench",
            a.model,
            "--rpc",
            rpc,
            "--pp",
            str(a.pp),
            "--tg",
            str(a.tg),
            "-r",
            str(a.repetitions),
            "--threads",
            str(a.threads),
            "--compare-llama-bench",
            "--json",
            "--no-progress",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "edgellm bench failed", file=sys.stderr)
            return 1
        out = json.loads(proc.stdout)
        print(
            f"load before the run {load:.2f}; plan: "
            + ", ".join(
                f"{d['device']} {d['n_layers']} layers" + (" + output" if d["output_layer"] else "")
                for d in out["rpc_plan"]["devices"]
            )
        )
        print(
            f"{'test':<8} {'split t/s':>10} {'local t/s':>10} {'split/local':>12} {'llama-bench --rpc':>18} {'edgellm/llama-bench':>20}"
        )
        for r in out["rows"]:
            lb = f"{r['llama_bench_rpc_ts']:.2f}" if r["llama_bench_rpc_ts"] else "-"
            ratio = f"{r['ratio']:.3f}x" if r["ratio"] else "-"
            print(
                f"{r['test']:<8} {r['rpc_ts']:>10.2f} {r['local_ts']:>10.2f} {r['rpc_ts'] / r['local_ts']:>11.3f}x {lb:>18} {ratio:>20}"
            )
        return 0
    finally:
        for p, _ in workers:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
