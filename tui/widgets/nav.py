"""The top bar: which screen this is, and the keys for the others."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class NavBar(Static):
    """`1 Models  2 Quantize ...` with the current screen highlighted."""

    def __init__(self, current: str, **kw) -> None:
        super().__init__(**kw)
        self.current = current

    def render(self) -> Text:
        from tui.app import SCREENS

        out = Text(" edgellm ", style="bold")
        for mode, key, label in SCREENS:
            if mode == self.current:
                out.append(f" {key} {label} ", style="bold reverse")
            else:
                out.append(f" {key}", style="bold dim")
                out.append(f" {label} ")
        return out
