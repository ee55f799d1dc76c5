#!/usr/bin/env python3
"""kill -9 edgellm jobs at random points, then check the store kept its promises.

    .venv/bin/python scripts/kill_trials.py --trials 50            # the full run
    .venv/bin/python scripts/kill_trials.py --trials 3 --json      # a slice

For each command (import, convert, quantize, pull, eval, chat history) and
each trial: start the job in a child process, SIGKILL it after a random delay
drawn over the job's measured duration, then start edgellm again and check
that (1) every model the store lists has its file with its recorded sha256,
(2) no temp file survives that start, (3) the job reruns to success. Exit 0
when every trial held.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
PY = sys.executable


def edgellm(args: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "edgellm.cli", *args], env=env, capture_output=True, text=True, **kw)


def check_store(env: dict) -> list[str]:
    """What is wrong with the store after a kill (an empty list when nothing)."""
    problems = []
    res = edgellm(["models", "list", "--json", "--local"], env)  # this start runs the cleanup
    if res.returncode != 0:
        return [f"models list failed: {res.stderr.strip()[-200:]}"]
    home = Path(env["EDGELLM_HOME"])
    code = (
        "import json,sys\nfrom edgellm.models.store import Store\nbad=[]\n"
        "for m in Store().list():\n"
        "    try:\n        Store().verify(m.name)\n"
        "    except Exception as e:\n        bad.append(str(e))\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True)
    problems += json.loads(out.stdout or "[]") if out.returncode == 0 else [f"verify failed: {out.stderr[-200:]}"]
    leftovers = [str(p) for p in home.rglob("*.partial")]
    if leftovers:
        problems.append(f"temp files survived the next start: {leftovers[:3]}")
    # Results are written whole (atomic rename): every one must parse.
    for f in (home / "results").rglob("*.json") if (home / "results").is_dir() else ():
        try:
            json.loads(f.read_text(encoding="utf-8"))
        except ValueError:
            problems.append(f"half-written result {f}")
    # History is append-only JSONL: a kill may tear the last line (no newline),
    # never a complete one; and the sessions must still list.
    for f in (home / "history").rglob("*.jsonl") if (home / "history").is_dir() else ():
        lines = f.read_bytes().split(b"\n")
        for ln in lines[:-1]:
            try:
                json.loads(ln)
            except ValueError:
                problems.append(f"corrupt complete line in history {f.name}: {ln[:60]!r}")
                break
    if (home / "history").is_dir():
        res = edgellm(["chat", "--list", "--json"], env)
        if res.returncode != 0:
            problems.append(f"chat --list failed after the kill: {res.stderr.strip()[-200:]}")
    return problems


class Job:
    """One command to kill: how to run it, how to undo a success between trials."""

    def __init__(self, name: str, args: list[str], *, reset=None, extra_env=None) -> None:
        self.name, self.args, self.reset, self.extra_env = name, args, reset, extra_env or {}


def run_trials(job: Job, env: dict, trials: int, rng: random.Random) -> dict:
    env = dict(env, **job.extra_env)
    first = edgellm(job.args, env)
    if first.returncode != 0:
        return {
            "command": job.name,
            "trials": 0,
            "failures": 1,
            "problems": [f"the job fails even without a kill: {first.stderr.strip()[-300:]}"],
        }
    # Time a second, warm run: the first pays cold caches, and kill delays drawn over
    # it would often land after the job has finished.
    if job.reset:
        job.reset(env)
    t0 = time.monotonic()
    edgellm(job.args, env)
    duration = time.monotonic() - t0
    problems: list[str] = []
    kills = 0
    for i in range(trials):
        if job.reset:
            job.reset(env)
        delay = rng.uniform(0.05, max(0.1, duration))
        p = subprocess.Popen([PY, "-m", "edgellm.cli", *job.args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        for prob in check_store(env):
            problems.append(f"trial {i} (kill at {delay:.2f} s): {prob}")
    if job.reset:
        job.reset(env)
    rerun = edgellm(job.args, env)
    if rerun.returncode != 0:
        problems.append(f"rerun after the kills failed: {rerun.stderr.strip()[-300:]}")
    problems += [f"after rerun: {p}" for p in check_store(env)]
    return {
        "command": job.name,
        "trials": trials,
        "killed_mid_job": kills,
        "job_seconds": round(duration, 2),
        "failures": len(problems),
        "problems": problems[:20],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--commands", default="import,convert,quantize,pull,eval,history")
    ap.add_argument("--default-model", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="edgellm-kill-"))
    try:
        home = work / "home"
        env = dict(os.environ, EDGELLM_HOME=str(home), HF_HOME=str(work / "hf"))
        default = args.default_model
        if default is None:
            default = Path(json.loads(edgellm(["pull", "smollm2-135m-instruct", "--json", "--no-progress"], env).stdout)["path"])
        else:
            edgellm(["import", str(default), "--name", "smollm2-135m-instruct-q4_1"], env)
        from support.gguf_files import write_tiny_llama

        tiny = write_tiny_llama(work / "tiny.gguf", n_layer=4, n_embd=512, n_ff=1536)
        assert edgellm(["import", str(tiny), "--name", "tiny-f16"], env).returncode == 0
        text = work / "text.txt"
        text.write_bytes((ROOT.parent / "shared/data/wikitext-2-raw/wiki.test.raw").read_bytes()[:200_000])

        def rm(name):
            return lambda e: edgellm(["rm", name], e)

        jobs = {
            "import": Job("import", ["import", str(default), "--name", "k-import"], reset=rm("k-import")),
            "convert": Job(
                "convert", ["convert", "smollm2-135m-instruct-q4_1", "--to", "f16", "--name", "k-f16"], reset=rm("k-f16")
            ),
            # into the store (no -o), so the temp file lies where the next start cleans up
            "quantize": Job("quantize", ["quantize", "tiny-f16", "--level", "q4_k_m", "--no-progress"], reset=rm("tiny-q4_k_m")),
            # the level is quantized and registered inside eval each trial, then scored
            "eval": Job(
                "eval",
                [
                    "eval",
                    "tiny-f16",
                    "--levels",
                    "q8_0",
                    "--text",
                    str(text),
                    "--ctx",
                    "64",
                    "--chunks",
                    "2",
                    "--batch",
                    "128",
                    "--no-progress",
                ],
                reset=rm("tiny-q8_0"),
            ),
            "history": Job("history", ["chat", "tiny-f16", "-p", "hello there", "--max-tokens", "48", "--temperature", "0"]),
        }
        selected = [c for c in args.commands.split(",") if c]
        server = None
        if "pull" in selected:
            from support.hubserver import HubServer

            server = HubServer({"edgellm/kill-test": {"model.gguf": default}}).start()
            server.throttle(40 << 20)  # ~2.5 s for the file: room to kill it mid-way
            jobs["pull"] = Job(
                "pull",
                ["pull", "edgellm/kill-test", "--file", "model.gguf", "--name", "k-pull", "--no-progress"],
                reset=rm("k-pull"),
                extra_env={"HF_ENDPOINT": server.url},
            )
        results = []
        try:
            for c in selected:
                results.append(run_trials(jobs[c], env, args.trials, rng))
        finally:
            if server:
                server.stop()
        total = sum(r["failures"] for r in results)
        if args.json:
            print(json.dumps({"results": results, "failures": total}, indent=2))
        else:
            for r in results:
                print(
                    f"{r['command']:<9} trials {r['trials']:>3}  killed mid-job {r.get('killed_mid_job', 0):>3}  job {r.get('job_seconds', 0):>6} s  failures {r['failures']}"
                )
                for p in r["problems"]:
                    print(f"    {p}")
            print(f"failures: {total}")
        return 0 if total == 0 else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
