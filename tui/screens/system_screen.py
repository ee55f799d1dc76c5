"""System: the doctor report (versions, CPU features vs the build, GPU, RAM,
disk, and the subprocess self-test), run in a worker: the self-test takes a
few seconds."""

from __future__ import annotations

import logging

from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Label, Static

from edgellm.engine.hardware import doctor
from edgellm.errors import ModelNotFound
from edgellm.fsutil import human_size
from edgellm.models.catalog import load_catalog
from edgellm.models.resolve import resolve

from tui.screens.base import BaseScreen

log = logging.getLogger(__name__)


class SystemScreen(BaseScreen):
    MODE = "system"
    BINDINGS = [Binding("r", "doctor", "Run doctor"), Binding("s", "doctor(False)", "Doctor w/o self-test")]

    def __init__(self) -> None:
        super().__init__()
        self.running = False
        self.report = None

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        yield Label("System check  [dim](r runs the doctor with the self-test; s without)[/]", classes="pane-title")
        with VerticalScroll(id="doctor-scroll"):
            yield Static("Press r to run the doctor.", id="doctor-report")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        if self.app.autorun:
            self.action_doctor()

    def action_doctor(self, self_test: bool = True) -> None:
        if self.running:
            self.notify("the doctor is already running", severity="warning")
            return
        self.running = True
        self.query_one("#doctor-report", Static).update("Running the doctor" + (" and the self-test (a few seconds)..." if self_test else "..."))
        self._doctor(self_test)

    @work(thread=True, group="doctor", exclusive=True)
    def _doctor(self, self_test: bool) -> None:
        def call():
            try:
                path = resolve(load_catalog().default.name).path
            except ModelNotFound:
                path = None
            return doctor(model_path=path, run_self_test=self_test)

        ok, out = self.run_guarded("doctor", call)
        self.ui(self._show, out if ok else None, "" if ok else out)

    def _show(self, rep, reason: str = "") -> None:
        self.running = False
        if rep is None:
            self.query_one("#doctor-report", Static).update(Text(f"The doctor failed: {reason}\nPress r to retry."))
            return
        self.report = rep
        self.query_one("#doctor-report", Static).update(render_report(rep))
        if rep.ok:
            self.notify("doctor: all checks passed")
        elif rep.self_test.message != "skipped":
            self.notify(f"doctor: {rep.self_test.message or 'the build does not match this CPU'}", severity="error", timeout=10)


def render_report(rep) -> Table:
    t = Table(show_header=False, box=None, pad_edge=False, expand=True)
    t.add_column(style="bold", no_wrap=True, width=18)
    t.add_column(overflow="fold")
    st = rep.self_test
    gpu = rep.gpu or {}
    t.add_row("python", f"{rep.python} on {rep.platform}")
    t.add_row("llama-cpp-python", rep.llama_cpp_python)
    t.add_row("cpu", rep.cpu)
    t.add_row("cpu features", " ".join(rep.cpu_features) or "-")
    t.add_row("compiled in", " ".join(rep.compiled_features) or "-")
    t.add_row("gpu backends", ", ".join(gpu.get("backends") or []) or "none (CPU-only build)")
    for d in gpu.get("devices", []):
        t.add_row("  device", f"{d.get('name')}: {d.get('description')}")
    t.add_row("ram", f"{human_size(rep.ram_total_bytes)} total, {human_size(rep.ram_available_bytes)} available")
    t.add_row("store", f"{rep.home} ({human_size(rep.disk_free_bytes)} free)")
    if st.ok:
        t.add_row("self-test", Text(f"passed: {st.tokens} tokens at {st.tokens_per_second:.1f} tok/s ({st.text!r})", style="green"))
    elif st.message == "skipped":
        t.add_row("self-test", Text("skipped", style="dim"))
    else:
        t.add_row("self-test", Text(f"FAILED: {st.message}", style="bold red"))
    for w in rep.warnings:
        t.add_row("warning", Text(w, style="yellow"))
    t.add_row("verdict", Text("OK", style="bold green") if rep.ok else Text("problems found" if st.message != "skipped" else "self-test not run", style="bold yellow"))
    return t
