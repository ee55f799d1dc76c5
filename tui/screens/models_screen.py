"""Models: the catalog and the local store side by side; pull, import,
delete, inspect. Every action is one call into edgellm.models (pull, resolve,
store) or edgellm.gguf.reader; reading the store's GGUF headers for the fit
marks and for inspect runs in a worker, never on the UI thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Label
from textual.widgets.data_table import RowDoesNotExist

from edgellm.engine.memory import DEFAULT_CTX, estimate, fit_mark
from edgellm.fsutil import human_size
from edgellm.gguf.reader import GGUFInfo, human_params, read_gguf
from edgellm.models.catalog import CatalogEntry, load_catalog
from edgellm.models.pull import pull
from edgellm.models.resolve import import_file, remove
from edgellm.models.store import ModelRecord, Store
from quant.levels import level_estimate
from tui.screens.base import REFRESH, BaseScreen
from tui.widgets.jobbar import JobBar
from tui.widgets.modals import AskModal, ReportModal
from tui.widgets.tables import cursor_key, fill

log = logging.getLogger(__name__)


class ModelsScreen(BaseScreen):
    MODE = "models"
    BINDINGS = [
        Binding("p", "pull", "Pull"),
        Binding("P", "pull_ref", "Pull ref…", show=False),
        Binding("i", "import", "Import"),
        Binding("d,delete", "delete", "Delete"),
        Binding("v", "inspect", "Inspect"),
        Binding("escape", "cancel", "Cancel job"),
        REFRESH,
    ]

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        with Horizontal(id="models-panes"):
            with Vertical(classes="pane"):
                yield Label("Catalog  [dim](p pull · P pull a ref)[/]", classes="pane-title")
                yield DataTable(id="catalog", cursor_type="row", zebra_stripes=True)
            with Vertical(classes="pane"):
                yield Label("Local store  [dim](v inspect · d delete · i import)[/]", classes="pane-title")
                yield DataTable(id="store", cursor_type="row", zebra_stripes=True)
        yield Label("", id="ram-line")
        yield JobBar(id="models-job")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        cat = self.query_one("#catalog", DataTable)
        cat.add_columns("Model", "Fit", "Level", "Size", "Params")
        st = self.query_one("#store", DataTable)
        st.add_columns("Name", "Fit", "Level", "Size", "Source", "Parent")
        self.refresh_tables()
        self.query_one("#catalog", DataTable).focus()

    def reload(self) -> None:
        self.refresh_tables()

    # -- tables ------------------------------------------------------------

    def refresh_tables(self) -> None:
        ram = self.app.ram_bytes
        self.query_one("#ram-line", Label).update(
            f"[dim]Fit: RAM needed at ctx {DEFAULT_CTX} vs {human_size(ram)} available: ✓ under 80% · ~ tight · ✗ too big · ? unreadable[/]"
        )
        self.in_background("model list", lambda: _load_tables(ram), self._fill_tables, group="tables")

    def _fill_tables(self, tables: Tables) -> None:
        for e in tables.errors:
            self.notify_error(e, "models")
        cat = self.query_one("#catalog", DataTable)
        keep = self._selected("#catalog")
        fill(
            cat,
            [
                ((Text(e.name + (" *" if e.default else "")), mark, e.default_level, size, human_params(e.parameters)), e.name)
                for e, mark, size in tables.catalog
            ],
        )
        _restore(cat, keep)
        st = self.query_one("#store", DataTable)
        keep = self._selected("#store")
        rows = [
            (
                (r.name, mark, r.level, human_size(r.size_bytes), r.source.split(":", 1)[0] if r.source else "", r.parent or ""),
                r.name,
            )
            for r, mark in tables.store
        ]
        fill(st, rows or [((Text("(empty: pull or import a model)", style="dim"), "", "", "", "", ""), "")])
        _restore(st, keep)

    def _selected(self, table_id: str) -> str:
        return cursor_key(self.query_one(table_id, DataTable))

    # -- pull --------------------------------------------------------------

    def action_pull(self) -> None:
        ref = self._selected("#catalog")
        if ref:
            self.start_pull(ref)

    def action_pull_ref(self) -> None:
        def go(v):
            if v and v.get("ref"):
                self.start_pull(v["ref"])

        self.app.push_screen(
            AskModal("Pull a model", [("ref", "Catalog NAME[:LEVEL] or Hub repo", "smollm2-135m-instruct:q8_0")], ok="Pull"), go
        )

    def start_pull(self, ref: str) -> None:
        if not self.busy("a job is already running here"):
            self._pull(ref, self.start_job(f"pull {ref}"))

    @work(thread=True, group="models-job")
    def _pull(self, ref: str, token) -> None:
        ok, out = self.run_job(f"pull {ref}", pull, ref, token=token)
        self.ui(self._done, f"pulled {out.name}" if ok else _failed("pull", token), ok, "" if ok or token.cancelled else out)

    # -- import ------------------------------------------------------------

    def action_import(self) -> None:
        def go(v):
            if v and v.get("path"):
                self.start_import(v["path"], v.get("name") or None)

        self.app.push_screen(
            AskModal(
                "Import a GGUF file",
                [
                    ("path", "Path to a .gguf file", "/path/to/model.gguf"),
                    ("name", "Name in the store (optional)", "derived from the file name"),
                ],
                ok="Import",
            ),
            go,
        )

    def start_import(self, path: str, name: str | None = None) -> None:
        if not self.busy("a job is already running here"):
            self._import(path, name, self.start_job(f"import {Path(path).name}"))

    @work(thread=True, group="models-job")
    def _import(self, path: str, name, token) -> None:
        ok, out = self.run_job(f"import {Path(path).name}", import_file, path, name=name, token=token)
        self.ui(self._done, f"imported {out.name}" if ok else _failed("import", token), ok, "" if ok or token.cancelled else out)

    # -- shared job plumbing -----------------------------------------------

    def _done(self, text: str, ok: bool, reason: str) -> None:
        self.query_one(JobBar).finish(text, complete=ok, reason=reason)
        self.token = None
        if ok:
            self.notify(text)
        self.refresh_tables()

    # -- delete / inspect ---------------------------------------------------

    def action_delete(self) -> None:
        name = self._selected("#store")
        if not name:
            self.notify("select a model in the local store first", severity="warning")
            return
        self.confirm_delete(
            f"Delete '{name}' and its files from the store?", lambda: remove(name), f"deleted {name}", self.refresh_tables
        )

    @on(DataTable.RowSelected, "#store")
    def _store_row(self, _event: DataTable.RowSelected) -> None:
        self.action_inspect()

    @on(DataTable.RowSelected, "#catalog")
    def _catalog_row(self, event: DataTable.RowSelected) -> None:
        e = load_catalog().find(str(event.row_key.value or ""))
        if e is None:
            return
        body = "\n".join(
            [
                f"{e.display}  ({e.license})",
                e.description,
                "",
                f"repo            {e.repo}",
                f"architecture    {e.architecture}",
                f"parameters      {e.parameters:,}",
                f"context length  {e.context_length:,}",
                f"levels          {', '.join(e.levels)}  (default {e.default_level})",
                "",
                "p pulls the default level; P pulls NAME:LEVEL.",
            ]
        )
        self.app.push_screen(ReportModal(e.name, body))

    def action_inspect(self) -> None:
        name = self._selected("#store")
        if name:
            self.in_background(
                f"inspect {name}",
                lambda: _inspect(name),
                lambda body: self.app.push_screen(ReportModal(name, body)),
                group="inspect",
            )


def _failed(what: str, token) -> str:
    return f"{what} cancelled" if token.cancelled else f"{what} failed"


def _restore(table: DataTable, key: str) -> None:
    """Put the cursor back on the row it was on before a refresh."""
    if key:
        try:
            table.move_cursor(row=table.get_row_index(key))
        except RowDoesNotExist:  # that row is gone (deleted): the cursor stays on the first
            pass


@dataclass
class Tables:
    catalog: list[tuple[CatalogEntry, str, str]]  # entry, fit mark, size text
    store: list[tuple[ModelRecord, str]]  # record, fit mark
    errors: list[Exception]


def _load_tables(ram: int) -> Tables:
    """Both tables' rows with their fit marks (worker thread: it reads every
    stored GGUF's header). The marks are the core's one RAM estimate, as in
    `edgellm models list` and the load guard."""
    out = Tables([], [], [])
    try:
        entries = load_catalog().entries
    except Exception as e:
        out.errors.append(e)
        entries = []
    for entry in entries:
        est = level_estimate(entry.parameters, entry.default_level)  # not downloaded: from the level's bits per weight
        if entry.package and entry.package.level == entry.default_level:
            size = human_size(entry.package.size_bytes)
        else:
            size = "~" + human_size(est.weights_bytes)
        out.catalog.append((entry, fit_mark(est.total_bytes, ram), size))
    try:
        records = Store().list()
    except Exception as e:
        out.errors.append(e)
        records = []
    for r in records:
        try:
            mark = fit_mark(estimate(read_gguf(r.path, check=False), ctx=DEFAULT_CTX).total_bytes, ram)
        except Exception:  # a missing or broken file shows as unknown, not as an error
            mark = "?"
        out.store.append((r, mark))
    return out


def _inspect(name: str) -> str:
    """The inspect dialog's text: the record and its GGUF header (worker thread)."""
    store = Store()
    rec = store.get(name)
    info: GGUFInfo = read_gguf(rec.path)
    types = ", ".join(f"{k} {v}" for k, v in sorted(info.tensor_types.items(), key=lambda kv: -kv[1]))
    children = ", ".join(c.name for c in store.children(name)) or "-"
    return "\n".join(
        [
            f"file            {rec.path}",
            f"size            {human_size(info.size_bytes)}  ({info.bpw:.2f} bits/weight)",
            f"level           {info.level}",
            f"architecture    {info.architecture}  ({human_params(info.parameters)} parameters)",
            f"layers          {info.block_count} x {info.embedding_length} wide, {info.head_count} heads ({info.head_count_kv} KV)",
            f"context length  {info.context_length:,}",
            f"vocabulary      {info.vocab_size:,}",
            f"tensors         {info.tensor_count}: {types}",
            f"RAM             {estimate(info, ctx=DEFAULT_CTX).describe()}",
            f"chat template   {'yes' if info.has_chat_template else 'no'}",
            f"source          {rec.source or '-'}",
            f"parent          {rec.parent or '-'}",
            f"children        {children}",
            f"sha256          {rec.sha256}",
        ]
    )
