"""The parent's side of quant/_quantize_worker.py: worker processes, their
output lines, and what llama.cpp's log says about a level.

quant/quantize.py schedules levels onto these workers; each worker runs one
llama_model_quantize call at a time and its lines arrive on a queue shared by
all workers as (worker, line), None when the process ends.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import signal as _signal
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from edgellm.errors import BackendCrash, QuantizeError

if TYPE_CHECKING:  # annotations only: prestart() runs before the command imports these
    from quant._common import OutputPlan
    from quant.levels import Level

_TENSOR_RE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
_FALLBACK_RE = re.compile(
    r"warning:\s+(\S+)\s+- ncols\s+(\d+) not divisible by\s+(\d+) \(required for type\s+(\S+)\).*?-> falling back to\s+(\S+)"
)
_N_FALLBACK_RE = re.compile(r"WARNING: (\d+) of (\d+) tensor\(s\) required fallback")
_FAILED_RE = re.compile(r"failed to quantize: (.*)")
_WORKER = "quant._quantize_worker"


@dataclass
class Run:
    """What the worker reported about one llama_model_quantize call."""

    rc: Optional[int] = None
    seconds: float = 0.0
    fallbacks: list[tuple[str, int, int, str, str]] = field(default_factory=list)  # name, ncols, block, from, to
    n_fallback: Optional[int] = None
    error: str = ""
    tail: deque = field(default_factory=lambda: deque(maxlen=40))


@dataclass
class Job:
    """One level on its way through a worker."""

    index: int  # position in the caller's list of levels: results come back in that order
    level: Level
    plan: OutputPlan
    tmp: Path
    threads: int
    t0: float
    run: Run = field(default_factory=Run)
    done: int = 0  # tensors llama.cpp has finished


def worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


_spares: list[Worker] = []


def prestart() -> None:
    """Start one worker now, for the next `Worker.get` to take.

    A worker needs ~0.1 s (Python, llama-cpp-python's bindings, the backend)
    before llama.cpp can start; the CLI calls this as soon as it knows the
    command is `quantize`, so that start-up overlaps the command's imports
    and input checks instead of following them."""
    if not _spares:
        with contextlib.suppress(QuantizeError):
            _spares.append(Worker(queue.Queue(), 0))


def close_spares() -> None:
    """Stop the prestarted workers nobody took."""
    while _spares:
        _spares.pop().close()


atexit.register(close_spares)


class Worker:
    """One worker process (quant/_quantize_worker.py) with its share of the
    threads; it runs one level at a time, as many as it is given. Its output
    lines go to the shared `events` queue as (worker, line), None at EOF."""

    @classmethod
    def get(cls, events: queue.Queue, threads: int) -> Worker:
        """A prestarted worker if there is a live one, else a new one."""
        while _spares:
            w = _spares.pop()
            with w._lock:
                if not w._eof and w.proc.poll() is None:
                    w.events, w.threads = events, threads
                    return w
            w.close()
        return cls(events, threads)

    def __init__(self, events: queue.Queue, threads: int) -> None:
        self.events = events
        self.threads = threads
        self._lock = threading.Lock()  # events may be swapped (get) while the reader runs
        self._eof = False
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", _WORKER, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=worker_env(),
            )
        except OSError as e:
            raise QuantizeError(f"cannot start the quantization worker: {e.strerror or e}") from None
        self.stderr_tail: deque = deque(maxlen=20)
        self.readers = [
            threading.Thread(target=self._pump_stdout, daemon=True),
            threading.Thread(target=self._pump_stderr, daemon=True),
        ]
        for r in self.readers:
            r.start()

    def _pump_stdout(self) -> None:
        for raw in self.proc.stdout:  # type: ignore[union-attr]
            with self._lock:
                self.events.put((self, raw))
        with self._lock:
            self._eof = True
            self.events.put((self, None))

    def _pump_stderr(self) -> None:
        for raw in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr_tail.append(raw.decode("utf-8", "replace").rstrip())

    def submit(self, job: dict[str, Any]) -> None:
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError:
            pass  # it died; its EOF says how

    def close(self) -> None:
        """Stop the worker. Between jobs it holds nothing worth a graceful exit
        (and may still be importing when an early check failed), so it is killed."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        self.kill()
        for r in self.readers:
            r.join(timeout=2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def death(self, job: Job) -> Exception:
        """The error for a worker that ended in the middle of `job`."""
        self.proc.wait()
        rc = self.proc.returncode
        for r in self.readers:
            r.join(timeout=2)
        words = last_words(job.run, self.stderr_tail)
        if rc is not None and rc < 0:
            try:
                sig = _signal.Signals(-rc).name
            except ValueError:
                sig = f"signal {-rc}"
            return BackendCrash(f"llama.cpp died ({sig}) while quantizing to {job.level.key}: {words}")
        return QuantizeError(f"the quantization worker failed (exit {rc}): {words}")


def parse_log(run: Run, line: str) -> Optional[tuple[int, str]]:
    """Note what a llama.cpp log line says; (tensors done, tensor name) for a per-tensor line."""
    run.tail.append(line)
    if m := _FAILED_RE.search(line):  # may share a line with the tensor it failed on
        run.error = m.group(1).strip()
    if m := _TENSOR_RE.match(line):
        return int(m.group(1)), m.group(3)
    if m := _FALLBACK_RE.search(line):
        run.fallbacks.append((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4), m.group(5)))
    elif m := _N_FALLBACK_RE.search(line):
        run.n_fallback = int(m.group(1))
    return None


def last_words(run: Run, stderr_tail: deque) -> str:
    for line in list(run.tail)[::-1] + list(stderr_tail)[::-1]:
        text = line.strip(" =\n")
        if text and not text.startswith("["):
            return text[:300]
    return "no output"


def llama_failure(job: Job, worker: Worker, model: str) -> QuantizeError:
    reason = job.run.error or last_words(job.run, worker.stderr_tail)
    if "iostream error" in reason or "failbit" in reason:
        reason = f"could not write {job.tmp.parent} (disk full or a file size limit?) [{reason}]"
    return QuantizeError(f"llama.cpp could not quantize {model} to {job.level.key}: {reason}")
