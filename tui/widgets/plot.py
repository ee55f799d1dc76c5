"""A small scatter plot drawn with text: size (x) against loss (y), one
labelled marker per quant level, or one marker per series when the points
are grouped (llama.cpp's stock levels vs edgellm's own files). No
dependency; it redraws to its size."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widget import Widget

MARKERS = "●■▲◆★✚"


class ScatterPlot(Widget):
    DEFAULT_CSS = "ScatterPlot { height: 12; }"

    def __init__(self, *, x_label: str = "size", y_label: str = "loss", **kw) -> None:
        super().__init__(**kw)
        self.x_label = x_label
        self.y_label = y_label
        self.points: list[tuple[float, float, str]] = []
        self.series: list[str] = []

    def set_points(
        self,
        points: Sequence[tuple[float, float, str]],
        *,
        x_label: str | None = None,
        y_label: str | None = None,
        series: Sequence[str] | None = None,
    ) -> None:
        """`series`, one name per point, gives each group its own marker and colour and one legend entry."""
        self.points = [(float(x), float(y), str(lbl)) for x, y, lbl in points]
        self.series = [str(s) for s in series] if series is not None and len(series) == len(self.points) else []
        if x_label:
            self.x_label = x_label
        if y_label:
            self.y_label = y_label
        self.refresh()

    def render(self) -> Text:
        w, h = self.size.width, self.size.height
        if not self.points:
            return Text(f"{self.y_label} vs {self.x_label}: no results yet", style="dim")
        y_ax = 9  # room for the y tick labels
        pw, ph = max(10, w - y_ax - 1), max(3, h - 3)
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
        colors = ["cyan", "magenta", "yellow", "green", "red", "blue"]
        legend = Text()
        groups = list(dict.fromkeys(self.series))
        for i, (x, y, lbl) in enumerate(self.points):
            cx = round((x - x0) / (x1 - x0) * (pw - 1))
            cy = ph - 1 - round((y - y0) / (y1 - y0) * (ph - 1))
            k = groups.index(self.series[i]) if groups else i
            m, c = MARKERS[k % len(MARKERS)], colors[k % len(colors)]
            grid[cy][cx], styles[cy][cx] = m, c
            for j, ch in enumerate(lbl[: max(0, pw - cx - 2)]):
                if grid[cy][cx + 2 + j] == " ":
                    grid[cy][cx + 2 + j], styles[cy][cx + 2 + j] = ch, "dim " + c
            if not groups:
                legend.append(f"{m} {lbl}  ", style=c)
        for k, g in enumerate(groups):
            legend.append(f"{MARKERS[k % len(MARKERS)]} {g}  ", style=colors[k % len(colors)])
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
        out.append(f"\n {self.y_label}: ", style="dim")
        out.append_text(legend)
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
