"""Modal dialogs: confirm, ask for text, show a report."""

from __future__ import annotations

from typing import Optional

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static


class ConfirmModal(ModalScreen[bool]):
    """Yes/No. Dismisses with True only on an explicit yes."""

    BINDINGS = [Binding("escape", "dismiss(False)", "No"), Binding("y", "dismiss(True)", "Yes"), Binding("n", "dismiss(False)", "No")]

    def __init__(self, question: str, *, yes: str = "Delete") -> None:
        super().__init__()
        self.question = question
        self.yes = yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, classes="dialog-title")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class AskModal(ModalScreen[Optional[dict]]):
    """A few labelled text fields; dismisses with {field: value} or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, fields: list[tuple[str, str, str]], *, ok: str = "OK") -> None:
        """fields: (key, label, placeholder)."""
        super().__init__()
        self.title_text = title
        self.fields = fields
        self.ok = ok

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            for key, label, placeholder in self.fields:
                yield Label(label)
                yield Input(placeholder=placeholder, id=f"ask-{key}")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.ok, variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        if self.app.stable:
            for inp in self.query(Input):
                inp.cursor_blink = False
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


class ReportModal(ModalScreen[None]):
    """A scrollable block of text (a model's details); Escape closes it."""

    BINDINGS = [Binding("escape,q,enter", "dismiss(None)", "Close")]

    def __init__(self, title: str, body) -> None:
        super().__init__()
        self.title_text = title
        self.body = body

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog report"):
            yield Label(self.title_text, classes="dialog-title")
            with VerticalScroll():
                yield Static(self.body, id="report-body")
            yield Button("Close", id="close")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)
