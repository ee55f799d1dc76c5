"""Evaluate: run the all-level quality evaluation (quant.evaluate) with
progress and cancel; the results table, a size-vs-loss chart, and the
recommendation for this machine. Saved results are shown on arrival."""

from __future__ import annotations

import logging
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, DataTable, Input, Select, Static

from edgellm.fsutil import human_size
from edgellm.progress import Progress

from tui.widgets.jobbar import JobBar
from tui.widgets.plot import ScatterPlot
from tui.screens.base import BaseScreen, call_with_supported, core, selected_value
from tui.screens.quantize_screen import _as_dict

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
        self.rows: list[dict] = []
        self.metric = "kld_mean"

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        with Horizontal(id="eval-form", classes="form-row"):
            yield Select([], prompt="base model", id="eval-base", allow_blank=True)
            yield Input("q4_0,q4_k_m,q5_k_m,q8_0", placeholder="levels", id="eval-levels")
            yield Input("", placeholder="text file (blank: built-in)", id="eval-text")
            yield Input("4", placeholder="chunks", id="eval-chunks", type="integer")
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
        from edgellm.models.store import Store

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
        self.show_saved("quant.evaluate", "load_eval_results")

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
        chunks = int(chunks_s) if chunks_s.isdigit() and int(chunks_s) > 0 else None
        self.token = self.app.new_token()
        self.query_one(JobBar).start(f"eval {base}")
        self._eval(str(base), levels, text, chunks, self.token)

    @work(thread=True, group="evaluate", exclusive=True)
    def _eval(self, base: str, levels: list[str], text, chunks, token) -> None:
        def call():
            evaluate = core("quant.evaluate", "evaluate")
            kw: dict[str, Any] = dict(on_progress=self.progress_to(self._progress), cancel=token)
            if text:
                kw["text"] = text
            else:  # the placeholder promises the built-in corpus
                kw["corpus"] = core("quant.perplexity", "BUILTIN_CORPUS")
            if chunks:
                kw["chunks"] = chunks
            return call_with_supported(evaluate, base, levels, **kw)

        ok, res = self.run_guarded(f"evaluate {base}", call, token=token)
        self.ui(self._done, res if ok else None, ok)

    def _progress(self, p: Progress) -> None:
        self.query_one(JobBar).update_from(p)

    def _done(self, res: Any, ok: bool) -> None:
        self.token = None
        self.query_one(JobBar).finish("evaluation done" if ok else "evaluation failed or cancelled", complete=ok)
        if ok and res is not None:
            self.show_results(res)
            self.notify("evaluation done")

    def action_cancel(self) -> None:
        if self.token is not None:
            self.token.cancel("cancelled by the user")
            self.notify("cancelling the evaluation...")

    # -- rendering ------------------------------------------------------------

    def show_results(self, res: Any) -> None:
        rows, source = _rows(res)
        self.rows = rows
        t = self.query_one("#eval-results", DataTable)
        t.clear()
        for d in rows:
            t.add_row(
                str(d.get("level", "?")).upper(), human_size(d.get("size_bytes") or 0), _f(d.get("ppl"), 3),
                _f(d.get("dppl_pct"), 2, signed=True), _f(d.get("kld_mean"), 4), _f(_pct(d.get("same_top_p")), 1),
                _f(d.get("tokens_per_second") or d.get("eval_tokens_per_second") or d.get("speed"), 0),
            )
        self.query_one("#eval-source", Static).update(f"[dim]{source}[/]" if source else "")
        self._plot()
        self._recommend()

    def _plot(self) -> None:
        label = "mean KLD" if self.metric == "kld_mean" else "ΔPPL %"
        pts = [((d.get("size_bytes") or 0) / 1e6, d.get(self.metric) or 0.0, str(d.get("level", "?")).upper()) for d in self.rows if d.get(self.metric) is not None]
        self.query_one(ScatterPlot).set_points(pts, y_label=label)

    def action_toggle_metric(self) -> None:
        self.metric = "dppl_pct" if self.metric == "kld_mean" else "kld_mean"
        self._plot()

    def _recommend(self) -> None:
        box = self.query_one("#eval-rec", Static)
        try:
            recommend = core("quant.evaluate", "recommend")
            rec = recommend()
        except Exception as e:
            box.update(f"Recommendation: {e}")
            return
        box.update("Recommendation: " + _describe_rec(rec))


def _rows(res: Any) -> tuple[list[dict], str]:
    """Per-level dicts from whatever the evaluation returned or saved."""
    if res is None:
        return [], ""
    if isinstance(res, (list, tuple)):
        if res and not isinstance(res[0], dict) and hasattr(res[0], "levels"):
            res = res[-1]  # several saved reports: the latest
        else:
            return [_as_dict(r) for r in res], ""
    d = _as_dict(res) if not isinstance(res, dict) else res
    levels = d.get("levels") or d.get("results") or []
    if isinstance(levels, dict):
        levels = list(levels.values())
    source = ", ".join(f"{k} {d[k]}" for k in ("base", "corpus", "ctx", "chunks") if d.get(k) is not None)
    return [_as_dict(x) for x in levels], source


def _describe_rec(rec: Any) -> str:
    if rec is None:
        return "no saved evaluation fits this machine"
    d = _as_dict(rec) if not isinstance(rec, str) else {"text": rec}
    if "text" in d:
        return d["text"]
    best = d.get("best") or d
    bd = _as_dict(best) if not isinstance(best, dict) else best
    parts = [str(bd.get("name") or bd.get("level") or "?")]
    if bd.get("kld_mean") is not None:
        parts.append(f"KLD {bd['kld_mean']:.4f}")
    if bd.get("dppl_pct") is not None:
        parts.append(f"ΔPPL {bd['dppl_pct']:+.2f}%")
    if bd.get("size_bytes"):
        parts.append(human_size(bd["size_bytes"]))
    ru = d.get("runner_up")
    if ru:
        rd = _as_dict(ru) if not isinstance(ru, dict) else ru
        parts.append(f"(runner-up {rd.get('name') or rd.get('level')})")
    return "  ".join(parts)


def _pct(v: Any) -> Any:
    if v is None:
        return None
    return v * 100 if v <= 1.0 else v


def _f(v: Any, nd: int, *, signed: bool = False) -> str:
    if v is None:
        return "-"
    try:
        return f"{float(v):+.{nd}f}" if signed else f"{float(v):.{nd}f}"
    except (TypeError, ValueError):
        return str(v)
