"""Threads that follow the machine: fewer when other processes take cores, back up when they leave.

llama.cpp's worker threads meet at a barrier after every op and wait for the
slowest one, so a thread whose core another process takes costs more than
its share: on 2 cores with one kept busy, 2 threads run at a third of their
idle speed while 1 thread keeps nearly all of its. llama.cpp's default
(every physical core) is the worst choice on a busy laptop.

`ThreadController` is the decision, pure and fed from outside: the seconds
per generated token at the current thread count, and how many cores other
processes used (`CpuLoad`, from /proc/stat minus this process's own CPU
time). The load is the trigger, the measured token time the judge:

* others take a core from the threads we run -> drop to the cores left;
  if the next window is slower than the one before the move, move back and
  leave it there for a while (the load figure misled);
* the load goes -> probe one thread more; keep it only if it is faster;
  a failed probe waits twice as long before the next one.

`ThreadGovernor` wires it into a decode loop: windows of at least
`window_s`, `llama_set_n_threads` when the count changes. `--threads N`
pins the count (no governor).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

_BUSY_MARGIN = 0.35  # others using this much of a core count it as taken
_SLOWER = 1.04  # a move that makes tokens this much slower is undone
_FASTER = 0.97  # a probe up is kept only when this much faster


@dataclass
class ThreadDecision:
    threads: int
    reason: str  # "start", "load", "probe-up", "kept", "reverted"


@dataclass
class ThreadController:
    """Chooses a thread count in [1, max_threads] from per-token times and the other processes' load."""

    max_threads: int
    threads: int = 0  # current; 0: start at max_threads
    backoff_s: float = 2.0
    history: list[ThreadDecision] = field(default_factory=list)
    _prev: Optional[tuple[int, float]] = None  # (threads, s/token) of the window before the last move
    _moved_at: float = -1e9
    _hold_until: float = -1e9  # no load-driven move down before this (after a revert)
    _probe_at: float = -1e9  # no probe up before this
    _probe_wait: float = 0.0

    def __post_init__(self) -> None:
        self.max_threads = max(1, int(self.max_threads))
        if not self.threads:
            self.threads = self.max_threads
        self.threads = min(self.threads, self.max_threads)
        self._probe_wait = self.backoff_s
        self.history.append(ThreadDecision(self.threads, "start"))

    def free_cores(self, other_cores: float) -> int:
        """Cores left to us when others use `other_cores` of them (at least 1)."""
        taken = int(other_cores + 1.0 - _BUSY_MARGIN) if other_cores > 0 else 0
        return max(1, min(self.max_threads, self.max_threads - taken))

    def observe(self, token_seconds: Optional[float], other_cores: float, now: float) -> int:
        """One window's measurements -> the thread count for the next window."""
        cur = self.threads
        free = self.free_cores(other_cores)
        prev, self._prev = self._prev, None
        if prev is not None and token_seconds is not None:
            n_prev, t_prev = prev
            if n_prev < cur:  # this window was a probe up
                if token_seconds < _FASTER * t_prev:
                    self._probe_wait = self.backoff_s
                    return self._move(cur, "kept", token_seconds, now, remember=False)
                self._probe_at = now + self._probe_wait
                self._probe_wait = min(60.0, self._probe_wait * 2)
                return self._move(n_prev, "reverted", token_seconds, now, remember=False)
            if token_seconds > _SLOWER * t_prev:  # a move down that did not pay
                self._hold_until = now + self._probe_wait
                self._probe_wait = min(60.0, self._probe_wait * 2)
                return self._move(n_prev, "reverted", token_seconds, now, remember=False)
            return cur
        if free < cur and now >= self._hold_until:
            return self._move(free, "load", token_seconds, now)
        if free > cur and now >= self._probe_at:
            return self._move(cur + 1, "probe-up", token_seconds, now)
        return cur

    def _move(self, n: int, reason: str, token_seconds: Optional[float], now: float, *, remember: bool = True) -> int:
        if remember and token_seconds is not None:
            self._prev = (self.threads, token_seconds)
        if n != self.threads or reason in ("kept", "reverted"):
            self.history.append(ThreadDecision(n, reason))
        self.threads = n
        self._moved_at = now
        return n


class CpuLoad:
    """Cores used by other processes since the last call: /proc/stat's busy time minus this process's CPU time."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.available = os.path.exists("/proc/stat")
        self._last = self._read() if self.available else None

    def _read(self) -> Optional[tuple[float, float, float]]:
        try:
            with open("/proc/stat", "rb") as f:
                cpu = f.readline().split()
        except OSError:
            return None
        # user nice system idle iowait irq softirq steal
        vals = [int(v) for v in cpu[1:9]]
        busy = vals[0] + vals[1] + vals[2] + vals[5] + vals[6] + vals[7]
        t = os.times()
        return time.monotonic(), busy / self.tick, t.user + t.system

    def other_cores(self) -> float:
        """Cores others used over the interval since the last call (0.0 where /proc is missing)."""
        if not self.available:
            return 0.0
        cur = self._read()
        last, self._last = self._last, cur
        if cur is None or last is None or cur[0] - last[0] <= 0:
            return 0.0
        wall = cur[0] - last[0]
        others = (cur[1] - last[1]) - (cur[2] - last[2])
        return max(0.0, others / wall)


class ThreadGovernor:
    """Feeds a decode loop's token times and the load to a `ThreadController` and applies its choice."""

    def __init__(
        self,
        ctx: Any,
        max_threads: int,
        *,
        load: Optional[Callable[[], float]] = None,
        window_s: float = 0.25,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        import llama_cpp  # lazy: this module's decision logic is usable without llama.cpp

        self._set = llama_cpp.llama_set_n_threads
        self.ctx = ctx
        self.controller = ThreadController(max_threads, threads=int(llama_cpp.llama_n_threads(ctx)) or max_threads)
        self.load = load or CpuLoad().other_cores
        self.window_s = window_s
        self.clock = clock
        self._start = clock()
        self._secs = 0.0
        self._n = 0
        if self.controller.threads != int(llama_cpp.llama_n_threads(ctx)):
            self._set(ctx, self.controller.threads, self.controller.threads)

    @property
    def threads(self) -> int:
        return self.controller.threads

    def token(self, seconds: float) -> None:
        """One single-token decode step took `seconds`; at the end of a window, maybe change the threads."""
        self._secs += seconds
        self._n += 1
        now = self.clock()
        if now - self._start >= self.window_s:
            self._window(now)

    def idle(self) -> None:
        """A step that was not a single-token decode (a verify): counts toward the window's time only."""
        now = self.clock()
        if now - self._start >= 4 * self.window_s:
            self._window(now)

    def _window(self, now: float) -> None:
        per_token = self._secs / self._n if self._n else None
        before = self.controller.threads
        n = self.controller.observe(per_token, self.load(), now)
        if n != before:
            self._set(self.ctx, n, n)
        self._start, self._secs, self._n = now, 0.0, 0


__all__ = ["ThreadController", "ThreadDecision", "CpuLoad", "ThreadGovernor"]
