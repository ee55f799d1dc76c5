"""`edgellm serve --rpc`: a worker that dies must cost one request, not the server.

llama.cpp's RPC client aborts the process when a worker's connection breaks.
The server sets ggml's abort callback to "park" mode (edgellm.engine.rpc_native):
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

import logging
from typing import Any

from edgellm.engine import rpc_native

log = logging.getLogger(__name__)
CODE = "rpc_worker_lost"


def attach(pool: Any, api_error: Any) -> None:
    """Route lost workers to `pool`'s requests; `api_error` is the pool's ApiError (status, message, code)."""
    pool.rpc_lost = None
    pool.rpc_api_error = api_error
    rpc_native.install_abort_handler("park")
    rpc_native.on_worker_lost(lambda msg, lost: _fail_all(pool, msg))


def _error(pool: Any, msg: str) -> Any:
    return pool.rpc_api_error(503, f"{msg}; restart the worker, then edgellm serve", code=CODE)


def check(pool: Any) -> None:
    """Before queueing a request: refuse it (503) if a worker is known lost or its connection is closed."""
    msg = getattr(pool, "rpc_lost", None)
    if msg is None:
        lost = rpc_native.lost_endpoints()
        if lost:
            msg = pool.rpc_lost = f"RPC worker {lost[0]} is gone (its connection is closed)"
            log.error("%s", msg)
    if msg is not None:
        raise _error(pool, msg)


def _fail_all(pool: Any, msg: str) -> None:
    """Called from the parked llama.cpp thread: every running and queued request gets the 503."""
    log.error("%s", msg)
    pool.rpc_lost = msg
    err = _error(pool, msg)
    with pool._cond:
        victims = [(s, j) for s in pool._slots.values() for j in [*s.running, *s.jobs]]
        for s in pool._slots.values():
            s.jobs.clear()
    for slot, job in victims:
        job.emit(("error", err))
        pool._done(slot, job, "error")
