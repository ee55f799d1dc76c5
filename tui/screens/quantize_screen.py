"""Quantize: pick a base and levels, queue one job per level, watch each
job's progress, cancel any of them, read the results.

Jobs run one at a time (quantizing is CPU-bound: two at once only share the
cores) in a single runner worker that drains the queue; each job has its own
CancelToken, so a queued job can be cancelled before it starts.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, DataTable, Input, Label, Select, Static
from textual.widgets.selection_list import Selection

from edgellm.fsutil import human_size
from edgellm.progress import CancelToken, Progress
from quant.levels import all_levels
from quant.quantize import QuantizeResult
from tui.screens import budget_form
from tui.screens.base import REFRESH, BaseScreen
from tui.widgets.checklist import CheckBox, CheckList
from tui.widgets.fields import set_choices, steady_cursors
from tui.widgets.jobbar import JobBar
from tui.widgets.tables import cursor_key, fill

log = logging.getLogger(__name__)

# The levels most people want, first in the list; the four picked are the ones
# `edgellm eval` compares by default.
FIRST_LEVELS = ["q4_0", "q4_k_m", "q5_k_m", "q8_0", "q4_1", "q6_k", "f16", "bf16"]
DEFAULT_PICKS = {"q4_0", "q4_k_m", "q5_k_m", "q8_0"}


@dataclass
class Job:
    id: int
    base: str
    level: str
    token: CancelToken
    status: str = "queued"
    pct: float = 0.0
    results: list[QuantizeResult] = field(default_factory=list)
    reason: str = ""  # why it failed or was cancelled, kept in its row
    allow_requantize: bool = False
    budget: str = ""  # a --budget search instead of a level
    exclude: list[str] = field(default_factory=list)
    imatrix: str = budget_form.IMATRIX_NONE
    recipe: str = ""  # a saved recipe's file, applied instead of a search
    feedback: bool = True  # a search's file rounded with error feedback where RAM allows (the CLI's default)

    @property
    def label(self) -> str:
        if self.recipe:
            return f"RECIPE {Path(self.recipe).stem}"
        return f"BUDGET {self.budget}" if self.budget else self.level.upper()


def offered_levels(with_imatrix: bool = False) -> list[str]:
    """The levels quant.levels says edgellm can produce; those that need an importance matrix once one is picked."""
    keys = [lv.key for lv in all_levels() if lv.readable and (with_imatrix or not lv.needs_imatrix)]
    first = [k for k in FIRST_LEVELS if k in keys]
    return first + [k for k in keys if k not in first]


class QuantizeScreen(BaseScreen):
    MODE = "quantize"
    BINDINGS = [
        Binding("a", "queue", "Queue jobs"),
        Binding("m", "toggle_mode", "Levels/budget"),
        Binding("x", "cancel_selected", "Cancel job"),
        Binding("escape", "cancel_running", "Cancel running"),
        REFRESH,
        Binding("i", "imatrices", "Matrices"),
    ]
    BUTTONS = {"quant-go": "queue"}

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._queue: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        self._runner_active = False
        self.current: Optional[Job] = None
        self.results: list[QuantizeResult] = []  # every finished output, in order

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        with Horizontal(id="quant-top"):
            # scrolls: the budget mode's fields and the button need more than 30 rows
            with VerticalScroll(id="quant-form", classes="form"):
                yield Label("Base model")
                yield Select([], prompt="(no models)", id="quant-base", allow_blank=True)
                yield Label("Importance matrix [dim](i)[/]")
                yield Select(_IMATRIX_FIXED, id="quant-imatrix", allow_blank=False, value=budget_form.IMATRIX_NONE)
                yield Label("Levels  [dim](space toggles)[/]", id="quant-levels-label")
                yield CheckList(*[(lv.upper(), lv, lv in DEFAULT_PICKS) for lv in offered_levels()], id="quant-levels")
                yield CheckBox("Allow requantize", id="quant-requant")
                with Vertical(id="quant-budget-box"):
                    yield Label("Size budget")
                    yield Input("", placeholder="100MB, 4.5bpw or ram", id="quant-budget")
                    yield Static("", id="quant-budget-err", markup=False)
                    yield Static("", id="quant-ram", markup=False)
                    yield Label("Exclude types")
                    yield Input("", placeholder="q4_1,q5_1", id="quant-exclude")
                    yield Static("", id="quant-exclude-why", markup=False)
                    yield CheckBox(
                        "Error feedback",
                        value=True,
                        id="quant-feedback",
                        tooltip="lower KLD at the same size, a slower job; cleared: --no-error-feedback",
                    )
                    yield Label("Saved recipe")
                    yield Select([(budget_form.SEARCH_LABEL, "")], id="quant-recipe", allow_blank=False, value="")
                    yield Static("", id="quant-cost", markup=False)
                yield Button("Queue (a)", id="quant-go", variant="primary")
            with Vertical(id="quant-right"):
                yield Label("Jobs  [dim](x cancels the selected job)[/]", classes="pane-title")
                yield DataTable(id="quant-jobs", cursor_type="row")
                yield JobBar(id="quant-job", idle="no job running")
                yield Label("Results", classes="pane-title")
                yield DataTable(id="quant-results", cursor_type="row")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self.query_one("#quant-jobs", DataTable).add_columns("#", "Base", "Level", "Status", "Done", "Note")
        self.query_one("#quant-results", DataTable).add_columns("Output", "Level", "Size", "BPW", "Fallback", "Seconds")
        steady_cursors(self)
        self._set_mode("levels")
        self.action_refresh()

    def action_imatrices(self) -> None:
        """The importance-matrix panel, its compute defaulting to the base picked here."""
        from tui.screens.imatrix_panel import ImatrixPanel

        self.app.push_screen(ImatrixPanel(default_model=budget_form_base(self)))

    # -- the mode: levels, or a size budget -----------------------------------

    mode = "levels"

    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        budget = mode == "budget"
        self.query_one("#quant-budget-box").display = budget
        self.query_one("#quant-levels").display = not budget
        self.query_one("#quant-levels-label").display = not budget
        self.query_one("#quant-requant").display = not budget
        if budget:
            imx = self.query_one("#quant-imatrix", Select)
            if imx.value == budget_form.IMATRIX_NONE:  # the search measures with a matrix
                imx.value = budget_form.IMATRIX_AUTO
            self._budget_hints()

    def action_toggle_mode(self) -> None:
        self._set_mode("levels" if self.mode == "budget" else "budget")

    def _budget_hints(self) -> None:
        """The RAM figure, the base's own source type pre-ticked, and what the job will cost (read in a worker)."""
        base = budget_form_base(self)
        imatrix = self._imatrix()
        recipe = self._recipe()
        if base:
            self.in_background(
                "budget hints",
                lambda: (
                    budget_form.ram_hint(base),
                    budget_form.dequantized_from(base),
                    budget_form.cost_hint(base, imatrix, recipe),
                ),
                self._show_hints,
                group="hints",
            )

    def _hint(self, selector: str, text: str) -> None:
        """A line under a field, there only while it says something (the form is short of rows)."""
        line = self.query_one(selector, Static)
        line.update(text)
        line.display = bool(text)

    def _imatrix(self) -> str:
        v = self.query_one("#quant-imatrix", Select).value
        return v if isinstance(v, str) else budget_form.IMATRIX_NONE

    def _recipe(self) -> str:
        v = self.query_one("#quant-recipe", Select).value
        return v if isinstance(v, str) else ""

    def _show_hints(self, hints: tuple[str, str, str]) -> None:
        ram, src, cost = hints
        self._hint("#quant-ram", ram)
        self._hint("#quant-cost", cost)
        why = ""
        if src:
            box = self.query_one("#quant-exclude", Input)
            if src.lower() not in [t.lower() for t in budget_form.exclude_list(box.value)]:
                box.value = ",".join([*budget_form.exclude_list(box.value), src.lower()])
            why = f"{src.upper()} excluded: this base was dequantized from it"
        self._hint("#quant-exclude-why", why)

    @on(Select.Changed, "#quant-base")
    @on(Select.Changed, "#quant-imatrix")
    @on(Select.Changed, "#quant-recipe")
    def _picked(self, event: Select.Changed) -> None:
        if event.select.id == "quant-base":
            self.reload_imatrices()
        if event.select.id == "quant-imatrix":
            self._offer_levels()
        if self.mode == "budget":
            self._budget_hints()

    def _offer_levels(self) -> None:
        """The imatrix levels (IQ1-IQ3, Q2_K_S) in the list while a matrix is picked; the ticks kept."""
        levels = self.query_one("#quant-levels", CheckList)
        keys = offered_levels(self._imatrix() != budget_form.IMATRIX_NONE)
        if [str(o.value) for o in levels.options if isinstance(o, Selection)] == keys:
            return
        ticked = set(levels.selected)
        levels.clear_options()
        levels.add_options([(lv.upper(), lv, lv in ticked) for lv in keys])

    def reload(self) -> None:
        set_choices(self.query_one("#quant-base", Select), [m.name for m in self.store_models()])
        self.reload_imatrices()
        self.in_background("saved recipes", budget_form.recipe_choices, self._show_recipes, group="recipes")

    def reload_imatrices(self) -> None:
        """The picker's stored matrices are this base's: read in a worker (it lists and hashes)."""
        base = budget_form_base(self)
        self.in_background(
            "importance matrices", lambda: budget_form.imatrix_choices(base), self._show_imatrices, group="imatrix"
        )

    def _show_imatrices(self, choices: list[tuple[str, str]]) -> None:
        _keep_pick(self.query_one("#quant-imatrix", Select), [*_IMATRIX_FIXED, *choices], budget_form.IMATRIX_NONE)
        self._offer_levels()

    def _show_recipes(self, choices: list[tuple[str, str]]) -> None:
        _keep_pick(self.query_one("#quant-recipe", Select), [(budget_form.SEARCH_LABEL, ""), *choices], "")

    # -- queueing ----------------------------------------------------------

    def action_queue(self) -> None:
        if self.mode == "budget":
            self._queue_budget()
            return
        base = self.picked("#quant-base", "pick a base model first (import or pull one on the Models screen)")
        levels = list(self.query_one("#quant-levels", CheckList).selected)
        if not base:
            return
        if not levels:
            self.notify("pick at least one level", severity="warning")
            return
        requant = self.query_one("#quant-requant", CheckBox).value
        for lv in levels:
            self.queue_job(str(base), lv, allow_requantize=requant, imatrix=self._imatrix())

    def _queue_budget(self) -> None:
        base = self.picked("#quant-base", "pick a base model first (an F16 conversion)")
        if not base:
            return
        budget = self.query_one("#quant-budget", Input).value.strip()
        exclude = budget_form.exclude_list(self.query_one("#quant-exclude", Input).value)
        recipe, imatrix = self._recipe(), self._imatrix()
        # The core's own checks, with the CLI's line under the field; a bad budget or recipe starts nothing.
        if recipe:
            err = budget_form.recipe_error(str(base), recipe)
        else:
            err = budget_form.budget_error(str(base), budget, exclude, imatrix)
        self._hint("#quant-budget-err", err or "")
        if err:
            return
        feedback = self.query_one("#quant-feedback", CheckBox).value
        self.queue_job(str(base), "budget", budget=budget, exclude=exclude, imatrix=imatrix, recipe=recipe, feedback=feedback)

    def queue_job(self, base: str, level: str, *, allow_requantize: bool = False, **budget) -> Job:
        job = Job(next(self._ids), base, level, self.app.new_token(), allow_requantize=allow_requantize, **budget)
        self.jobs[job.id] = job
        self._show(job)
        self._queue.put(job)
        with self._lock:
            start = not self._runner_active
            self._runner_active = True
        if start:
            self._runner()
        return job

    def _show(self, job: Job) -> None:
        """Redraw the jobs table (a handful of rows), the cursor kept where it was."""
        t = self.query_one("#quant-jobs", DataTable)
        row = t.cursor_row
        fill(t, [((str(j.id), j.base, j.label, j.status, f"{j.pct:.0f}%", j.reason), str(j.id)) for j in self.jobs.values()])
        t.move_cursor(row=row)

    # -- the runner ----------------------------------------------------------

    @work(thread=True, group="quantize")
    def _runner(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._runner_active = False
                        return
                continue
            self._run_job(job)

    def _run_job(self, job: Job) -> None:
        if job.token.cancelled:
            job.status, job.reason = "cancelled", job.token.reason or "cancelled"
            self.ui(self._show, job)
            self.app.release_token(job.token)
            return
        job.status = "running"
        self.current = job
        self.ui(self._started, job)

        forward = self.progress_to(self._progress_main)

        def on_progress(p: Progress) -> None:
            if p.fraction is not None:
                job.pct = 100.0 * p.fraction
            forward(p)

        if job.level == "budget":
            ok, out = self.run_guarded(
                f"quantize {job.base} → {job.label}",
                budget_form.run_budget,
                job.base,
                job.budget,
                job.exclude,
                job.imatrix,
                job.recipe,
                feedback=job.feedback,
                on_progress=on_progress,
                cancel=job.token,
                token=job.token,
            )
        else:
            ok, out = self.run_guarded(
                f"quantize {job.base} → {job.label}",
                budget_form.run_level,
                job.base,
                job.level,
                job.imatrix,
                allow_requantize=job.allow_requantize,
                on_progress=on_progress,
                cancel=job.token,
                token=job.token,
            )
        self.current = None
        if ok and job.level == "budget":
            res, recipe = out
            job.status, job.pct, job.results = "done", 100.0, [res]
            job.reason = budget_form.describe_budget(res, recipe)
        elif ok:
            job.status, job.pct, job.results = "done", 100.0, out
        else:
            job.status = "cancelled" if job.token.cancelled else "failed"
            job.reason = out
        self.ui(self._finished, job)

    def _started(self, job: Job) -> None:
        self._show(job)
        self.query_one(JobBar).start(f"#{job.id} {job.label}")

    def _progress_main(self, p: Progress) -> None:
        self.query_one(JobBar).update_from(p)
        if self.current is not None:
            self._show(self.current)

    def _finished(self, job: Job) -> None:
        self._show(job)
        self.query_one(JobBar).finish(
            f"#{job.id} {job.status}", complete=job.status == "done", reason=job.reason if job.status == "failed" else ""
        )
        if job.status == "done":
            self.notify(f"quantized {job.base} to {job.label}")
            self.reload()  # the new file is a base to pick (an F16 conversion is the one to search from)
            self.results.extend(job.results)
            fill(
                self.query_one("#quant-results", DataTable),
                [
                    (
                        (
                            r.name,
                            r.level.upper(),
                            human_size(r.size_bytes),
                            f"{r.bpw:.2f}",
                            str(getattr(r, "fallback_tensors", 0)),  # a conversion has none
                            f"{r.seconds:.1f}",
                        ),
                        None,
                    )
                    for r in self.results
                ],
            )

    # -- cancelling ---------------------------------------------------------

    def action_cancel_running(self) -> None:
        if self.current is not None:
            self.current.token.cancel("cancelled by the user")
            self.notify(f"cancelling job #{self.current.id}...")

    def action_cancel_selected(self) -> None:
        key = cursor_key(self.query_one("#quant-jobs", DataTable))
        job = self.jobs.get(int(key)) if key else None
        if job and job.status in ("queued", "running"):
            job.token.cancel("cancelled by the user")
            if job.status == "queued":
                job.status, job.reason = "cancelled", "cancelled by the user"
                self._show(job)
            self.notify(f"cancelling job #{job.id}...")


def budget_form_base(screen: QuantizeScreen) -> str:
    from tui.screens.base import selected_value

    return selected_value(screen.query_one("#quant-base", Select))


# The picker's two fixed choices; the base's stored matrices follow them.
_IMATRIX_FIXED = [("none", budget_form.IMATRIX_NONE), ("auto: stored, else computed", budget_form.IMATRIX_AUTO)]


def _keep_pick(sel: Select, choices: list[tuple[str, str]], default: str) -> None:
    """New options, the pick kept where it is still offered."""
    cur = sel.value
    sel.set_options(choices)
    sel.value = cur if cur in [v for _, v in choices] else default
