"""Evaluate: run the all-level quality evaluation (quant.evaluate) with
progress and cancel; the results table, a size-vs-loss chart, and the
recommendation for this machine. Saved results are shown on arrival."""

from __future__ import annotations

import logging
from typing import Optional

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, DataTable, Input, Label, Select, Static

from edgellm.fsutil import human_size
from edgellm.models.store import Store
from edgellm.progress import Progress
from quant.evaluate import EvalReport, evaluate, load_eval_results
from quant.recommend import Recommendation, recommend
from quant.corpus import BUILTIN_CORPUS

from tui.widgets.jobbar import JobBar
from tui.widgets.tables import fill
from tui.widgets.plot import ScatterPlot
from tui.screens.base import BaseScreen, one_line, selected_value

log = logging.getLogger(__name__)


class EvaluateScreen(BaseScreen):
    MODE = "evaluate"
    BINDINGS = [
        Binding("g", "run", "Run eval"),
        Binding("escape", "cancel", "Cancel"),
        Binding("k", "toggle_metric", "KLD/ΔPPL chart"),
        Binding("r", "refresh", "Refresh"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.token = None
        self.report: Optional[EvalReport] = None
        self.metric = "kld_mean"

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        with Horizontal(id="eval-form", classes="form-row"):
            yield Label("Base", classes="lead")
            yield Select([], prompt="(no models)", id="eval-base", allow_blank=True)
            yield Label("Levels")
            yield Input("q4_0,q4_k_m,q5_k_m,q8_0", id="eval-levels", tooltip="levels to quantize and compare, comma-separated")
        with Horizontal(id="eval-form2", classes="form-row"):
            yield Label("Text file", classes="lead")
            yield Input("", placeholder=f"blank: built-in ({BUILTIN_CORPUS})", id="eval-text")
            yield Label("Chunks")
            yield Input("4", id="eval-chunks", type="integer", tooltip="chunks of the text to score (more: slower, tighter)", classes="num")
            yield Button("Run (g)", id="eval-go", variant="primary")
        yield JobBar(id="eval-job", idle="no evaluation running")
        with Horizontal(id="eval-body"):
            with Vertical(id="eval-left"):
                yield DataTable(id="eval-results", cursor_type="row")
                yield Static("", id="eval-source")
            yield ScatterPlot(id="eval-plot", x_label="size MB", y_label="mean KLD")
        yield Static("Recommendation: run an evaluation first.", id="eval-rec")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        if self.app.stable:
            for inp in self.query(Input):
                inp.cursor_blink = False
        self.query_one("#eval-results", DataTable).add_columns("Level", "Size", "PPL", "ΔPPL %", "KLD", "Same top %", "tok/s")
        self.action_refresh()

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self._refresh_bases()

    def _refresh_bases(self) -> None:
        sel = self.query_one("#eval-base", Select)
        try:
            recs = Store().list()
        except Exception as e:
            self.notify_error(e, "store")
            recs = []
        names = [m.name for m in recs]
        cur = sel.value
        sel.set_options([(n, n) for n in names])
        if cur in names:
            sel.value = cur
        else:
            floats = [m.name for m in recs if m.level in ("f16", "bf16", "f32")]
            if floats or names:
                sel.value = (floats or names)[0]

    def action_refresh(self) -> None:
        self._refresh_bases()
        self.in_background("saved evaluations", _saved, self._show_saved)

    def _show_saved(self, saved: tuple[Optional[EvalReport], "Recommendation | str"]) -> None:
        report, rec = saved
        if report is not None and self.token is None:
            self.show_results(report)
        self._show_rec(rec)

    # -- running -------------------------------------------------------------

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "eval-go":
            self.action_run()

    def action_run(self) -> None:
        if self.token is not None:
            self.notify("an evaluation is already running (Escape cancels it)", severity="warning")
            return
        base = selected_value(self.query_one("#eval-base", Select))
        if not base:
            self.notify("pick a base model (an F16 conversion is best)", severity="warning")
            return
        levels = [x.strip().lower() for x in self.query_one("#eval-levels", Input).value.split(",") if x.strip()]
        text = self.query_one("#eval-text", Input).value.strip() or None
        chunks_s = self.query_one("#eval-chunks", Input).value.strip()
        if chunks_s and not chunks_s.isdigit():
            self.notify(f"Chunks: a whole number, not {chunks_s!r}", severity="warning")
            return
        self.token = self.app.new_token()
        self.query_one(JobBar).start(f"eval {base}")
        self._eval(base, levels, text, int(chunks_s) if chunks_s else None, self.token)

    @work(thread=True, group="evaluate", exclusive=True)
    def _eval(self, base: str, levels: list[str], text: Optional[str], chunks: Optional[int], token) -> None:
        # A blank text field means the built-in corpus, as its placeholder says.
        source = dict(text=text) if text else dict(corpus=BUILTIN_CORPUS)
        ok, out = self.run_guarded(
            f"evaluate {base}", evaluate, base, levels, chunks=chunks, **source,
            on_progress=self.progress_to(self._progress), cancel=token, token=token,
        )
        rec = _recommendation() if ok else None
        self.ui(self._done, out if ok else None, rec, "" if ok else out, token.cancelled)

    def _progress(self, p: Progress) -> None:
        self.query_one(JobBar).update_from(p)

    def _done(self, report: Optional[EvalReport], rec: "Recommendation | str | None", reason: str, cancelled: bool) -> None:
        self.token = None
        failed = report is None and not cancelled
        self.query_one(JobBar).finish(
            "evaluation done" if report is not None else ("evaluation failed" if failed else "evaluation cancelled"),
            complete=report is not None, reason=reason if failed else "",
        )
        if report is not None:
            self.show_results(report)
            self._show_rec(rec)
            self.notify("evaluation done")

    def action_cancel(self) -> None:
        if self.token is not None:
            self.token.cancel("cancelled by the user")
            self.notify("cancelling the evaluation...")

    # -- rendering ------------------------------------------------------------

    def show_results(self, report: EvalReport) -> None:
        self.report = report
        fill(self.query_one("#eval-results", DataTable), [
            ((lv.level.upper(), human_size(lv.size_bytes), f"{lv.ppl:.3f}", f"{lv.dppl_pct:+.2f}", f"{lv.kld_mean:.4f}",
              f"{lv.same_top_p:.1f}", f"{lv.tokens_per_second:.0f}"), None)
            for lv in report.levels
        ])
        source = f"base {report.base}, corpus {report.corpus}, ctx {report.ctx}, {report.chunks} chunks"
        self.query_one("#eval-source", Static).update(f"[dim]{source}[/]")
        self._plot()

    def _plot(self) -> None:
        label = "mean KLD" if self.metric == "kld_mean" else "ΔPPL %"
        levels = self.report.levels if self.report else []
        pts = [(lv.size_bytes / 1e6, getattr(lv, self.metric), lv.level.upper()) for lv in levels]
        self.query_one(ScatterPlot).set_points(pts, y_label=label)

    def action_toggle_metric(self) -> None:
        self.metric = "dppl_pct" if self.metric == "kld_mean" else "kld_mean"
        self._plot()

    def _show_rec(self, rec: "Recommendation | str | None") -> None:
        if rec is None:
            return
        text = rec if isinstance(rec, str) else describe_rec(rec)
        self.query_one("#eval-rec", Static).update(f"Recommendation: {text}")


def _recommendation() -> "Recommendation | str":
    """recommend()'s pick, or why there is none (no saved results, nothing fits)."""
    try:
        return recommend()
    except Exception as e:  # a reason to show, not a failure of the screen
        return one_line(e)


def _saved() -> tuple[Optional[EvalReport], "Recommendation | str"]:
    """The newest saved report and the recommendation: read in a worker."""
    reports = load_eval_results()
    return (reports[0] if reports else None), _recommendation()


def describe_rec(rec: Recommendation) -> str:
    best = rec.best
    parts = [best.name, f"KLD {best.kld_mean:.4f}", f"ΔPPL {best.dppl_pct:+.2f}%", human_size(best.size_bytes)]
    if rec.runner_up is not None:
        parts.append(f"(runner-up {rec.runner_up.name})")
    return "  ".join(parts)
