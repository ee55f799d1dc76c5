"""Bench: run the profiler (edgellm.profile.bench.bench) on a model; pp/tg tokens/s,
the memory split (file-backed weights vs anonymous KV/compute), and a
sparkline of tokens/s over the run."""

from __future__ import annotations

import logging
from typing import Any, Optional

from rich.table import Table
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Button, DataTable, Input, Label, Select, Sparkline, Static

from edgellm.fsutil import human_size
from edgellm.profile.bench import bench
from edgellm.profile.results import load_bench_results

from tui.widgets.fields import set_choices, steady_cursors
from tui.widgets.jobbar import JobBar
from tui.widgets.tables import fill
from tui.screens.base import CANCEL, REFRESH, BaseScreen

log = logging.getLogger(__name__)

# (id, label, default, tooltip): the numbers of a run, each with its label
FIELDS = [
    ("bench-pp", "pp", "512", "prompt tokens processed per repetition (pp test)"),
    ("bench-tg", "tg", "128", "tokens generated per repetition (tg test; 0 skips it)"),
    ("bench-reps", "Reps", "3", "repetitions of each test"),
]


class BenchScreen(BaseScreen):
    """Rows are the core's JSON rows (`BenchRow.to_json()`, which is also what
    `load_bench_results()` returns for saved runs), so fresh and saved
    results take one path to the screen."""

    MODE = "bench"
    BINDINGS = [Binding("g", "run", "Run bench"), CANCEL, REFRESH]
    CANCELLING = "cancelling the benchmark..."
    BUTTONS = {"bench-go": "run"}

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []  # the table's rows, in its order
        self.samples: list[float] = []

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        with Horizontal(id="bench-form", classes="form-row"):
            yield Label("Model")
            yield Select([], prompt="(no models)", id="bench-model", allow_blank=True)
            for id_, label, default, tip in FIELDS:
                yield Label(label)
                yield Input(default, id=id_, type="integer", tooltip=tip, classes="num")
            yield Button("Run (g)", id="bench-go", variant="primary")
        yield JobBar(id="bench-job", idle="no benchmark running")
        with Horizontal(id="bench-body"):
            yield DataTable(id="bench-results", cursor_type="row")
            yield Static("Memory: run a benchmark.", id="bench-mem")
        yield Label("tokens/s of each repetition of the selected model, in order (pp, then tg)", id="bench-spark-title", classes="pane-title")
        yield Sparkline([], id="bench-spark")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        steady_cursors(self)
        self.query_one("#bench-results", DataTable).add_columns("Model", "Test", "tok/s", "±", "TTFT s", "Load s")
        self.action_refresh()

    def reload(self) -> None:
        set_choices(self.query_one("#bench-model", Select), [m.name for m in self.store_models()])

    def action_refresh(self) -> None:
        self.reload()
        self.in_background("saved bench results", load_bench_results, self._show_saved)

    def _show_saved(self, rows: list[dict]) -> None:
        if rows and self.token is None:
            self.show_results(rows)

    def action_run(self) -> None:
        if self.busy("a benchmark is already running") or not (model := self.picked("#bench-model", "pick a model first")):
            return
        try:
            pp, tg, reps = (_int_field(self.query_one(f"#{id_}", Input).value, label) for id_, label, _, _ in FIELDS)
        except ValueError as e:
            self.notify(str(e), severity="warning")
            return
        self.samples = []
        self.query_one(Sparkline).data = []
        self._bench(model, pp, tg, reps, self.start_job(f"bench {model}"))

    @work(thread=True, group="bench", exclusive=True)
    def _bench(self, model: str, pp: int, tg: int, reps: int, token) -> None:
        ok, out = self.run_guarded(
            f"bench {model}", bench, [model], pp=pp, tg=tg, repetitions=reps,
            on_progress=self.progress_to(self.job_progress, min_interval=0.1), cancel=token, token=token,
        )
        self.ui(self._done, [r.to_json() for r in out] if ok else None, "" if ok else out, token.cancelled)

    def _done(self, rows: Optional[list[dict]], reason: str, cancelled: bool) -> None:
        self.end_job("benchmark", rows is not None, reason, cancelled)
        if rows is not None:
            self.show_results(rows)

    # -- rendering ------------------------------------------------------------

    def show_results(self, rows: list[dict]) -> None:
        self.rows = list(rows)
        t = self.query_one("#bench-results", DataTable)
        fill(t, [
            ((str(d["model"]).rsplit("/", 1)[-1][:28], d["test"], _f(d["avg_ts"], 1), _f(d["stddev_ts"], 1), _f(d["ttft_seconds"], 3),
              _f(d["load_seconds"], 2)), None)
            for d in self.rows
        ])
        self.show_row(t.cursor_row)

    @on(DataTable.RowHighlighted, "#bench-results")
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_row(event.cursor_row)

    def show_row(self, i: int) -> None:
        """The memory panel and the sparkline follow the selected row."""
        mem = self.query_one("#bench-mem", Static)
        if not 0 <= i < len(self.rows):
            mem.update("Memory: run a benchmark.")
            self.query_one(Sparkline).data = self.samples = []
            return
        d = self.rows[i]
        mem.update(memory_split(d))
        # every repetition of this model's run, in the order they ran (pp reps, then tg reps)
        same = [r for r in self.rows if r["model"] == d["model"] and r["timestamp"] == d["timestamp"]]
        self.samples = [float(x) for r in same for x in r["samples_ts"]]
        self.query_one(Sparkline).data = self.samples


def memory_split(d: dict) -> Table:
    name = str(d["model"]).rsplit("/", 1)[-1]
    t = Table(title=f"Memory: {name} {d['test']}", show_header=False, box=None, expand=True)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(justify="right")
    t.add_column()
    rss = d["rss_bytes"] or 0
    for label, key in (("peak RSS", "rss_bytes"), ("file-backed", "file_backed_bytes"), ("anonymous", "anon_bytes"), ("KV cache", "kv_bytes")):
        v = d[key]
        if v is None:  # not measured on this platform
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


def _int_field(text: str, label: str) -> int:
    text = text.strip()
    if not text.isdigit():
        raise ValueError(f"{label}: a whole number, not {text!r}")
    return int(text)
