"""Evaluate: run the all-level quality evaluation (quant.evaluate) with
progress and cancel; the results table, a size-vs-loss chart (llama.cpp's
levels and edgellm's imatrix/--budget files as two series, recommend()'s
pick marked), the report's warnings, and the recommendation for this
machine. Saved results are shown on arrival. The stored imatrix and
--budget outputs of the base are offered by name for the levels field."""

from __future__ import annotations

import logging
from typing import Optional

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, DataTable, Input, Label, Select, Static

from edgellm.fsutil import human_size
from edgellm.models.store import Store
from quant.corpus import BUILTIN_CORPUS
from quant.evaluate import EvalReport, evaluate, is_edgellm_recipe, level_tag, load_eval_results
from quant.perplexity import Scoring
from quant.recommend import Recommendation, recommend
from tui.screens.base import CANCEL, REFRESH, BaseScreen, one_line, selected_value
from tui.widgets.fields import set_choices, steady_cursors
from tui.widgets.jobbar import JobBar
from tui.widgets.plot import ScatterPlot
from tui.widgets.tables import fill

log = logging.getLogger(__name__)

NO_OUTPUTS = "(no imatrix or --budget outputs of this base)"


class EvaluateScreen(BaseScreen):
    MODE = "evaluate"
    # This screen's alone, so kept with it rather than in the shared stylesheet: the warnings line, and
    # the Stored picker on one line (a compact Select) so the chart keeps its rows at 80x24.
    DEFAULT_CSS = """
    #eval-warnings { display: none; height: auto; max-height: 25%; padding: 0 1; color: $text-warning; background: $warning-muted; }
    #eval-form-stored { height: 1; }
    #eval-form-stored Label { width: 10; padding: 0 0 0 1; text-style: bold; }
    #eval-stored { width: 1fr; margin-right: 2; }
    """
    BINDINGS = [Binding("g", "run", "Run eval"), CANCEL, Binding("k", "toggle_metric", "KLD/ΔPPL chart"), REFRESH]
    CANCELLING = "cancelling the evaluation..."
    BUTTONS = {"eval-go": "run"}
    report: Optional[EvalReport] = None  # the one on show
    rec: Optional[Recommendation] = None  # recommend()'s pick, marked on the chart when the report has it
    metric = "kld_mean"  # the chart's y axis

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        with Horizontal(id="eval-form", classes="form-row"):
            yield Label("Base", classes="lead")
            yield Select([], prompt="(no models)", id="eval-base", allow_blank=True)
            yield Label("Levels")
            yield Input(
                "q4_0,q4_k_m,q5_k_m,q8_0",
                id="eval-levels",
                tooltip="levels to quantize and compare, or stored model names, comma-separated",
            )
        with Horizontal(id="eval-form-stored"):  # not a .form-row: one line, not three
            yield Label("Stored")
            yield Select(
                [],
                prompt=NO_OUTPUTS,
                id="eval-stored",
                allow_blank=True,
                compact=True,
                tooltip="the base's stored imatrix and --budget/--recipe outputs: picking one adds its name to Levels",
            )
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
        yield Static("", id="eval-warnings")
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
        self._load_outputs()

    # -- the base's stored outputs, offered for the levels field ---------------

    @on(Select.Changed, "#eval-base")
    def _base_changed(self) -> None:
        self._load_outputs()

    def _load_outputs(self) -> None:
        base = selected_value(self.query_one("#eval-base", Select))
        self.in_background("stored outputs", lambda: stored_outputs(base), self._show_outputs, group="outputs")

    def _show_outputs(self, names: list[str]) -> None:
        stored = self.query_one("#eval-stored", Select)
        stored.set_options([(n, n) for n in names])
        stored.prompt = f"{len(names)} stored: pick one to add it to Levels" if names else NO_OUTPUTS

    @on(Select.Changed, "#eval-stored")
    def _stored_picked(self, event: Select.Changed) -> None:
        name = event.value
        if not isinstance(name, str):
            return  # the pick cleared below, or new options
        levels = self.query_one("#eval-levels", Input)
        items = [x.strip() for x in levels.value.split(",") if x.strip()]
        if name.lower() not in (x.lower() for x in items):
            levels.value = ",".join([*items, name])
        event.select.clear()  # back to the prompt: the field, not the picker, holds what is picked

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
            self._load_outputs()  # the run may have quantized new files

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
        # What `eval` prints as `warning: ...` lines (a calibration text as the evaluation text, a dequantized base).
        warnings = self.query_one("#eval-warnings", Static)
        warnings.update(Text("\n".join(f"warning: {w}" for w in report.warnings)))
        warnings.display = bool(report.warnings)
        self._plot()

    def _plot(self) -> None:
        label = "mean KLD" if self.metric == "kld_mean" else "ΔPPL %"
        rep = self.report
        levels = rep.levels if rep else []
        pts = [(lv.size_bytes / 1e6, getattr(lv, self.metric), level_tag(rep, lv).upper()) for lv in levels]  # type: ignore[arg-type]
        # Two series once edgellm's own files are there: the frontier they make against llama.cpp's levels.
        kinds = ["edgellm" if is_edgellm_recipe(lv.name) else "llama.cpp" for lv in levels]
        best = self.rec.best if self.rec is not None and rep is not None and self.rec.best.base == rep.base else None
        marked = next((i for i, lv in enumerate(levels) if best is not None and lv.name == best.name), None)
        self.query_one(ScatterPlot).set_points(
            pts, y_label=label, series=kinds if "edgellm" in kinds else None, recommended=marked
        )

    def action_toggle_metric(self) -> None:
        self.metric = "dppl_pct" if self.metric == "kld_mean" else "kld_mean"
        self._plot()

    def _show_rec(self, rec: Recommendation | str | None) -> None:
        if rec is None:
            return
        text = rec if isinstance(rec, str) else describe_rec(rec)
        self.query_one("#eval-rec", Static).update(f"Recommendation: {text}")
        self.rec = None if isinstance(rec, str) else rec
        self._plot()


def stored_outputs(base: str) -> list[str]:
    """The store's models quantized from `base` with an importance matrix or a --budget/--recipe
    recipe (their records' lineage, as `eval`'s calibration warning reads it): read in a worker."""
    if not base:
        return []
    return [c.name for c in Store().children(base) if c.extra.get("imatrix") or c.extra.get("recipe")]


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
