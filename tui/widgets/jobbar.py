"""One line for a running job: what it is, a progress bar, amount, rate, ETA."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from edgellm.progress import Progress, format_amount


def describe(p: Progress) -> str:
    parts = []
    if p.total:
        parts.append(f"{format_amount(p.done, p.unit)}/{format_amount(p.total, p.unit)} {p.unit if p.unit != 'B' else ''}".rstrip())
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


class JobBar(Horizontal):
    """Idle until `start()`; `update_from(progress)` as events arrive; `finish()`."""

    def __init__(self, idle: str = "no job running", **kw) -> None:
        super().__init__(**kw)
        self.idle = idle
        self.running = False

    def compose(self) -> ComposeResult:
        yield Label(self.idle, classes="job-task")
        yield ProgressBar(total=100, show_eta=False, classes="job-bar")
        yield Label("", classes="job-detail")

    @property
    def bar(self) -> ProgressBar:
        return self.query_one(ProgressBar)

    def start(self, task: str) -> None:
        self.running = True
        self.query_one(".job-task", Label).update(task)
        self.query_one(".job-detail", Label).update("starting...")
        self.bar.update(total=None, progress=0)

    def update_from(self, p: Progress) -> None:
        if p.total:
            self.bar.update(total=p.total, progress=p.done)
        self.query_one(".job-detail", Label).update(describe(p))

    def finish(self, text: str, *, complete: bool = True) -> None:
        self.running = False
        if complete:
            total = self.bar.total or 100
            self.bar.update(total=total, progress=total)
        self.query_one(".job-detail", Label).update(text)
