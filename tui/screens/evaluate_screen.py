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
from quant.corpus import BUILTIN_CORPUS
from quant.evaluate import EvalReport, evaluate, is_edgellm_recipe, level_tag, load_eval_results
from quant.perplexity import Scoring
from quant.recommend import Recommendation, recommend
from tui.screens.base import CANCEL, REFRESH, BaseScreen, one_line
from tui.widgets.fields import set_choices, steady_cursors
from tui.widgets.jobbar import JobBar
from tui.widgets.plot import ScatterPlot
from tui.widgets.tables import fill

log = logging.getLogger(__name__)


class EvaluateScreen(BaseScreen):
    MODE = "evaluate"
    BINDINGS = [Binding("g", "run", "Run eval"), CANCEL, Binding("k", "toggle_metric", "KLD/ΔPPL chart"), REFRESH]
    CANCELLING = "cancelling the evaluation..."
    BUTTONS = {"eval-go": "run"}
    report: Optional[EvalReport] = None  # the one on show
    metric = "kld_mean"  # the chart's y axis

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
            yield Input(
                "4",
                id="eval-chunks",
                type="integer",
                tooltip="chunks of the text to score (more: slower, tighter)",
                classes="num",
            )
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
        steady_cursors(self)
        self.query_one("#eval-results", DataTable).add_columns("Level", "Size", "PPL", "ΔPPL %", "KLD", "Same top %", "tok/s")
        self.action_refresh()

    def reload(self) -> None:
        recs = self.store_models()
        floats = [m.name for m in recs if m.level in ("f16", "bf16", "f32")]  # the best base to quantize from
        set_choices(self.query_one("#eval-base", Select), [m.name for m in recs], default=(floats or [""])[0])

    def action_refresh(self) -> None:
        self.reload()
        self.in_background("saved evaluations", _saved, self._show_saved)

    def _show_saved(self, saved: tuple[Optional[EvalReport], Recommendation | str]) -> None:
        report, rec = saved
        if report is not None and self.token is None:
            self.show_results(report)
        self._show_rec(rec)

    # -- running -------------------------------------------------------------

    def action_run(self) -> None:
        if self.busy("an evaluation is already running") or not (
            base := self.picked("#eval-base", "pick a base model (an F16 conversion is best)")
        ):
            return
        levels = [x.strip().lower() for x in self.query_one("#eval-levels", Input).value.split(",") if x.strip()]
        text = self.query_one("#eval-text", Input).value.strip() or None
        chunks_s = self.query_one("#eval-chunks", Input).value.strip()
        if chunks_s and not chunks_s.isdigit():
            self.notify(f"Chunks: a whole number, not {chunks_s!r}", severity="warning")
            return
        self._eval(base, levels, text, int(chunks_s) if chunks_s else None, self.start_job(f"eval {base}"))

    @work(thread=True, group="evaluate", exclusive=True)
    def _eval(self, base: str, levels: list[str], text: Optional[str], chunks: Optional[int], token) -> None:
        # A blank text field means the built-in corpus, as its placeholder says.
        scoring = Scoring(text=text, chunks=chunks) if text else Scoring(corpus=BUILTIN_CORPUS, chunks=chunks)
        ok, out = self.run_job(f"evaluate {base}", evaluate, base, levels, scoring, token=token)
        rec = _recommendation() if ok else None
        self.ui(self._done, out if ok else None, rec, "" if ok else out, token.cancelled)

    def _done(self, report: Optional[EvalReport], rec: Recommendation | str | None, reason: str, cancelled: bool) -> None:
        self.end_job("evaluation", report is not None, reason, cancelled)
        if report is not None:
            self.show_results(report)
            self._show_rec(rec)

    # -- rendering ------------------------------------------------------------

    def show_results(self, report: EvalReport) -> None:
        self.report = report
        fill(
            self.query_one("#eval-results", DataTable),
            [
                (
                    (
                        level_tag(report, lv).upper(),
                        human_size(lv.size_bytes),
                        f"{lv.ppl:.3f}",
                        f"{lv.dppl_pct:+.2f}",
                        f"{lv.kld_mean:.4f}",
                        f"{lv.same_top_p:.1f}",
                        f"{lv.tokens_per_second:.0f}",
                    ),
                    None,
                )
                for lv in report.levels
            ],
        )
        source = f"base {report.base}, corpus {report.corpus}, ctx {report.ctx}, {report.chunks} chunks"
        self.query_one("#eval-source", Static).update(f"[dim]{source}[/]")
        self._plot()

    def _plot(self) -> None:
        label = "mean KLD" if self.metric == "kld_mean" else "ΔPPL %"
        rep = self.report
        levels = rep.levels if rep else []
        pts = [(lv.size_bytes / 1e6, getattr(lv, self.metric), level_tag(rep, lv).upper()) for lv in levels]  # type: ignore[arg-type]
        # Two series once edgellm's own files are there: the frontier they make against llama.cpp's levels.
        kinds = ["edgellm" if is_edgellm_recipe(lv.name) else "llama.cpp" for lv in levels]
        self.query_one(ScatterPlot).set_points(pts, y_label=label, series=kinds if "edgellm" in kinds else None)

    def action_toggle_metric(self) -> None:
        self.metric = "dppl_pct" if self.metric == "kld_mean" else "kld_mean"
        self._plot()

    def _show_rec(self, rec: Recommendation | str | None) -> None:
        if rec is None:
            return
        text = rec if isinstance(rec, str) else describe_rec(rec)
        self.query_one("#eval-rec", Static).update(f"Recommendation: {text}")


def _recommendation() -> Recommendation | str:
    """recommend()'s pick, or why there is none (no saved results, nothing fits)."""
    try:
        return recommend()
    except Exception as e:  # a reason to show, not a failure of the screen
        return one_line(e)


def _saved() -> tuple[Optional[EvalReport], Recommendation | str]:
    """The newest saved report and the recommendation: read in a worker."""
    reports = load_eval_results()
    return (reports[0] if reports else None), _recommendation()


def describe_rec(rec: Recommendation) -> str:
    best = rec.best
    parts = [best.name, f"KLD {best.kld_mean:.4f}", f"ΔPPL {best.dppl_pct:+.2f}%", human_size(best.size_bytes)]
    if rec.runner_up is not None:
        parts.append(f"(runner-up {rec.runner_up.name})")
    if rec.budget_hint:
        parts.append(f"— or try: {rec.budget_hint['command']}")
    return "  ".join(parts)
