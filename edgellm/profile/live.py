"""`LiveSampler`: the tokens/s and RSS meter that chat's `/stats` and the TUI show while generating."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)


# -- live sampler ---------------------------------------------------------------


@dataclass
class LiveSnapshot:
    tokens: int  # fed so far
    elapsed_seconds: float
    tokens_per_second: float  # over the last `window` seconds
    average_tokens_per_second: float  # since start
    rss_bytes: int
    peak_rss_bytes: int
    samples: list[tuple[float, float, int]]  # (seconds since start, tokens/s, rss) at each tick

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class LiveSampler:
    """Tokens/s (fed by the caller with `.tokens(n)`) and RSS of `pid`, sampled every `interval` s on a thread."""

    def __init__(self, pid: Optional[int] = None, interval: float = 0.5, *, window: float = 3.0, max_samples: int = 600) -> None:
        import psutil  # psutil only where a process is measured

        self.proc = psutil.Process(pid)
        self.interval = interval
        self.window = window
        self.max_samples = max_samples
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = time.monotonic()
        self._count = 0
        self._events: list[tuple[float, int]] = []  # (time, cumulative tokens)
        self._samples: list[tuple[float, float, int]] = []
        self._rss = self._peak = self._read_rss()

    def _read_rss(self) -> int:
        try:
            return int(self.proc.memory_info().rss)
        except Exception:
            return 0

    def start(self) -> LiveSampler:
        if self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="edgellm-live-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 2 * self.interval))
            self._thread = None

    def __enter__(self) -> LiveSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def tokens(self, n: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self._count += int(n)
            self._events.append((now, self._count))
            cut = now - self.window
            while len(self._events) > 2 and self._events[1][0] < cut:
                self._events.pop(0)

    def reset(self) -> None:
        with self._lock:
            self._t0 = time.monotonic()
            self._count = 0
            self._events.clear()
            self._samples.clear()

    def _rate(self, now: float) -> float:
        ev = [e for e in self._events if e[0] >= now - self.window]
        if len(ev) >= 2 and ev[-1][0] > ev[0][0]:
            return (ev[-1][1] - ev[0][1]) / (ev[-1][0] - ev[0][0])
        return 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = self._read_rss()
            now = time.monotonic()
            with self._lock:
                self._rss = rss
                self._peak = max(self._peak, rss)
                self._samples.append((now - self._t0, self._rate(now), rss))
                if len(self._samples) > self.max_samples:
                    del self._samples[: len(self._samples) - self.max_samples]

    def snapshot(self) -> LiveSnapshot:
        rss = self._read_rss()
        now = time.monotonic()
        with self._lock:
            self._rss = rss
            self._peak = max(self._peak, rss)
            elapsed = now - self._t0
            return LiveSnapshot(
                tokens=self._count,
                elapsed_seconds=elapsed,
                tokens_per_second=self._rate(now),
                average_tokens_per_second=self._count / elapsed if elapsed > 0 else 0.0,
                rss_bytes=rss,
                peak_rss_bytes=self._peak,
                samples=list(self._samples),
            )
