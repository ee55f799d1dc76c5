"""A small scatter plot drawn with text: size (x) against loss (y), one
labelled marker per quant level, or one marker per series when the points
are grouped (llama.cpp's stock levels vs edgellm's own files). One point
may be marked as the recommended one: its own marker and legend entry.
No dependency; it redraws to its size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from rich.text import Text
from textual.widget import Widget

MARKERS = "●■▲◆▼✚"
RECOMMENDED = "★"  # never a series' marker, so the recommended point stands out in any series
_COLORS = ["cyan", "magenta", "yellow", "green", "red", "blue"]
_RECOMMENDED_STYLE = "bold bright_green"


class ScatterPlot(Widget):
    DEFAULT_CSS = "ScatterPlot { height: 12; }"

    def __init__(self, *, x_label: str = "size", y_label: str = "loss", **kw) -> None:
        super().__init__(**kw)
        self.x_label = x_label
        self.y_label = y_label
        self.points: list[tuple[float, float, str]] = []
        self.series: list[str] = []
        self.recommended: Optional[int] = None  # index into points

    def set_points(
        self,
        points: Sequence[tuple[float, float, str]],
        *,
        x_label: str | None = None,
        y_label: str | None = None,
        series: Sequence[str] | None = None,
        recommended: Optional[int] = None,
    ) -> None:
        """`series`, one name per point, gives each group its own marker and colour and one legend entry;
        `recommended`, a point's index, draws that point as ★ with a `recommended` legend entry."""
        self.points = [(float(x), float(y), str(lbl)) for x, y, lbl in points]
        self.series = [str(s) for s in series] if series is not None and len(series) == len(self.points) else []
        self.recommended = recommended if recommended is not None and 0 <= recommended < len(self.points) else None
        if x_label:
            self.x_label = x_label
        if y_label:
            self.y_label = y_label
        self.refresh()

    def _legend(self) -> list[tuple[str, str]]:
        """(text, style) per legend entry: a series each, or a point each; the recommended point last."""
        groups = list(dict.fromkeys(self.series))
        if groups:
            items = [(f"{MARKERS[k % len(MARKERS)]} {g}", _COLORS[k % len(_COLORS)]) for k, g in enumerate(groups)]
        else:
            items = [
                (f"{MARKERS[i % len(MARKERS)]} {lbl}", _COLORS[i % len(_COLORS)])
                for i, (_x, _y, lbl) in enumerate(self.points)
                if i != self.recommended  # it is in the recommended entry, under its own marker
            ]
        if self.recommended is not None:
            items.append((f"{RECOMMENDED} recommended: {self.points[self.recommended][2]}", _RECOMMENDED_STYLE))
        return items

    def render(self) -> Text:
        w, h = self.size.width, self.size.height
        if not self.points:
            return Text(f"{self.y_label} vs {self.x_label}: no results yet", style="dim")
        # The legend wraps to the width (a long one would otherwise be cut off below the plot).
        legend: list[Text] = [Text(f" {self.y_label}: ", style="dim")]
        for text, style in self._legend():
            if legend[-1].cell_len > 1 and legend[-1].cell_len + len(text) > w:
                legend.append(Text(" "))
            legend[-1].append(text + "  ", style=style)
        y_ax = 9  # room for the y tick labels
        pw, ph = max(10, w - y_ax - 1), max(3, h - 2 - len(legend))
        xs = [p[0] for p in self.points]
        ys = [p[1] for p in self.points]
        x0, x1 = min(xs), max(xs)
        y0, y1 = min(0.0, min(ys)), max(ys)
        if x1 == x0:
            x0, x1 = x0 * 0.9, x1 * 1.1 + 1e-9
        if y1 == y0:
            y1 = y0 + 1.0
        grid = [[" "] * pw for _ in range(ph)]
        styles = [[""] * pw for _ in range(ph)]
        groups = list(dict.fromkeys(self.series))
        cells = []
        for i, (x, y, lbl) in enumerate(self.points):
            cx = round((x - x0) / (x1 - x0) * (pw - 1))
            cy = ph - 1 - round((y - y0) / (y1 - y0) * (ph - 1))
            k = groups.index(self.series[i]) if groups else i
            if i == self.recommended:
                cells.append((cx, cy, lbl, RECOMMENDED, _RECOMMENDED_STYLE))
            else:
                cells.append((cx, cy, lbl, MARKERS[k % len(MARKERS)], _COLORS[k % len(_COLORS)]))
        # Markers first (the recommended one last: on top of a point at the same cell), then the
        # labels into the blank cells right of them (the recommended one's first: it is never crowded out).
        rec = [cells[self.recommended]] if self.recommended is not None else []
        others = [c for i, c in enumerate(cells) if i != self.recommended]
        for cx, cy, _lbl, m, c in others + rec:
            grid[cy][cx], styles[cy][cx] = m, c
        for cx, cy, lbl, _m, c in rec + others:
            # right of the point; left of it where the right edge would cut the label (the largest file)
            start = cx + 2 if cx + 2 + len(lbl) <= pw or cx - 1 - len(lbl) < 0 else cx - 1 - len(lbl)
            for j, ch in enumerate(lbl[: max(0, pw - start)]):
                if grid[cy][start + j] == " ":
                    grid[cy][start + j], styles[cy][start + j] = ch, (c if c == _RECOMMENDED_STYLE else "dim " + c)
        out = Text()
        for r in range(ph):
            if r == 0:
                tick = _fmt(y1)
            elif r == ph - 1:
                tick = _fmt(y0)
            else:
                tick = ""
            out.append(f"{tick:>{y_ax - 1}} │", style="dim")
            for cch, st in zip(grid[r], styles[r], strict=False):
                out.append(cch, style=st or None)
            out.append("\n")
        out.append(" " * (y_ax - 1) + " └" + "─" * pw + "\n", style="dim")
        lo, hi = _fmt(x0), _fmt(x1)
        axis = f"{lo}{self.x_label:^{max(1, pw - len(lo) - len(hi))}}{hi}"
        out.append(" " * (y_ax + 1) + axis[:pw], style="dim")
        for line in legend:
            out.append("\n")
            out.append_text(line)
        return out


def _fmt(v: float) -> str:
    a = abs(v)
    if a >= 1000:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.1:
        return f"{v:.2f}"
    return f"{v:.3f}"
