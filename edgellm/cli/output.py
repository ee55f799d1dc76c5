"""What every command shares: JSON output, the progress bar and the
cancel token of a long job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import click

from edgellm.progress import CancelToken, TerminalBar, no_progress


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=_json_default))


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_json"):
        return o.to_json()
    if hasattr(o, "__fspath__"):
        return os.fspath(o)
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


@contextlib.contextmanager
def cancellable() -> Iterator[Any]:
    """A CancelToken that SIGINT/SIGTERM set, so jobs stop cleanly (no partial files).

    A second Ctrl-C falls back to the default handler and interrupts at once.
    """
    token = CancelToken()
    old: dict[int, Any] = {}

    def handler(signum, _frame):
        if token.cancelled:
            signal.signal(signum, old.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        token.cancel("cancelled by " + signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread
            old[sig] = signal.signal(sig, handler)
    try:
        yield token
    finally:
        for signum, h in old.items():
            signal.signal(signum, h)


def progress_bar(enabled: bool = True):
    return TerminalBar() if enabled else no_progress


@contextlib.contextmanager
def running_job(show_progress: bool = True) -> Iterator[tuple[Any, Any]]:
    """(on_progress, cancel token) for one long job: a bar on stderr that is
    always closed, and a token that Ctrl-C/SIGTERM set."""
    bar = progress_bar(show_progress)
    try:
        with cancellable() as token:
            yield bar, token
    finally:
        if hasattr(bar, "close"):
            bar.close()
