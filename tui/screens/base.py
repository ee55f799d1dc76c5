"""What every screen shares: the nav bar, and running a core job in a thread.

`run_guarded()` is the one place where a job's failure becomes a
notification: an EdgeLLMError shows its own one-line message, a missing core
module says the capability is not available yet, anything else becomes one
`internal error` line. No traceback ever reaches the screen.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer

from edgellm.errors import Cancelled, EdgeLLMError
from edgellm.progress import CancelToken, Progress, ProgressCallback

from tui.widgets.nav import NavBar

log = logging.getLogger(__name__)


class NotAvailable(Exception):
    """A core capability this build does not have yet."""


def core(module: str, name: str) -> Any:
    """Import `module.name` lazily; NotAvailable when it is not there (yet)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise NotAvailable(f"{module} is not available in this build yet ({e})") from None
    try:
        return getattr(mod, name)
    except AttributeError:
        raise NotAvailable(f"{module}.{name} is not available in this build yet") from None


def call_with_supported(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Call `fn`, dropping keyword options its signature does not take.

    The TUI offers options (allow requantize, threads...) that a core function
    may or may not have; passing only the ones it declares keeps the screens
    working across versions of the core."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args, **kw)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kw)
    return fn(*args, **{k: v for k, v in kw.items() if k in params})


def one_line(e: BaseException) -> str:
    if isinstance(e, (EdgeLLMError, NotAvailable)):
        return str(e)
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"internal error: {type(e).__name__}: {msg}"


class BaseScreen(Screen):
    """A screen with the nav bar on top and the footer of bindings below."""

    MODE = ""

    def compose_nav(self) -> ComposeResult:
        yield NavBar(self.MODE, id="nav")

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
        """Call a core function in the worker thread; report failure as a notification.

        Returns (ok, result)."""
        try:
            return True, fn(*args, **kw)
        except Cancelled:
            self.ui(self.notify, f"{what}: cancelled", severity="warning")
        except (EdgeLLMError, NotAvailable) as e:
            self.ui(self.notify, one_line(e), title=what, severity="error", timeout=8)
        except Exception as e:  # never a traceback on screen
            log.debug("%s failed", what, exc_info=True)
            self.ui(self.notify, one_line(e), title=what, severity="error", timeout=8)
        finally:
            if token is not None:
                self.app.release_token(token)
        return False, None

    def notify_error(self, e: BaseException, title: str = "") -> None:
        self.notify(one_line(e), title=title, severity="error", timeout=8)

    def show_saved(self, module: str, loader: str) -> None:
        """Show the results a core module saved earlier (bench, evaluate), if any."""
        try:
            saved = core(module, loader)()
        except NotAvailable:
            return
        except Exception as e:
            self.notify_error(e, "saved results")
            return
        if saved:
            self.show_results(saved)  # type: ignore[attr-defined]


# -- the fits-in-RAM mark --------------------------------------------------------

DEFAULT_CTX = 2048


def level_bpw(level: str) -> float:
    """Nominal bits per weight of a whole file at `level` (quant.levels' table),
    for catalog entries not yet on disk."""
    from quant.levels import LEVELS

    for lv in LEVELS:
        if lv.name.lower() == level.lower():
            return lv.bpw
    return 5.0


def ram_needed(weights_bytes: int, kv_bytes: int = 0) -> int:
    """The core's estimate (weights + KV cache + buffers): the same rule the
    RAM guard applies when a model loads."""
    from edgellm.engine.hardware import estimate_ram

    return estimate_ram(weights_bytes, kv_bytes).needed_bytes


def fits_mark(need: int, ram: int) -> str:
    if not need:
        return "?"
    if need <= ram * 0.8:
        return "✓"
    return "~" if need <= ram else "✗"


def selected_value(select) -> str:
    """A Select's value as a string, or "" when nothing is picked."""
    v = select.value
    return v if isinstance(v, str) else ""
