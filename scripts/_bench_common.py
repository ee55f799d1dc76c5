"""Shared pieces of the benchmark scripts: a child's wall time, peak memory and extra disk, sampled.

`measured(cmd, dirs=...)` runs one command and samples, every ~50 ms, the
RssAnon and RssFile of its whole process tree (/proc/<pid>/status, children
from /proc/<pid>/task/*/children) and the bytes allocated under `dirs`
(st_blocks, so sparse or preallocated files count as the disk they take).
`Sampler(pid, dirs)` does the same around a process started elsewhere (a
server). Linux only: /proc is the point. `chat_cmd(...)` is the command line
of one greedy `edgellm chat -p`, the run the chat benchmarks time;
`speed_parser`, `mean_sd`, `paired_ratios`, `ratio_cells` and `verdict` are
the options, the figures and the report of the speed comparisons that
alternate two sides round by round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

PERIOD = 0.05


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out += [int(x) for x in fh.read().split()]
    except OSError:
        pass
    return out


def tree_rss(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) in bytes summed over pid and its descendants."""
    anon = file = 0
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("RssAnon:"):
                        anon += int(line.split()[1]) * 1024
                    elif line.startswith("RssFile:"):
                        file += int(line.split()[1]) * 1024
        except OSError:
            continue
        todo += _children(p)
    return anon, file


def allocated(dirs: list[Path]) -> int:
    """Bytes allocated on disk under `dirs` (files that vanish mid-walk count as gone)."""
    total = 0
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_blocks * 512
                except OSError:
                    pass
    return total


class Sampler:
    """Peaks of a process tree's anonymous and file-backed RSS, and of the extra disk under `dirs`."""

    def __init__(self, pid: int, dirs: list[Path] = ()):
        self.pid, self.dirs = pid, [Path(d) for d in dirs]
        self.disk0 = allocated(self.dirs)
        self.anon = self.file = self.rss = self.disk = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _sample(self) -> None:
        a, f = tree_rss(self.pid)
        self.anon, self.file, self.rss = max(self.anon, a), max(self.file, f), max(self.rss, a + f)
        self.disk = max(self.disk, allocated(self.dirs) - self.disk0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(PERIOD)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        return {"peak_anon": self.anon, "peak_file": self.file, "peak_rss": self.rss, "extra_disk": self.disk}


def measured(
    cmd: list, *, dirs: list[Path] = (), env: dict | None = None, timeout: float = 14400, cwd: Path | None = None
) -> dict:
    """Run `cmd` to the end; its rc, stdout, stderr, wall seconds and the Sampler's peaks."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )
    s = Sampler(proc.pid, dirs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n[timed out after {timeout:.0f} s]"
    finally:
        peaks = s.stop()
    return {"rc": proc.returncode, "stdout": out, "stderr": err, "wall_s": time.perf_counter() - t0, **peaks}


def median_of(runs: list[dict]) -> dict:
    """The median of every numeric figure over runs (a figure missing from a run is left out of it)."""
    keys = {k for r in runs for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: statistics.median(r[k] for r in runs if k in r) for k in keys}


def speed_parser(doc: str, *, per: str, rounds: int, rounds_help: str | None = None) -> argparse.ArgumentParser:
    """The options a speed comparison shares with the others (threads, the pp/tg test, `-r` repetitions
    per `per` call, rounds, levels), so the same command line means the same run in each; it adds its own after."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=2, help=f"repetitions per {per} call")
    ap.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    ap.add_argument("--levels", default="q4_k_m,q8_0")
    return ap


def mean_sd(xs: list[float]) -> tuple[float, float]:
    """The mean of one side's per-round figures and their sample standard deviation (0 for one round)."""
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def paired_ratios(num: list[float], den: list[float]) -> tuple[list[float], float]:
    """num/den round by round, and the median of those ratios (robust to a burst of load landing on one call)."""
    per_round = [x / y for x, y in zip(num, den, strict=False)]
    return per_round, statistics.median(per_round)


def ratio_cells(ma: float, sa: float, mb: float, sb: float, mean_ratio: float, ratio: float, goal: float) -> str:
    """A comparison row's figures: each side's mean ± sd, the ratio of the means, the median paired ratio (flagged under goal)."""
    flag = "" if ratio >= goal else "  < goal"
    return f"{ma:9.2f} ± {sa:5.2f} {mb:9.2f} ± {sb:5.2f} {mean_ratio:8.3f}x {ratio:12.3f}x{flag}"


def verdict(results: list[dict], goal: float, load0, load1, what: str = "") -> float:
    """Print the load average before/after (where known) and the worst median paired ratio against goal; return it."""
    if load0 and load1:
        print(f"load average before/after: {load0[0]:.1f} / {load1[0]:.1f} on {os.cpu_count()} CPUs")
    worst = min((r["ratio"] for r in results), default=0.0)
    print(f"worst median paired ratio {what}{worst:.3f}x (goal >= {goal}x)")
    return worst


def chat_cmd(path: Path, prompt: str, tokens: int, *flags: str) -> list[str]:
    """`edgellm chat` of one prompt, greedy (temperature 0), at most `tokens` tokens, `flags` after."""
    return [
        sys.executable,
        "-m",
        "edgellm.cli",
        "chat",
        str(path),
        "-p",
        prompt,
        "--temperature",
        "0",
        "--max-tokens",
        str(tokens),
        *flags,
    ]
