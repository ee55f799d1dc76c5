"""Importance matrices, a panel over the Quantize screen (`i`): the stored
matrices, computing one with progress and cancel, deleting one, and the
lineage of one. Each action is one call into quant.imatrix (list_imatrices,
compute_imatrix, delete_imatrix, describe), as `edgellm imatrix` makes it.

A modal screen rather than a seventh tab: matrices only matter to
quantizing, and the panel opens with the base picked there as its model.
It is a BaseScreen too, for the one job plumbing every screen shares
(job bar, cancel token, one-line failures, reads in a worker).
"""

from __future__ import annotations

import time
from typing import Optional

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Label, Select, Static

from edgellm.progress import CancelToken
from quant.imatrix import CALIBRATION_LABEL, DEFAULT_CTX, ImatrixRecord, compute_imatrix, delete_imatrix, describe, list_imatrices
from tui.screens.base import REFRESH, BaseScreen
from tui.widgets.checklist import CheckBox
from tui.widgets.fields import set_choices, steady_cursors
from tui.widgets.jobbar import JobBar
from tui.widgets.tables import cursor_key, fill

CHUNKS_HINT = "all the text holds"  # compute_imatrix's chunks=None, the CLI's default
DETAIL_HINT = "v or Enter: the selected matrix's lineage"


class ImatrixPanel(BaseScreen, ModalScreen[None]):
    MODE = "imatrix"  # names its workers' groups; it is no mode of the nav bar
    BINDINGS = [
        Binding("c", "compute", "Compute"),
        Binding("d,delete", "delete", "Delete"),
        Binding("v", "inspect", "Lineage"),
        REFRESH,
        Binding("escape", "close", "Cancel job / close"),
    ]
    BUTTONS = {"imx-go": "compute"}

    def __init__(self, default_model: str = "") -> None:
        super().__init__()
        self.default_model = default_model
        self.records: dict[str, ImatrixRecord] = {}

    def compose(self) -> ComposeResult:
        with Vertical(id="imx-box"):
            yield Label("Importance matrices  [dim](v lineage · d delete · c compute · Esc close)[/]", classes="pane-title")
            yield DataTable(id="imx-list", cursor_type="row", zebra_stripes=True)
            yield Static(DETAIL_HINT, id="imx-detail", markup=False)
            with Horizontal(classes="form-row"):
                yield Label("Model")
                yield Select([], prompt="(no models)", id="imx-model", allow_blank=True)
                yield Label("Chunks")
                yield Input("", placeholder="all", id="imx-chunks", classes="num")  # blank: CHUNKS_HINT
            with Horizontal(classes="form-row"):
                yield CheckBox("Replace", id="imx-force")  # the CLI's --force: a stored matrix of the same name
                yield Button("Compute (c)", id="imx-go", variant="primary")
                yield Label(f"[dim]on {CALIBRATION_LABEL}, ctx {DEFAULT_CTX}[/]", id="imx-text")
            yield JobBar(id="imx-job")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self.query_one("#imx-list", DataTable).add_columns("Name", "Model", "Text", "Tokens", "Chunks", "Date", "Entries")
        steady_cursors(self)
        self.reload()
        self.query_one("#imx-list", DataTable).focus()

    def reload(self) -> None:
        set_choices(self.query_one("#imx-model", Select), [m.name for m in self.store_models()], self.default_model)
        self.in_background("importance matrices", list_imatrices, self._fill, group="list")

    def _fill(self, records: list[ImatrixRecord]) -> None:
        self.records = {r.name: r for r in records}
        table = self.query_one("#imx-list", DataTable)
        keep = cursor_key(table)
        rows = [(row(r), r.name) for r in records]
        fill(table, rows or [(("(none yet: c computes one)", "", "", "", "", "", ""), "")])
        if keep in self.records:
            table.move_cursor(row=table.get_row_index(keep))

    def _selected(self) -> Optional[ImatrixRecord]:
        rec = self.records.get(cursor_key(self.query_one("#imx-list", DataTable)))
        if rec is None:
            self.notify("select a stored importance matrix first", severity="warning")
        return rec

    # -- compute -------------------------------------------------------------

    def action_compute(self) -> None:
        if self.busy("a matrix is already being computed"):
            return
        model = self.picked("#imx-model", "pick a model first (pull or import one on the Models screen)")
        text = self.query_one("#imx-chunks", Input).value.strip()
        if not model:
            return
        if text and not text.isdigit():
            self.notify(f"Chunks: a whole number, or blank for {CHUNKS_HINT}; not {text!r}", severity="warning")
            return
        force = self.query_one("#imx-force", CheckBox).value
        self._compute(model, int(text) if text else None, force, self.start_job(f"imatrix {model}"))

    @on(Input.Submitted, "#imx-chunks")
    def _chunks_entered(self) -> None:
        self.action_compute()

    @work(thread=True, group="imatrix-job")
    def _compute(self, model: str, chunks: Optional[int], force: bool, token: CancelToken) -> None:
        ok, out = self.run_job(f"imatrix {model}", compute_imatrix, model, chunks=chunks, force=force, token=token)
        self.ui(self._computed, model, ok, out, token.cancelled)

    def _computed(self, model: str, ok: bool, out: object, cancelled: bool) -> None:
        self.end_job(f"imatrix {model}", ok, "" if ok else str(out), cancelled)
        if isinstance(out, ImatrixRecord):
            self.show_lineage(out)
        self.reload()

    def action_close(self) -> None:
        """Escape: cancel the running compute first (as on every screen), close when none runs."""
        if self.token is not None:
            self.action_cancel()
        else:
            self.dismiss(None)

    # -- delete, inspect -------------------------------------------------------

    def action_delete(self) -> None:
        rec = self._selected()
        if rec is None:
            return
        name = rec.name
        self.confirm_delete(
            f"Delete the importance matrix '{name}' (its .gguf and .json)?",
            lambda: delete_imatrix(name),
            f"deleted {name}",
            lambda: self._deleted(name),
        )

    def _deleted(self, name: str) -> None:
        if self.shown == name:
            self.query_one("#imx-detail", Static).update(DETAIL_HINT)
            self.shown = ""
        self.reload()

    @on(DataTable.RowSelected, "#imx-list")
    def _row_selected(self) -> None:
        self.action_inspect()

    def action_inspect(self) -> None:
        rec = self._selected()
        if rec is not None:
            self.show_lineage(rec)

    shown = ""  # the matrix whose lineage the detail pane shows

    def show_lineage(self, rec: ImatrixRecord) -> None:
        self.shown = rec.name
        self.query_one("#imx-detail", Static).update(lineage(rec))


def row(rec: ImatrixRecord) -> tuple[str, ...]:
    """A table row: the fields `edgellm imatrix --list --json` gives, as text."""
    return (
        rec.name,
        rec.model,
        rec.text,
        str(rec.tokens),
        f"{rec.chunks} x {rec.ctx}",
        time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.created)),
        str(rec.entries),
    )


def lineage(rec: ImatrixRecord) -> str:
    """describe()'s lines (the CLI's text) and the two hashes that tie the matrix to its model and text."""
    return "\n".join(
        [
            describe(rec),
            f"  model sha256  {rec.model_sha256}  ({rec.architecture})",
            f"  text sha256   {rec.text_sha256}  ({rec.text_tokens} tokens)",
        ]
    )
