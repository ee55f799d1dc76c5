"""Bench: run the profiler (edgellm.profile.bench.bench) on a model; pp/tg tokens/s,
the memory split (file-backed weights vs anonymous KV/compute), and a
sparkline of tokens/s over the run."""

from __future__ import annotations

import logging
from typing import Any

from rich.table import Table
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Button, DataTable, Input, Label, Select, Sparkline, Static

from edgellm.fsutil import human_size
from edgellm.progress import Progress

from tui.widgets.jobbar import JobBar
from tui.screens.base import BaseScreen, call_with_supported, core, selected_value
from tui.screens.quantize_screen import _as_dict

log = logging.getLogger(__name__)


class BenchScreen(BaseScreen):
    MODE = "bench"
    BINDINGS = [Binding("g", "run", "Run bench"), Binding("escape", "cancel", "Cancel"), Binding("r", "refresh", "Refresh")]

    def __init__(self) -> None:
        super().__init__()
        self.token = None
        self.samples: list[float] = []

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        with Horizontal(id="bench-form", classes="form-row"):
            yield Select([], prompt="model", id="bench-model", allow_blank=True)
            yield Input("512", placeholder="pp", id="bench-pp", type="integer")
            yield Input("128", placeholder="tg", id="bench-tg", type="integer")
            yield Input("3", placeholder="reps", id="bench-reps", type="integer")
            yield Button("Run (g)", id="bench-go", variant="primary")
        yield JobBar(id="bench-job", idle="no benchmark running")
        with Horizontal(id="bench-body"):
            yield DataTable(id="bench-results", cursor_type="row")
            yield Static("Memory: run a benchmark.", id="bench-mem")
        yield Label("tokens/s of each repetition, in order (pp, then tg)", classes="pane-title")
        yield Sparkline([], id="bench-spark")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        if self.app.stable:
            for inp in self.query(Input):
                inp.cursor_blink = False
        self.query_one("#bench-results", DataTable).add_columns("Model", "Test", "tok/s", "±", "TTFT s", "Load s")
        self.action_refresh()

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self._refresh_models()

    def _refresh_models(self) -> None:
        from edgellm.models.store import Store

        sel = self.query_one("#bench-model", Select)
        try:
            names = [m.name for m in Store().list()]
        except Exception as e:
            self.notify_error(e, "store")
            names = []
        cur = sel.value
        sel.set_options([(n, n) for n in names])
        if cur in names:
            sel.value = cur
        elif names:
            sel.value = names[0]

    def action_refresh(self) -> None:
        self._refresh_models()
        self.show_saved("edgellm.profile.bench", "load_bench_results")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "bench-go":
            self.action_run()

    def action_run(self) -> None:
        if self.token is not None:
            self.notify("a benchmark is already running (Escape cancels it)", severity="warning")
            return
        model = selected_value(self.query_one("#bench-model", Select))
        if not model:
            self.notify("pick a model first", severity="warning")
            return

        def num(id_: str, default: int) -> int:
            v = self.query_one(id_, Input).value.strip()
            return int(v) if v.lstrip("-").isdigit() else default

        pp, tg, reps = num("#bench-pp", 512), num("#bench-tg", 128), num("#bench-reps", 3)
        self.samples = []
        self.query_one(Sparkline).data = []
        self.token = self.app.new_token()
        self.query_one(JobBar).start(f"bench {model}")
        self._bench(str(model), pp, tg, reps, self.token)

    @work(thread=True, group="bench", exclusive=True)
    def _bench(self, model: str, pp: int, tg: int, reps: int, token) -> None:
        def call():
            bench = core("edgellm.profile.bench", "bench")
            return call_with_supported(
                bench, [model], pp=pp, tg=tg, repetitions=reps, on_progress=self.progress_to(self._progress, min_interval=0.1), cancel=token
            )

        ok, res = self.run_guarded(f"bench {model}", call, token=token)
        self.ui(self._done, res if ok else None, ok)

    def _progress(self, p: Progress) -> None:
        self.query_one(JobBar).update_from(p)

    def _done(self, res: Any, ok: bool) -> None:
        self.token = None
        self.query_one(JobBar).finish("benchmark done" if ok else "benchmark failed or cancelled", complete=ok)
        if ok and res is not None:
            self.show_results(res)
            self.notify("benchmark done")

    def action_cancel(self) -> None:
        if self.token is not None:
            self.token.cancel("cancelled by the user")
            self.notify("cancelling the benchmark...")

    def show_results(self, res: Any) -> None:
        rows = res if isinstance(res, (list, tuple)) else (_as_dict(res).get("rows") or [res])
        rows = [_as_dict(r) for r in rows]
        t = self.query_one("#bench-results", DataTable)
        t.clear()
        for d in rows:
            name = str(d.get("model") or d.get("model_filename") or "").rsplit("/", 1)[-1]
            t.add_row(name[:28], str(d.get("test", "")), _f(d.get("avg_ts"), 1), _f(d.get("stddev_ts"), 1), _f(d.get("ttft_seconds"), 3), _f(d.get("load_seconds"), 2))
        # tokens/s of every repetition, in the order they ran (pp reps, then tg reps)
        latest = rows[: 2] if rows and "samples_ts" in rows[0] else rows
        ts = [float(x) for d in latest for x in (d.get("samples_ts") or [d.get("avg_ts") or 0])]
        self.samples = ts
        self.query_one(Sparkline).data = ts
        mem = next((d for d in reversed(rows) if d.get("rss_bytes")), None)
        self.query_one("#bench-mem", Static).update(memory_split(mem) if mem else "Memory: not reported.")


def memory_split(d: dict) -> Table:
    t = Table(title="Memory", show_header=False, box=None, expand=True)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(justify="right")
    t.add_column()
    rss = d.get("rss_bytes") or 0
    for label, key in (("peak RSS", "rss_bytes"), ("file-backed", "file_backed_bytes"), ("anonymous", "anon_bytes"), ("KV cache", "kv_bytes")):
        v = d.get(key)
        if v is None:
            continue
        bar = "█" * int(12 * v / rss) if rss else ""
        t.add_row(label, human_size(v), bar)
    return t


def _f(v: Any, nd: int) -> str:
    if v is None:
        return "-"
    try:
        return f"{float(v):.{nd}f}"
    except (TypeError, ValueError):
        return str(v)
