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
import time
from dataclasses import dataclass, field
from typing import Optional

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, DataTable, Input, Label, Select, Static

from edgellm.fsutil import human_size
from edgellm.progress import CancelToken, Progress
from quant.levels import all_levels
from quant.quantize import QuantizeResult, quantize
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
    imatrix: str = budget_form.IMATRIX_AUTO

    @property
    def label(self) -> str:
        return f"BUDGET {self.budget}" if self.budget else self.level.upper()


def offered_levels() -> list[str]:
    """The levels quant.levels says edgellm can produce (imatrix ones left out)."""
    keys = [lv.key for lv in all_levels(usable_only=True)]
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
            with Vertical(id="quant-form", classes="form"):
                yield Label("Base model")
                yield Select([], prompt="(no models)", id="quant-base", allow_blank=True)
                yield Label("Levels  [dim](space toggles)[/]")
                yield CheckList(*[(lv.upper(), lv, lv in DEFAULT_PICKS) for lv in offered_levels()], id="quant-levels")
                yield CheckBox("Allow requantize", id="quant-requant")
                with Vertical(id="quant-budget-box"):
                    yield Label("Size budget  [dim](100MB, 4.5bpw, ram)[/]")
                    yield Input("", placeholder="e.g. 88MB", id="quant-budget")
                    yield Static("", id="quant-budget-err", markup=False)
                    yield Static("", id="quant-ram", markup=False)
                    yield Label("Exclude types  [dim](comma-separated)[/]")
                    yield Input("", placeholder="e.g. q4_1", id="quant-exclude")
                    yield Static("", id="quant-exclude-why", markup=False)
                    yield Label("Importance matrix")
                    yield Select(
                        [("auto: stored, else compute now on the shipped text", budget_form.IMATRIX_AUTO)],
                        id="quant-imatrix",
                        allow_blank=False,
                    )
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

    # -- the mode: levels, or a size budget -----------------------------------

    mode = "levels"

    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        budget = mode == "budget"
        self.query_one("#quant-budget-box").display = budget
        self.query_one("#quant-levels").display = not budget
        self.query_one("#quant-requant").display = not budget
        if budget:
            self._budget_hints()

    def action_toggle_mode(self) -> None:
        self._set_mode("levels" if self.mode == "budget" else "budget")

    def _budget_hints(self) -> None:
        """The RAM figure beside the field and the base's own source type pre-ticked (read in a worker)."""
        base = budget_form_base(self)
        if base:
            self.in_background(
                "budget hints",
                lambda: (budget_form.ram_hint(base), budget_form.dequantized_from(base)),
                self._show_hints,
                group="hints",
            )

    def _show_hints(self, hints: tuple[str, str]) -> None:
        ram, src = hints
        self.query_one("#quant-ram", Static).update(ram)
        why = ""
        if src:
            box = self.query_one("#quant-exclude", Input)
            if src.lower() not in [t.lower() for t in budget_form.exclude_list(box.value)]:
                box.value = ",".join([*budget_form.exclude_list(box.value), src.lower()])
            why = f"{src.upper()} excluded: this base was dequantized from it"
        self.query_one("#quant-exclude-why", Static).update(why)

    def reload(self) -> None:
        set_choices(self.query_one("#quant-base", Select), [m.name for m in self.store_models()])
        self.in_background("importance matrices", _imatrix_choices, self._show_imatrices, group="imatrix")

    def _show_imatrices(self, choices: list[tuple[str, str]]) -> None:
        sel = self.query_one("#quant-imatrix", Select)
        cur = sel.value
        sel.set_options(choices)
        sel.value = cur if cur in [v for _, v in choices] else budget_form.IMATRIX_AUTO

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
            self.queue_job(str(base), lv, allow_requantize=requant)

    def _queue_budget(self) -> None:
        base = self.picked("#quant-base", "pick a base model first (an F16 conversion)")
        if not base:
            return
        budget = self.query_one("#quant-budget", Input).value.strip()
        exclude = budget_form.exclude_list(self.query_one("#quant-exclude", Input).value)
        # The core's own check, with the CLI's line under the field; a bad budget starts nothing.
        err = budget_form.budget_error(str(base), budget, exclude)
        self.query_one("#quant-budget-err", Static).update(err or "")
        if err:
            return
        imatrix = self.query_one("#quant-imatrix", Select).value
        self.queue_job(
            str(base),
            "budget",
            budget=budget,
            exclude=exclude,
            imatrix=imatrix if isinstance(imatrix, str) else budget_form.IMATRIX_AUTO,
        )

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

        if job.budget:
            ok, out = self.run_guarded(
                f"quantize {job.base} → {job.label}",
                budget_form.run_budget,
                job.base,
                job.budget,
                job.exclude,
                job.imatrix,
                on_progress=on_progress,
                cancel=job.token,
                token=job.token,
            )
        else:
            ok, out = self.run_guarded(
                f"quantize {job.base} → {job.label}",
                quantize,
                job.base,
                [job.level],
                allow_requantize=job.allow_requantize,
                on_progress=on_progress,
                cancel=job.token,
                token=job.token,
            )
        self.current = None
        if ok and job.budget:
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
                            str(r.fallback_tensors),
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


def _imatrix_choices() -> list[tuple[str, str]]:
    """auto, the stored matrices (name, text, tokens, date), none: read in a worker (it lists the store's folder)."""
    from quant.imatrix import list_imatrices

    out = [("auto: stored, else compute now on the shipped text", budget_form.IMATRIX_AUTO)]
    for rec in list_imatrices():
        day = time.strftime("%Y-%m-%d", time.localtime(rec.created))
        out.append((f"{rec.name}  {rec.text}  {rec.tokens} tok  {day}", rec.name))
    return out
