"""System: the doctor report (versions, CPU features vs the build, GPU, RAM,
disk, and the subprocess self-test), run in a worker: the self-test takes a
few seconds. Below it the GPU devices llama.cpp could offload to, and the
RPC workers configured for this session (the app's `rpc_workers`, which
Chat and Bench use) with the state each was found in when probed."""

from __future__ import annotations

import logging

from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Button, DataTable, Input, Label, Static

from edgellm.engine.gpu import device_lines
from edgellm.engine.hardware import doctor
from edgellm.engine.rpc import local_version, parse_endpoints, probe
from edgellm.errors import ModelNotFound
from edgellm.fsutil import human_size
from edgellm.models.catalog import load_catalog
from edgellm.models.resolve import resolve
from tui.screens.base import BaseScreen, one_line
from tui.widgets.fields import steady_cursors
from tui.widgets.tables import fill

log = logging.getLogger(__name__)


class SystemScreen(BaseScreen):
    MODE = "system"
    BINDINGS = [
        Binding("r", "doctor", "Run doctor"),
        Binding("s", "doctor(False)", "Doctor w/o self-test"),
        Binding("d", "devices", "GPU devices"),
        Binding("p", "probe", "Probe workers"),
    ]
    BUTTONS = {"rpc-probe": "probe"}
    DEFAULT_CSS = """
    #rpc-form { height: 3; }
    #rpc-form Label { width: auto; padding: 1 1 0 0; text-style: bold; }
    #rpc-form Input { width: 1fr; }
    #rpc-form Button { width: auto; min-width: 10; }
    #rpc-table { height: auto; max-height: 10; }
    #gpu-devices { padding: 0 0 1 0; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.running = False
        self.report = None

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        yield Label("System check  [dim](r runs the doctor with the self-test; s without)[/]", classes="pane-title")
        with VerticalScroll(id="doctor-scroll"):
            yield Static("Press r to run the doctor.", id="doctor-report")
            yield Label("GPU devices  [dim](d lists them again)[/]", classes="pane-title")
            yield Static("Press d to list the GPU devices.", id="gpu-devices", markup=False)
            yield Label("RPC workers  [dim](Chat and Bench use them when asked; p probes them)[/]", classes="pane-title")
            with Horizontal(id="rpc-form"):
                yield Label("Workers (HOST:PORT,...)")
                yield Input(self.app.rpc_workers, placeholder="e.g. 127.0.0.1:50052,192.168.1.20:50052", id="rpc-workers")
                yield Button("Probe (p)", id="rpc-probe")
            yield DataTable(id="rpc-table", cursor_type="row")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        steady_cursors(self)
        self.query_one("#rpc-table", DataTable).add_columns("Worker", "State", "Protocol", "Memory offered")
        if self.app.autorun:
            self.action_doctor()
            self.action_devices()
            if self.app.rpc_workers:
                self.action_probe()

    # -- GPU devices ---------------------------------------------------------

    def action_devices(self) -> None:
        self.query_one("#gpu-devices", Static).update("Listing the GPU devices...")
        self._devices()

    @work(thread=True, group="gpu-devices", exclusive=True)
    def _devices(self) -> None:
        # the first device query loads llama.cpp and starts its GPU backends: seconds, so off the UI thread

        ok, out = self.run_guarded("GPU devices", device_lines)
        self.ui(self.query_one("#gpu-devices", Static).update, "\n".join(out) if ok else f"could not list the devices: {out}")

    # -- RPC workers ---------------------------------------------------------

    @on(Input.Submitted, "#rpc-workers")
    def _workers_submitted(self, _e: Input.Submitted) -> None:
        self.action_probe()
        # out of the text field, so the screen's keys (r, s, d, p) act again
        self.query_one("#rpc-table", DataTable).focus()

    def action_probe(self) -> None:
        """Keep the list for Chat and Bench, then probe each worker in a thread (up to seconds each)."""

        text = self.query_one("#rpc-workers", Input).value.strip()
        table = self.query_one("#rpc-table", DataTable)
        if not text:
            self.app.rpc_workers = ""
            fill(table, [])
            self.notify("no RPC workers configured", severity="warning")
            return
        try:
            eps = parse_endpoints(text)
        except Exception as e:  # a malformed address: its one line, and the list stays as it was
            self.notify_error(e, "RPC workers")
            return
        self.app.rpc_workers = ",".join(str(ep) for ep in eps)
        fill(table, [((str(ep), "probing...", "", ""), str(ep)) for ep in eps])
        self._probe(eps)

    @work(thread=True, group="rpc-probe", exclusive=True)
    def _probe(self, eps) -> None:
        try:
            local = local_version()
        except Exception as e:
            rows = [((str(ep), one_line(e), "", ""), str(ep)) for ep in eps]
            self.ui(fill, self.query_one("#rpc-table", DataTable), rows)
            return
        rows = []
        for ep in eps:
            try:
                w = probe(ep, timeout=3.0, local=local)
            except Exception as e:  # unreachable, another protocol, not a worker: the core's one line
                why = one_line(e)
                rows.append(((str(ep), why.removeprefix(f"RPC worker {ep}: "), "", ""), str(ep)))
                continue
            mem = ", ".join(f"{human_size(f)} of {human_size(t)}" for f, t in w.devices)
            rows.append(((str(ep), "reachable", ".".join(map(str, w.version)), mem), str(ep)))
        self.ui(fill, self.query_one("#rpc-table", DataTable), rows)

    def action_doctor(self, self_test: bool = True) -> None:
        if self.running:
            self.notify("the doctor is already running", severity="warning")
            return
        self.running = True
        self.query_one("#doctor-report", Static).update(
            "Running the doctor" + (" and the self-test (a few seconds)..." if self_test else "...")
        )
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
        t.add_row(
            "self-test", Text(f"passed: {st.tokens} tokens at {st.tokens_per_second:.1f} tok/s ({st.text!r})", style="green")
        )
    elif st.message == "skipped":
        t.add_row("self-test", Text("skipped", style="dim"))
    else:
        t.add_row("self-test", Text(f"FAILED: {st.message}", style="bold red"))
    for w in rep.warnings:
        t.add_row("warning", Text(w, style="yellow"))
    t.add_row(
        "verdict",
        Text("OK", style="bold green")
        if rep.ok
        else Text("problems found" if st.message != "skipped" else "self-test not run", style="bold yellow"),
    )
    return t
