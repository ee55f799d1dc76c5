"""What screens and widgets read from the app: the settings a test pins (RAM
figure, autorun, stable), the RPC workers entered this session, the notices
shown, and the cancel tokens that must be stopped on quit.

`tui.app.EdgeApp` is this plus its screens and bindings. Screens and widgets
type their `app` as `AppState` (`app = getters.app(AppState)`), so they reach
this state typed without importing tui.app, which imports them.
"""

from __future__ import annotations

from typing import Any, Optional

from textual.app import App
from textual.notifications import SeverityLevel

from edgellm.engine.memory import available_ram
from edgellm.progress import CancelToken


class AppState(App):
    """The app-wide state; see the module docstring."""

    def __init__(
        self, *, ram_bytes: Optional[int] = None, autorun: bool = True, stable: bool = False, driver_class: Any = None
    ) -> None:
        super().__init__(driver_class=driver_class)
        self._ram_bytes = ram_bytes
        # autorun: screens may start their own slow jobs when first shown (the doctor)
        self.autorun = autorun
        # stable: no cursor blink and no live clocks, for snapshot tests and screenshots
        self.stable = stable
        self.tokens: set[CancelToken] = set()
        self.notices: list[tuple[str, str]] = []
        # RPC workers entered on the System screen (HOST:PORT[,...]), for Chat and Bench this session:
        # the core keeps no list of workers, so neither does the TUI across sessions.
        self.rpc_workers: str = ""

    @property
    def ram_bytes(self) -> int:
        """RAM the fit marks compare against: the core's available-RAM figure,
        the one `edgellm models list` and the load guard use (tests pin it with
        EDGELLM_FAKE_AVAILABLE_RAM, or `ram_bytes=`)."""
        if self._ram_bytes:
            return self._ram_bytes

        return available_ram()

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information", **kw: Any) -> None:
        # Kept as a list too, so tests (and a future log pane) can read what was shown.
        self.notices.append((severity, f"{title}: {message}" if title else str(message)))
        super().notify(message, title=title, severity=severity, **kw)

    def new_token(self) -> CancelToken:
        tok = CancelToken()
        self.tokens.add(tok)
        return tok

    def release_token(self, tok: CancelToken) -> None:
        self.tokens.discard(tok)

    def cancel_all(self, reason: str = "cancelled") -> None:
        # Thread workers cannot be killed; the core jobs stop at their next check.
        for tok in list(self.tokens):
            tok.cancel(reason)
