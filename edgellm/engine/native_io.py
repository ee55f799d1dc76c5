"""Native stderr: capture what llama.cpp prints (grammar errors), or silence it (model loading).

C code writes to file descriptor 2 directly, past Python's `sys.stderr`, so
these swap the descriptor itself.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Iterator


class _Captured:
    text = ""


@contextlib.contextmanager
def capture_native_stderr() -> Iterator[_Captured]:
    """Capture what C code writes to fd 2 (Python's own sys.stderr is untouched)."""
    cap = _Captured()
    try:
        sys.stderr.flush()
    except Exception:
        pass
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            try:
                yield cap
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        tmp.seek(0)
        cap.text = tmp.read().decode("utf-8", "replace")


@contextlib.contextmanager
def silence_native_stderr(*, enabled: bool = True) -> Iterator[None]:
    """Send llama.cpp's and ggml's stderr chatter to /dev/null, keep Python's sys.stderr working.

    When sys.stderr is the process's fd 2 it is rebound to a duplicate of the
    real stderr for the duration, so warnings still reach the user.
    """
    if not enabled:
        yield
        return
    try:
        sys.stderr.flush()
        uses_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, ValueError, io.UnsupportedOperation):
        uses_fd2 = False
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    old_stderr = sys.stderr
    replacement = None
    try:
        if uses_fd2:
            replacement = io.TextIOWrapper(
                io.FileIO(os.dup(saved), "w"),
                encoding=getattr(old_stderr, "encoding", None) or "utf-8",
                errors="replace",
                line_buffering=True,
            )
            sys.stderr = replacement
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
        if replacement is not None:
            sys.stderr = old_stderr
            with contextlib.suppress(Exception):
                replacement.close()


__all__ = ["capture_native_stderr", "silence_native_stderr"]
