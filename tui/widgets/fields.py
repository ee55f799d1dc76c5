"""What every form shares: a model picker refilled from the store, and text
fields that hold still for a snapshot."""

from __future__ import annotations

from textual.dom import DOMNode
from textual.widgets import Input, Select

from tui.state import AppState


def steady_cursors(node: DOMNode) -> None:
    """No blinking text cursor under `node` in a stable app (snapshot tests,
    screenshots): a blink caught half-way would make two renders differ."""
    app = node.app
    if isinstance(app, AppState) and app.stable:
        for inp in node.query(Input):
            inp.cursor_blink = False


def set_choices(select: Select, names: list[str], default: str = "") -> None:
    """Offer `names`; the pick stays where it was if that name is still offered,
    else goes to `default`, else to the first name."""
    cur = select.value
    select.set_options([(n, n) for n in names])
    if cur in names:
        select.value = cur
    elif names:
        select.value = default if default in names else names[0]
