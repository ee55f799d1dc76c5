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
from collections.abc import Callable
from typing import Any, Optional, TypeVar

from textual import getters
from textual.app import ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Button, Footer
from textual.worker import get_current_worker

from edgellm import errors
from edgellm.errors import Cancelled, EdgeLLMError
from edgellm.models.store import ModelRecord, Store
from edgellm.progress import CancelToken, Progress, ProgressCallback
from tui.modes import SCREENS
from tui.state import AppState
from tui.widgets.jobbar import JobBar
from tui.widgets.modals import ConfirmModal
from tui.widgets.nav import NavBar

log = logging.getLogger(__name__)

T = TypeVar("T")

# Keys that several screens bind alike, defined once so they stay alike.
CANCEL = Binding("escape", "cancel", "Cancel")
REFRESH = Binding("r", "refresh", "Refresh")


def one_line(e: BaseException) -> str:
    """A notification's line: an expected failure's own message, else the exception's type and first line."""
    if isinstance(e, EdgeLLMError):
        return str(e)
    return f"internal error: {errors.one_line(e, typed=True)}"


class BaseScreen(Screen):
    """A screen with the nav bar on top and the footer of its own keys below."""

    app = getters.app(AppState)  # the app's state, typed (tui.state)
    MODE = ""
    # The screen's running job where it runs one at a time (None when idle);
    # the app cancels every token it handed out on quit.
    token: Optional[CancelToken] = None
    CANCELLING = "cancelling..."  # the notice when Escape cancels that job
    BUTTONS: dict[str, str] = {}  # {button id: the action it runs}, the action its key runs too

    def compose_nav(self) -> ComposeResult:
        yield NavBar(self.MODE, SCREENS, id="nav")

    def compose_footer(self) -> ComposeResult:
        yield Footer()

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self.reload()

    def reload(self) -> None:
        """Re-read what another screen may have changed meanwhile (the store):
        called each time this screen is shown again, and by its refresh key."""

    def action_refresh(self) -> None:
        self.reload()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        action = self.BUTTONS.get(event.button.id or "")
        if action:
            getattr(self, f"action_{action}")()

    def picked(self, select_id: str, warning: str) -> str:
        """The value picked in a Select; "" with `warning` shown when none is."""
        value = selected_value(self.query_one(select_id))
        if not value:
            self.notify(warning, severity="warning")
        return value

    def confirm_delete(self, question: str, delete: Callable[[], Any], deleted: str, then: Callable[[], None]) -> None:
        """Ask `question`; on yes `delete()`, then say `deleted` and call `then`
        (a failure is shown as its one line, and nothing follows it)."""

        def go(yes: bool | None) -> None:
            if not yes:
                return
            try:
                delete()
            except Exception as e:
                self.notify_error(e, "delete")
                return
            self.notify(deleted)
            then()

        self.app.push_screen(ConfirmModal(question), go)

    def store_models(self) -> list[ModelRecord]:
        """The store's models; none, with the reason on screen, when it cannot be read."""
        try:
            return Store().list()
        except Exception as e:
            self.notify_error(e, "store")
            return []

    # -- the screen's one job ----------------------------------------------

    def busy(self, message: str) -> bool:
        """True, with `message` as a warning, while the screen's job runs."""
        if self.token is None:
            return False
        self.notify(f"{message} (Escape cancels it)", severity="warning")
        return True

    def start_job(self, task: str) -> CancelToken:
        """The new job's cancel token; `task` names it on the job bar."""
        self.token = self.app.new_token()
        self.query_one(JobBar).start(task)
        return self.token

    def job_progress(self, p: Progress) -> None:
        self.query_one(JobBar).update_from(p)

    def end_job(self, what: str, ok: bool, reason: str, cancelled: bool) -> None:
        """`WHAT done|failed|cancelled` on the job bar, a failure's reason kept
        under it, and a notice when it is done."""
        self.token = None
        outcome = "done" if ok else ("cancelled" if cancelled else "failed")
        self.query_one(JobBar).finish(f"{what} {outcome}", complete=ok, reason=reason if outcome == "failed" else "")
        if ok:
            self.notify(f"{what} done")

    def action_cancel(self) -> None:
        if self.token is not None:
            self.token.cancel("cancelled by the user")
            self.notify(self.CANCELLING)

    # -- thread helpers ----------------------------------------------------

    def ui(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run `fn` on the UI thread from a worker; a no-op once the app is gone."""
        try:
            return self.app.call_from_thread(fn, *args, **kw)
        except RuntimeError:  # the app has exited while the job ran
            return None
        except NoMatches:  # the app is closing: the screen's widgets went before the job's last update
            if self.is_mounted and self.app.is_running:
                raise
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

    def run_guarded(
        self, what: str, fn: Callable[..., Any], *args: Any, token: Optional[CancelToken] = None, **kw: Any
    ) -> tuple[bool, Any]:
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

    def run_job(self, what: str, fn: Callable[..., Any], *args: Any, token: CancelToken, **kw: Any) -> tuple[bool, Any]:
        """`run_guarded` for the screen's job: `fn` reports to the job bar and stops when `token` is cancelled."""
        return self.run_guarded(what, fn, *args, on_progress=self.progress_to(self.job_progress), cancel=token, token=token, **kw)

    def notify_error(self, e: BaseException, title: str = "") -> None:
        self.notify(one_line(e), title=title, severity="error", timeout=8)

    def in_background(self, what: str, load: Callable[[], T], show: Callable[[T], object], *, group: str = "load") -> None:
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
