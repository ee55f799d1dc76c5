"""The edgellm Textual app: six screens over the core API, switched by F1-F6.

The app holds no model logic. Each screen parses what the user picked, starts
one core call in a thread worker, and renders the progress events and the
result. What lives here: the global bindings (the screen table is tui.modes),
the screens, and `run_tui()`, which keeps llama.cpp's stderr off the terminal.
The state screens read (the settings a test pins, the cancel tokens stopped on
quit) is tui.state's `AppState`, which this app extends.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from textual.binding import Binding

from edgellm import paths
from tui.modes import QUIT_KEY, SCREENS
from tui.screens.bench_screen import BenchScreen
from tui.screens.chat_screen import ChatScreen
from tui.screens.models_screen import ModelsScreen
from tui.screens.quantize_screen import QuantizeScreen
from tui.screens.system_screen import SystemScreen
from tui.state import AppState

log = logging.getLogger(__name__)


def _mode_factories() -> dict[str, Any]:
    from tui.screens.evaluate_screen import EvaluateScreen  # lazy: loads numpy

    return {
        "models": ModelsScreen,
        "quantize": QuantizeScreen,
        "evaluate": EvaluateScreen,
        "chat": ChatScreen,
        "bench": BenchScreen,
        "system": SystemScreen,
    }


class EdgeApp(AppState):
    """The TUI. Build it with `make_app()` so tests and the CLI get the same app."""

    CSS_PATH = "edgellm.tcss"
    TITLE = "edgellm"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        # Shown in every screen's nav bar rather than the footer, which holds the screen's own keys.
        Binding(QUIT_KEY, "quit", "Quit", show=False, priority=True),
        # priority: they act before a focused text field sees the key
        *[Binding(m.key, f"switch_mode('{m.name}')", m.label, show=False, priority=True) for m in SCREENS],
    ]

    def __init__(
        self,
        *,
        initial: str = "models",
        ram_bytes: Optional[int] = None,
        autorun: bool = True,
        stable: bool = False,
        driver_class: Any = None,
    ) -> None:
        super().__init__(ram_bytes=ram_bytes, autorun=autorun, stable=stable, driver_class=driver_class)
        self.initial = initial

    # -- lifecycle ---------------------------------------------------------

    def on_mount(self) -> None:
        for mode, factory in _mode_factories().items():
            self.add_mode(mode, factory)
        self.switch_mode(self.initial if self.initial in {m.name for m in SCREENS} else "models")

    async def action_switch_mode(self, mode: str) -> None:
        if mode == self.current_mode:
            return
        await self.switch_mode(mode)

    async def action_quit(self) -> None:
        self.cancel_all("quitting")
        self.exit()

    def on_unmount(self) -> None:
        self.cancel_all("quitting")


def make_app(**kw: Any) -> EdgeApp:
    """The app the CLI runs and the tests drive (`make_app(initial="chat")`)."""
    return EdgeApp(**kw)


# -- running in a real terminal -----------------------------------------------


def _terminal_driver(term_file):
    """A driver that draws on `term_file` instead of fd 2, so fd 2 can go to a log."""
    from textual.drivers.linux_driver import LinuxDriver  # textual only in the TUI

    class TerminalDriver(LinuxDriver):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self._file = term_file

    return TerminalDriver


def run_tui(**kw: Any) -> int:
    """Run the app in this terminal with llama.cpp's stderr kept off the screen.

    llama.cpp (and llama-cpp-python's own stderr suppression, which dup2()s fd
    2 around model loads) write to fd 2, which is where Textual draws. So the
    app draws on a duplicate of the terminal's fd and fd 2 points at a log
    file under EDGELLM_HOME for the whole session.
    """

    term_file = None
    saved_fd = None
    if os.name == "posix" and sys.__stderr__ is not None and sys.__stderr__.isatty():
        try:
            log_dir = paths.ensure(paths.home() / "logs")
            log_path = Path(log_dir) / "tui-stderr.log"
            sys.__stderr__.flush()
            saved_fd = os.dup(2)
            term_file = os.fdopen(os.dup(saved_fd), "w", encoding="utf-8", errors="replace")
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log_fd, 2)
            os.close(log_fd)
            kw["driver_class"] = _terminal_driver(term_file)
        except OSError as e:  # keep going with the plain driver rather than not at all
            log.debug("stderr redirect failed: %s", e)
    app = make_app(**kw)
    try:
        app.run()
    finally:
        if saved_fd is not None:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
        if term_file is not None:
            try:
                term_file.close()
            except OSError:
                pass
    return app.return_code or 0
