"""Surviving a lost RPC worker: the one guard `edgellm serve --rpc` (serve.rpc_guard) and the TUI's
chat screen share.

llama.cpp's RPC client aborts the whole process when a worker's connection
breaks. A `LossGuard` switches ggml's abort callback to "park" mode
(engine.rpc_native): the thread that hit the broken connection is parked for
good instead of aborting, and the guard records the line that names the worker
and tells its owner. Work that may touch the workers runs through `call()`, on
a daemon thread this thread waits for: a lost worker turns into a
`RuntimeFailure` here, and the parked thread, being a daemon, holds no pool and
keeps no process from leaving. The parked thread's model has layers on the dead
worker: it must be dropped, never freed (freeing talks to that worker again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional, TypeVar

from edgellm.engine import rpc_native
from edgellm.errors import RuntimeFailure

T = TypeVar("T")


class LossGuard:
    """`lost`: the line naming the lost worker, None while every worker is up.

    `on_lost(msg)` is called from the parked llama.cpp thread, when a worker is lost mid-generation;
    `closed()` finds one that died while nothing ran, and leaves what to do to its caller.
    """

    def __init__(self, on_lost: Optional[Callable[[str], None]] = None) -> None:
        self.lost: Optional[str] = None
        self._on_lost = on_lost
        rpc_native.install_abort_handler("park")
        rpc_native.on_worker_lost(lambda msg, _eps: self._report(msg))

    def _report(self, msg: str) -> None:
        self.lost = msg
        if self._on_lost is not None:
            self._on_lost(msg)

    def closed(self) -> Optional[str]:
        """The lost worker's line, reading the workers' connections now when no loss is known yet."""
        if self.lost is None:
            eps = rpc_native.lost_endpoints()
            if eps:
                self.lost = f"RPC worker {eps[0]} is gone (its connection is closed)"
        return self.lost

    def reset(self) -> None:
        """Forget a loss: the next load makes fresh connections (a restarted worker)."""
        self.lost = None

    def call(self, fn: Callable[[], T], *, poll: float = 0.2) -> T:
        """`fn()` on a daemon thread, waited for here; `RuntimeFailure` with the worker's line if one is lost meanwhile."""
        box: list[tuple[bool, Any]] = []

        def target() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # re-raised on the caller's thread
                box.append((False, e))

        t = threading.Thread(target=target, name="rpc-guarded", daemon=True)
        t.start()
        while t.is_alive():
            t.join(poll)
            if self.lost is not None and not box:
                raise RuntimeFailure(self.lost)
        ok, value = box[0]
        if not ok:
            raise value
        return value
