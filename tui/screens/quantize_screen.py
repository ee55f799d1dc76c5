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
from typing import Optional

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, DataTable, Label, Select

from edgellm.fsutil import human_size
from edgellm.progress import CancelToken, Progress
from quant.levels import all_levels
from quant.quantize import QuantizeResult, quantize

from tui.widgets.checklist import CheckBox, CheckList
from tui.widgets.fields import set_choices
from tui.widgets.jobbar import JobBar
from tui.widgets.tables import fill
from tui.screens.base import REFRESH, BaseScreen

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


def offered_levels() -> list[str]:
    """The levels quant.levels says edgellm can produce (imatrix ones left out)."""
    keys = [lv.key for lv in all_levels(usable_only=True)]
    first = [k for k in FIRST_LEVELS if k in keys]
    return first + [k for k in keys if k not in first]


class QuantizeScreen(BaseScreen):
    MODE = "quantize"
    BINDINGS = [
        Binding("a", "queue", "Queue jobs"),
        Binding("x", "cancel_selected", "Cancel job"),
        Binding("escape", "cancel_running", "Cancel running"),
        REFRESH,
    ]
    BUTTONS = {"quant-go": "queue"}

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._queue: "queue.Queue[Job]" = queue.Queue()
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
        self.action_refresh()

    def reload(self) -> None:
        set_choices(self.query_one("#quant-base", Select), [m.name for m in self.store_models()])

    # -- queueing ----------------------------------------------------------

    def action_queue(self) -> None:
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

    def queue_job(self, base: str, level: str, *, allow_requantize: bool = False) -> Job:
        job = Job(next(self._ids), base, level, self.app.new_token(), allow_requantize=allow_requantize)
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
        fill(t, [((str(j.id), j.base, j.level.upper(), j.status, f"{j.pct:.0f}%", j.reason), str(j.id)) for j in self.jobs.values()])
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

        ok, out = self.run_guarded(
            f"quantize {job.base} → {job.level.upper()}", quantize, job.base, [job.level],
            allow_requantize=job.allow_requantize, on_progress=on_progress, cancel=job.token, token=job.token,
        )
        self.current = None
        if ok:
            job.status, job.pct, job.results = "done", 100.0, out
        else:
            job.status = "cancelled" if job.token.cancelled else "failed"
            job.reason = out
        self.ui(self._finished, job)

    def _started(self, job: Job) -> None:
        self._show(job)
        self.query_one(JobBar).start(f"#{job.id} {job.level.upper()}")

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
            self.notify(f"quantized {job.base} to {job.level.upper()}")
            self.results.extend(job.results)
            fill(self.query_one("#quant-results", DataTable), [
                ((r.name, r.level.upper(), human_size(r.size_bytes), f"{r.bpw:.2f}", str(r.fallback_tensors), f"{r.seconds:.1f}"), None)
                for r in self.results
            ])

    # -- cancelling ---------------------------------------------------------

    def action_cancel_running(self) -> None:
        if self.current is not None:
            self.current.token.cancel("cancelled by the user")
            self.notify(f"cancelling job #{self.current.id}...")

    def action_cancel_selected(self) -> None:
        t = self.query_one("#quant-jobs", DataTable)
        if not t.row_count:
            return
        key = t.coordinate_to_cell_key((t.cursor_row, 0)).row_key.value
        job = self.jobs.get(int(key)) if key else None
        if job and job.status in ("queued", "running"):
            job.token.cancel("cancelled by the user")
            if job.status == "queued":
                job.status, job.reason = "cancelled", "cancelled by the user"
                self._show(job)
            self.notify(f"cancelling job #{job.id}...")

