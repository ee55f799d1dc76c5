"""Bench: run the profiler (edgellm.profile.bench.bench) on a model; pp/tg tokens/s,
the share of the generation roofline reached and the memory read bandwidth it
is measured against (as `edgellm bench` prints them), the memory split
(file-backed weights vs anonymous KV/compute), and a sparkline of tokens/s
over the run. The GPU-layers setting and the RPC
workers (configured on the System screen) are the CLI's --gpu-layers and
--rpc: each row shows the layers offloaded and the device/host bytes."""

from __future__ import annotations

import logging
from typing import Any, Optional

from rich.table import Table
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Checkbox, DataTable, Input, Label, Select, Sparkline, Static

from edgellm.errors import UsageError
from edgellm.fsutil import human_size
from edgellm.profile.bench import bench
from edgellm.profile.bench_rpc import as_bench_rows, bench_rpc
from edgellm.profile.results import load_bench_results
from edgellm.profile.settings import BenchSettings
from tui.screens.base import CANCEL, REFRESH, BaseScreen
from tui.widgets.chat_settings import gpu_layers
from tui.widgets.fields import set_choices, steady_cursors
from tui.widgets.jobbar import JobBar
from tui.widgets.tables import fill

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
    # one line for the offload options, so the results keep their rows on a 30-line terminal
    DEFAULT_CSS = """
    #bench-form2 { height: 1; margin: 0 0 1 0; }
    #bench-form2 Label { width: auto; padding: 0 1; text-style: bold; }
    #bench-form2 Input { width: 8; height: 1; border: none; padding: 0 1; }
    #bench-form2 Checkbox { width: auto; height: 1; border: none; padding: 0 1; margin: 0 0 0 2; }
    """

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
        with Horizontal(id="bench-form2"):
            yield Label("GPU layers")
            yield Input("0", id="bench-gpu-layers", tooltip="layers to offload: N, all, auto (what fits) or 0", classes="num")
            yield Checkbox("split over the RPC workers (set on the System screen)", id="bench-rpc")
        yield JobBar(id="bench-job", idle="no benchmark running")
        with Vertical(id="bench-body"):
            yield DataTable(id="bench-results", cursor_type="row")
            yield Static("Memory: run a benchmark.", id="bench-mem")
        yield Label(
            "tokens/s of each repetition of the selected model, in order (pp, then tg)",
            id="bench-spark-title",
            classes="pane-title",
        )
        yield Sparkline([], id="bench-spark")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        steady_cursors(self)
        self.query_one("#bench-results", DataTable).add_columns(
            "Model", "Test", "tok/s", "±", "Roofline", "Read BW", "TTFT s", "Load s", "GPU layers", "Device", "Host"
        )
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
            layers = gpu_layers(self.query_one("#bench-gpu-layers", Input).value, "GPU layers")
            rpc = self.app.rpc_workers if self.query_one("#bench-rpc", Checkbox).value else ""
            if self.query_one("#bench-rpc", Checkbox).value and not rpc:
                raise UsageError("RPC workers: none configured; enter HOST:PORT on the System screen (F6) first")
        except (ValueError, UsageError) as e:
            self.notify(str(e), severity="warning")
            return
        if rpc and layers not in (0, "0"):
            self.notify("GPU layers: not used with RPC workers (the split places the layers)", severity="warning")
        self.samples = []
        self.query_one(Sparkline).data = []
        self._bench(model, pp, tg, reps, layers, rpc, self.start_job(f"bench {model}" + (" over RPC" if rpc else "")))

    @work(thread=True, group="bench", exclusive=True)
    def _bench(self, model: str, pp: int, tg: int, reps: int, layers, rpc: str, token) -> None:
        progress = self.progress_to(self.job_progress, min_interval=0.1)
        warn = lambda m: self.ui(self.notify, m, severity="warning")  # noqa: E731  (the plan and its notes)
        if rpc:  # as `bench --rpc`: each test here and split over the workers (GPU layers do not apply)
            ok, out = self.run_guarded(
                f"bench {model}",
                bench_rpc,
                model,
                rpc,
                BenchSettings(pp=pp, tg=tg, repetitions=reps),
                on_plan=lambda p: warn("\n".join(p.lines())),
                on_progress=progress,
                cancel=token,
                token=token,
            )
            rows = as_bench_rows(*out) if ok else None
        else:
            ok, out = self.run_guarded(
                f"bench {model}",
                bench,
                [model],
                BenchSettings(pp=pp, tg=tg, repetitions=reps),
                n_gpu_layers=layers,
                warn=warn,
                on_progress=progress,
                cancel=token,
                token=token,
            )
            rows = [r.to_json() for r in out] if ok else None
        self.ui(self._done, rows, "" if ok else out, token.cancelled)

    def _done(self, rows: Optional[list[dict]], reason: str, cancelled: bool) -> None:
        self.end_job("benchmark", rows is not None, reason, cancelled)
        if rows is not None:
            self.show_results(rows)

    # -- rendering ------------------------------------------------------------

    def show_results(self, rows: list[dict]) -> None:
        self.rows = list(rows)
        t = self.query_one("#bench-results", DataTable)
        fill(
            t,
            [
                (
                    (
                        str(d["model"]).rsplit("/", 1)[-1][:28],
                        d["test"],
                        _f(d["avg_ts"], 1),
                        _f(d["stddev_ts"], 1),
                        # the core's figures; a row saved before they existed, or one they do not
                        # apply to (the roofline is generation's; a split run measures no bandwidth), has none
                        _percent(d.get("roofline_fraction")),
                        _rate(d.get("bandwidth_bytes_per_s")),
                        _f(d["ttft_seconds"], 3),
                        _f(d["load_seconds"], 2),
                        str(d.get("n_gpu_layers", 0)),
                        _bytes(d.get("device_bytes")),
                        _bytes(d.get("host_bytes")),
                    ),
                    None,
                )
                for d in self.rows
            ],
        )
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


def _bytes(v: Any) -> str:
    return human_size(v) if v else "-"


def _percent(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.0f}%"


def _rate(v: Any) -> str:
    return f"{human_size(v)}/s" if v else "-"


def memory_split(d: dict) -> Table:
    name = str(d["model"]).rsplit("/", 1)[-1]
    t = Table(title=f"Memory: {name} {d['test']}", show_header=False, box=None, expand=True)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(justify="right")
    t.add_column()
    rss = d["rss_bytes"] or 0
    for label, key in (
        ("peak RSS", "rss_bytes"),
        ("file-backed", "file_backed_bytes"),
        ("anonymous", "anon_bytes"),
        ("KV cache", "kv_bytes"),
    ):
        v = d[key]
        if v is None:  # not measured on this platform
            continue
        bar = "█" * int(12 * v / rss) if rss else ""
        t.add_row(label, human_size(v), bar)
    if d.get("n_gpu_layers"):
        where = "workers" if d.get("rpc") else (d.get("gpu_device") or "device")
        t.add_row(f"on {where}", human_size(d.get("device_bytes") or 0), f"{d['n_gpu_layers']} layers")
        t.add_row("on this host", human_size(d.get("host_bytes") or 0), "")
    if d.get("rpc"):
        t.add_row("local only", f"{d['rpc']['local_ts']:.1f} t/s", f"network {100 * d['rpc']['network_share']:.0f}%")
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
