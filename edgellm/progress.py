"""The one progress callback type and the cancel token every long job takes.

A job calls `on_progress(Progress(...))` as it goes and `cancel.check()`
between units of work. The CLI renders the events as a bar on stderr; the TUI
posts them as messages from its worker thread. Keeping both sides to this
single shape is what lets a new job appear in both front ends for free.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

from edgellm.errors import Cancelled
from edgellm.units import human_size


@dataclass(frozen=True)
class Progress:
    """One progress event. `total` is None when the size is unknown."""

    task: str
    done: float
    total: Optional[float] = None
    unit: str = ""  # "B" for bytes, "tensor", "chunk", "token", ...
    message: str = ""
    rate: Optional[float] = None  # units per second, when the job knows it

    @property
    def fraction(self) -> Optional[float]:
        if not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))

    @property
    def eta_seconds(self) -> Optional[float]:
        if not self.total or not self.rate or self.rate <= 0:
            return None
        return max(0.0, (self.total - self.done) / self.rate)


ProgressCallback = Callable[[Progress], None]


def no_progress(_: Progress) -> None:
    """The default callback: jobs never have to test for None."""


def staged(on_progress: ProgressCallback, stages: tuple[str, ...], name: str) -> ProgressCallback:
    """The callback for one stage of a job made of `stages`: each event's task reads "2/4 calibrate: ...",
    so a bar (CLI or TUI) says where a long job is without knowing the job."""
    prefix = f"{stages.index(name) + 1}/{len(stages)} {name}{_STAGE_END}"
    return lambda p: on_progress(replace(p, task=prefix + p.task))


_STAGE_END = ": "


def stage_of(p: Progress) -> str:
    """ "2/4 calibrate" for an event of a `staged` job, "" for any other: what a bar shows of where the job is."""
    head, sep, _ = p.task.partition(_STAGE_END)
    count, _, name = head.partition(" ")
    done, slash, total = count.partition("/")
    return head if sep and name and slash and done.isdigit() and total.isdigit() else ""


class CancelToken:
    """Thread-safe cancellation flag shared by a job and whoever may stop it."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = "cancelled"

    def cancel(self, reason: str = "cancelled") -> None:
        self.reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise `Cancelled` if someone asked the job to stop."""
        if self._event.is_set():
            raise Cancelled(self.reason)


class RateMeter:
    """Smoothed units/second over a sliding window, for rate and ETA."""

    def __init__(self, window: float = 3.0) -> None:
        self.window = window
        self._samples: list[tuple[float, float]] = []

    def update(self, done: float) -> Optional[float]:
        now = time.monotonic()
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.window:
            self._samples.pop(0)
        t0, d0 = self._samples[0]
        if now - t0 <= 0:
            return None
        return (done - d0) / (now - t0)


def format_amount(value: float, unit: str) -> str:
    if unit == "B":
        return human_size(value)
    return f"{value:.0f}"


class TerminalBar:
    """A dependency-free progress bar for stderr (the CLI's renderer).

    On a TTY it redraws one line at most ~10 times a second. Piped (a log, a
    file, CI), it prints a plain line when a task reaches its next 10% and, for
    a task of unknown size, at most one every `PIPED_INTERVAL` seconds: a
    98 MB pull is 11 lines, as pip and huggingface_hub keep theirs short.
    """

    PIPED_INTERVAL = 5.0

    def __init__(self, stream=None, *, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self._last_draw = 0.0
        self._deciles: dict[str, int] = {}  # per task: the highest 10% step printed (interleaved tasks never repeat one)
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._open = False

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        frac = p.fraction
        finished = frac is not None and frac >= 1.0
        if self._tty:
            if not finished and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            self.stream.write("\r\033[K" + self._line(p))
            self._open = True
            if finished:
                self.stream.write("\n")
                self._open = False
            self.stream.flush()
            return
        if frac is None:  # no total: a heartbeat, not a line per update
            if p.task in self._deciles and now - self._last_draw < self.PIPED_INTERVAL:
                return
            self._deciles[p.task] = -1
        else:
            decile = min(10, int(frac * 10))
            if decile <= self._deciles.get(p.task, -1):
                return
            self._deciles[p.task] = decile
        self._last_draw = now
        self.stream.write(self._line(p) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    def _line(self, p: Progress) -> str:
        frac = p.fraction
        parts = [p.task]
        if frac is not None:
            filled = int(frac * self.width)
            parts.append("[" + "#" * filled + "-" * (self.width - filled) + f"] {frac * 100:5.1f}%")
        if p.total:
            parts.append(f"{format_amount(p.done, p.unit)}/{format_amount(p.total, p.unit)}")
        elif p.done:
            parts.append(format_amount(p.done, p.unit))
        if p.rate:
            parts.append(f"{format_amount(p.rate, p.unit)}/s" if p.unit == "B" else f"{p.rate:.1f} {p.unit}/s")
        eta = p.eta_seconds
        if eta is not None and frac is not None and frac < 1:
            parts.append(f"ETA {int(eta) // 60}:{int(eta) % 60:02d}")
        if p.message:
            parts.append(p.message)
        return "  ".join(parts)
