"""Modal dialogs: confirm, ask for text, show a report."""

from __future__ import annotations

from typing import Optional, TypeVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from tui.widgets.fields import steady_cursors

R = TypeVar("R")


class Dialog(ModalScreen[R]):
    """A titled box over the screen; a dialog composes what goes under the title."""

    BOX_CLASSES = "dialog"  # the CSS classes of the box

    def __init__(self, title: str) -> None:
        super().__init__()
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical(classes=self.BOX_CLASSES):
            yield Label(self.title_text, classes="dialog-title")
            yield from self.compose_body()

    def compose_body(self) -> ComposeResult:
        yield from ()


class ConfirmModal(Dialog[bool]):
    """Yes/No. Dismisses with True only on an explicit yes."""

    BINDINGS = [
        Binding("escape", "dismiss(False)", "No"),
        Binding("y", "dismiss(True)", "Yes"),
        Binding("n", "dismiss(False)", "No"),
    ]

    def __init__(self, question: str, *, yes: str = "Delete") -> None:
        super().__init__(question)
        self.yes = yes

    def compose_body(self) -> ComposeResult:
        with Horizontal(classes="dialog-buttons"):
            yield Button(f"{self.yes} (y)", variant="error", id="yes")
            yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class AskModal(Dialog[Optional[dict]]):
    """A few labelled text fields; dismisses with {field: value} or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, fields: list[tuple[str, str, str]], *, ok: str = "OK") -> None:
        """fields: (key, label, placeholder)."""
        super().__init__(title)
        self.fields = fields
        self.ok = ok

    def compose_body(self) -> ComposeResult:
        for key, label, placeholder in self.fields:
            yield Label(label)
            yield Input(placeholder=placeholder, id=f"ask-{key}")
        with Horizontal(classes="dialog-buttons"):
            yield Button(self.ok, variant="primary", id="ok")
            yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        steady_cursors(self)
        self.query(Input).first().focus()

    def _values(self) -> dict:
        return {key: self.query_one(f"#ask-{key}", Input).value.strip() for key, _, _ in self.fields}

    def on_input_submitted(self, event: Input.Submitted) -> None:
        inputs = list(self.query(Input))
        i = inputs.index(event.input)
        if i + 1 < len(inputs):
            inputs[i + 1].focus()
        else:
            self.dismiss(self._values())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self._values() if event.button.id == "ok" else None)


class ReportModal(Dialog[None]):
    """A scrollable block of text (a model's details); Escape closes it."""

    BINDINGS = [Binding("escape,q,enter", "dismiss(None)", "Close")]
    BOX_CLASSES = "dialog report"

    def __init__(self, title: str, body) -> None:
        super().__init__(title)
        self.body = body

    def compose_body(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(self.body, id="report-body")
        yield Button("Close", id="close")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)
