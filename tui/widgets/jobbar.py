"""One line for a running job: what it is, a progress bar, amount, rate, ETA;
and, under it, why the last job failed, until the next one starts."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar, Static

from edgellm.progress import Progress, format_amount, stage_of


def describe(p: Progress) -> str:
    parts = [stage] if (stage := stage_of(p)) else []  # a job of several stages says which one runs
    if p.total:
        parts.append(
            f"{format_amount(p.done, p.unit)}/{format_amount(p.total, p.unit)} {p.unit if p.unit != 'B' else ''}".rstrip()
        )
    elif p.done:
        parts.append(f"{format_amount(p.done, p.unit)} {p.unit}".rstrip())
    if p.rate:
        parts.append(f"{format_amount(p.rate, p.unit)}/s" if p.unit == "B" else f"{p.rate:.1f} {p.unit}/s")
    eta = p.eta_seconds
    if eta is not None and (p.fraction or 0) < 1:
        parts.append(f"ETA {int(eta) // 60}:{int(eta) % 60:02d}")
    if p.message:
        parts.append(p.message)
    return "  ".join(parts)


class JobBar(Vertical):
    """Idle until `start()`; `update_from(progress)` as events arrive; `finish()`.

    A failed job's reason stays on the line below the bar (a notification is
    gone in seconds) until `start()` begins the next job."""

    def __init__(self, idle: str = "no job running", **kw) -> None:
        super().__init__(**kw)
        self.idle = idle
        self.running = False
        self.reason = ""

    def compose(self) -> ComposeResult:
        with Horizontal(classes="job-line"):
            yield Label(self.idle, classes="job-task")
            yield ProgressBar(total=100, show_eta=False, classes="job-bar")
            yield Label("", classes="job-detail")
        yield Static("", classes="job-reason", markup=False)

    @property
    def bar(self) -> ProgressBar:
        return self.query_one(ProgressBar)

    def start(self, task: str) -> None:
        self.running = True
        self._reason("")
        self.query_one(".job-task", Label).update(task)
        self.query_one(".job-detail", Label).update("starting...")
        self.bar.update(total=None, progress=0)

    def update_from(self, p: Progress) -> None:
        if p.total:
            self.bar.update(total=p.total, progress=p.done)
        self.query_one(".job-detail", Label).update(describe(p))

    def finish(self, text: str, *, complete: bool = True, reason: str = "") -> None:
        """`reason`: why the job failed, shown in full under the bar."""
        self.running = False
        if complete:
            total = self.bar.total or 100
            self.bar.update(total=total, progress=total)
        elif self.bar.total is None:  # stopped before any progress: an empty bar, not a pulsing one
            self.bar.update(total=100, progress=0)
        self.query_one(".job-detail", Label).update(text)
        self._reason(reason)

    def _reason(self, text: str) -> None:
        self.reason = text
        line = self.query_one(".job-reason", Static)
        line.update(f"✗ {text}" if text else "")
        line.display = bool(text)
