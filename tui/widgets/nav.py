"""The top bar: which screen this is, and the keys for every screen and for quitting."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import Static

from tui.modes import QUIT_KEY, Mode, key_label


class NavBar(Static):
    """`F1 Models  F2 Quantize ... ^q Quit` with the current screen highlighted.

    The keys are the app's priority bindings, so they work from every screen,
    text fields included; this bar is where the user learns them."""

    def __init__(self, current: str, screens: Sequence[Mode], **kw) -> None:
        super().__init__(**kw)
        self.current = current
        self.screens = tuple(screens)

    def render(self) -> Text:
        out = Text()
        for mode in self.screens:
            key = key_label(mode.key)
            if mode.name == self.current:
                out.append(f" {key} {mode.label} ", style="bold reverse")
            else:
                out.append(f" {key}", style="bold")
                out.append(f" {mode.label} ")
        out.append(f"  {key_label(QUIT_KEY)}", style="bold")
        out.append(" Quit")
        # the app's name only where it leaves every key on screen (not at 80 columns)
        title = Text(" edgellm ", style="bold")
        return title + out if title.cell_len + out.cell_len <= self.size.width else out
