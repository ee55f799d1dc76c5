"""What every screen shares: the nav bar, running a core job in a thread,
and loading slow data (stored GGUFs, saved results) off the UI thread.

`run_guarded()` is the one place where a job's failure becomes a
notification and a one-line reason the screen keeps showing: an
EdgeLLMError gives its own message, anything else one `internal error`
line. No traceback ever reaches the screen.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, TypeVar

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer
from textual.worker import get_current_worker

from edgellm.errors import Cancelled, EdgeLLMError
from edgellm.progress import CancelToken, Progress, ProgressCallback

from tui.modes import SCREENS
from tui.widgets.nav import NavBar

log = logging.getLogger(__name__)

T = TypeVar("T")


def one_line(e: BaseException) -> str:
    if isinstance(e, EdgeLLMError):
        return str(e)
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"internal error: {type(e).__name__}: {msg}"


class BaseScreen(Screen):
    """A screen with the nav bar on top and the footer of its own keys below."""

    MODE = ""

    def compose_nav(self) -> ComposeResult:
        yield NavBar(self.MODE, SCREENS, id="nav")

    def compose_footer(self) -> ComposeResult:
        yield Footer()

    # -- thread helpers ----------------------------------------------------

    def ui(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run `fn` on the UI thread from a worker; a no-op once the app is gone."""
        try:
            return self.app.call_from_thread(fn, *args, **kw)
        except RuntimeError:  # the app has exited while the job ran
            return None

    def progress_to(self, handler: Callable[[Progress], None], *, min_interval: float = 0.05) -> ProgressCallback:
        """A core `on_progress` that forwards events to `handler` on the UI thread,
        at most every `min_interval` seconds (the last event of a job always)."""
        last = [0.0]

        def cb(p: Progress) -> None:
            now = time.monotonic()
            final = p.fraction is not None and p.fraction >= 1.0
            if final or now - last[0] >= min_interval:
                last[0] = now
                self.ui(handler, p)

        return cb

    def run_guarded(self, what: str, fn: Callable[..., Any], *args: Any, token: Optional[CancelToken] = None, **kw: Any) -> tuple[bool, Any]:
        """Call a core function in the worker thread; report a failure as a notification.

        Returns (True, result), or (False, the failure's one-line reason) for
        the screen to keep on show: the notification is gone in seconds."""
        try:
            return True, fn(*args, **kw)
        except Cancelled as e:
            reason = str(e) or "cancelled"
            self.ui(self.notify, f"{what}: {reason}", severity="warning")
        except EdgeLLMError as e:
            reason = one_line(e)
            self.ui(self.notify, reason, title=what, severity="error", timeout=8)
        except Exception as e:  # never a traceback on screen
            log.debug("%s failed", what, exc_info=True)
            reason = one_line(e)
            self.ui(self.notify, reason, title=what, severity="error", timeout=8)
        finally:
            if token is not None:
                self.app.release_token(token)
        return False, reason

    def notify_error(self, e: BaseException, title: str = "") -> None:
        self.notify(one_line(e), title=title, severity="error", timeout=8)

    def in_background(self, what: str, load: Callable[[], T], show: Callable[[T], None], *, group: str = "load") -> None:
        """Run `load` in a thread worker, then `show(result)` on the UI thread.

        For reads that can be slow (parsing every stored GGUF, loading saved
        results): the UI thread never waits on the disk. A newer call in the
        same group supersedes an older one that has not shown yet."""

        def job() -> None:
            try:
                value = load()
            except Exception as e:
                log.debug("%s failed", what, exc_info=True)
                self.ui(self.notify_error, e, what)
                return
            if not get_current_worker().is_cancelled:
                self.ui(show, value)

        self.run_worker(job, thread=True, group=f"{self.MODE}-{group}", exclusive=True, name=what)


def selected_value(select) -> str:
    """A Select's value as a string, or "" when nothing is picked."""
    v = select.value
    return v if isinstance(v, str) else ""
