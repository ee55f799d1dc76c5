"""`edgellm serve --rpc`: a worker that dies must cost one request, not the server.

llama.cpp's RPC client aborts the process when a worker's connection breaks.
The server's `LossGuard` (edgellm.engine.rpc_loss, shared with the TUI) sets ggml's abort callback to "park" mode:
the thread that hit the broken connection is parked for good instead of
aborting, and `_fail_all` answers every request of the pool with a 503 JSON
error (`rpc_worker_lost`). The model's decode thread never comes back from
llama.cpp, so from then on `check()` refuses requests at once with the same
503 instead of queueing them behind it: the operator restarts the worker and
then the server. `check()` also reads the workers' connections before each
request, so a worker that died while the server was idle is reported before
any work is queued. docs/rpc.md has the whole story.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Any

from edgellm.engine.rpc_loss import LossGuard

log = logging.getLogger(__name__)
CODE = "rpc_worker_lost"


def attach(pool: Any, api_error: Any) -> None:
    """Route lost workers to `pool`'s requests; `api_error` is the pool's ApiError (status, message, code)."""
    pool.rpc_lost = None
    pool.rpc_api_error = api_error
    # the core's guard (engine.rpc_loss): an abort mid-generation fails every request of the pool
    pool.rpc_loss_guard = LossGuard(on_lost=lambda msg: _fail_all(pool, msg))


def _error(pool: Any, msg: str) -> Any:
    return pool.rpc_api_error(503, f"{msg}; restart the worker, then edgellm serve", code=CODE)


def check(pool: Any) -> None:
    """Before queueing a request: refuse it (503) if a worker is known lost or its connection is closed."""
    msg = getattr(pool, "rpc_lost", None)
    if msg is None:
        msg = pool.rpc_loss_guard.closed()  # died while idle: nothing runs on it, so retire, nothing to fail
        if msg is not None:
            log.error("%s", msg)
            _retire(pool, msg)
    if msg is not None:
        raise _error(pool, msg)


# Models whose workers are gone. Freeing one sends llama.cpp's "free buffer" to a dead
# worker, which aborts (here: parks the freeing thread for good), so they are kept,
# never freed, and the process leaves with os._exit (below) before Python's teardown
# could collect them.
_retired: list[Any] = []


def _retire(pool: Any, msg: str) -> None:
    """Mark the pool lost and take every loaded model out of its hands (see _retired)."""
    with pool._cond:
        if pool.rpc_lost is None:
            atexit.register(_exit_without_teardown)
        pool.rpc_lost = msg
        for s in pool._slots.values():
            if s.runtime is not None:
                _retired.append((s.runtime, s.engine))
                if s.template is not None:
                    s.template.close()  # a Jinja worker process: nothing of llama.cpp's
                s.runtime, s.engine, s.template = None, None, None
            s.thread = None  # a decode thread parked in llama.cpp never ends: shutdown must not wait for it


def _exit_without_teardown() -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001  (closed or broken: nothing more to say)
            pass
    os._exit(0)


def _fail_all(pool: Any, msg: str) -> None:
    """Called from the parked llama.cpp thread: every running and queued request gets the 503."""
    log.error("%s", msg)
    err = _error(pool, msg)
    with pool._cond:
        victims = [(s, j) for s in pool._slots.values() for j in [*s.running, *s.jobs]]
        for s in pool._slots.values():
            s.jobs.clear()
    _retire(pool, msg)
    for slot, job in victims:
        job.emit(("error", err))
        pool._done(slot, job, "error")
