"""A dependency-free bar chart PNG (numpy + zlib), for `edgellm bench --plot`.

Used when matplotlib is not installed, which is the default: edgellm does not
pull a plotting stack in for one picture. One panel per test (pp, tg: their
scales differ by an order of magnitude), one bar per model with its ± sd
whisker, the value above it and the label below, in a 3x5 pixel font.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

# 3x5 glyphs, rows top to bottom, 3 bits each (4 = left pixel).
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 3, 1, 7), "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 2, 2), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
    "A": (2, 5, 7, 5, 5), "B": (6, 5, 6, 5, 6), "C": (3, 4, 4, 4, 3), "D": (6, 5, 5, 5, 6), "E": (7, 4, 6, 4, 7),
    "F": (7, 4, 6, 4, 4), "G": (3, 4, 5, 5, 3), "H": (5, 5, 7, 5, 5), "I": (7, 2, 2, 2, 7), "J": (1, 1, 1, 5, 2),
    "K": (5, 5, 6, 5, 5), "L": (4, 4, 4, 4, 7), "M": (5, 7, 7, 5, 5), "N": (6, 5, 5, 5, 5), "O": (2, 5, 5, 5, 2),
    "P": (6, 5, 6, 4, 4), "Q": (2, 5, 5, 6, 3), "R": (6, 5, 6, 5, 5), "S": (3, 4, 2, 1, 6), "T": (7, 2, 2, 2, 2),
    "U": (5, 5, 5, 5, 7), "V": (5, 5, 5, 5, 2), "W": (5, 5, 7, 7, 5), "X": (5, 5, 2, 5, 5), "Y": (5, 5, 2, 2, 2),
    "Z": (7, 1, 2, 4, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0), "_": (0, 0, 0, 0, 7), ":": (0, 2, 0, 2, 0),
    "/": (1, 1, 2, 4, 4), "%": (5, 1, 2, 4, 5), " ": (0, 0, 0, 0, 0), "+": (0, 2, 7, 2, 0), "(": (1, 2, 2, 2, 1),
    ")": (4, 2, 2, 2, 4),
}
_COLORS = [(66, 133, 244), (234, 67, 53), (52, 168, 83), (251, 188, 5)]
_SCALE = 2


def _text(img: np.ndarray, x: int, y: int, s: str, color=(40, 40, 40), *, center: bool = False) -> None:
    s = s.upper()
    w = len(s) * 4 * _SCALE
    if center:
        x -= w // 2
    for i, ch in enumerate(s):
        rows = _FONT.get(ch, _FONT[" "])
        for r, bits in enumerate(rows):
            for c in range(3):
                if bits & (4 >> c):
                    x0, y0 = x + (i * 4 + c) * _SCALE, y + r * _SCALE
                    if 0 <= y0 and y0 + _SCALE <= img.shape[0] and 0 <= x0 and x0 + _SCALE <= img.shape[1]:
                        img[y0:y0 + _SCALE, x0:x0 + _SCALE] = color


def _rect(img: np.ndarray, x0: int, y0: int, x1: int, y1: int, color) -> None:
    h, w = img.shape[:2]
    x0, x1 = max(0, min(x0, x1)), min(w, max(x0, x1))
    y0, y1 = max(0, min(y0, y1)), min(h, max(y0, y1))
    img[y0:y1, x0:x1] = color


def encode_png(img: np.ndarray) -> bytes:
    """RGB uint8 array (h, w, 3) → PNG bytes."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def bar_chart_png(labels: list[str], series: dict[str, list[tuple[float, float]]], *, title: str = "") -> bytes:
    """One panel per series key; `series[test][i]` is (value, sd) for `labels[i]`."""
    bar_w, gap, top, bottom, left = 36, 54, 40, 70, 20
    panel_w = left + len(labels) * (bar_w + gap) + gap
    plot_h = 220
    width, height = max(200, panel_w * max(1, len(series))), top + plot_h + bottom
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    for p, (test, vals) in enumerate(series.items()):
        x_base = p * panel_w + left
        vmax = max((v + s for v, s in vals), default=0.0) * 1.15 or 1.0
        y_axis = top + plot_h
        _rect(img, x_base, top, x_base + 1, y_axis, (120, 120, 120))
        _rect(img, x_base, y_axis, x_base + panel_w - left, y_axis + 1, (120, 120, 120))
        _text(img, x_base + (panel_w - left) // 2, 8, f"{test} {title}".strip(), center=True)
        color = _COLORS[p % len(_COLORS)]
        for i, (v, sd) in enumerate(vals):
            x0 = x_base + gap + i * (bar_w + gap)
            y_top = y_axis - int(plot_h * v / vmax)
            _rect(img, x0, y_top, x0 + bar_w, y_axis, color)
            if sd > 0:
                y_hi, y_lo = y_axis - int(plot_h * (v + sd) / vmax), y_axis - int(plot_h * max(0.0, v - sd) / vmax)
                cx = x0 + bar_w // 2
                _rect(img, cx, y_hi, cx + 1, y_lo + 1, (30, 30, 30))
                _rect(img, cx - 5, y_hi, cx + 6, y_hi + 1, (30, 30, 30))
                _rect(img, cx - 5, y_lo, cx + 6, y_lo + 1, (30, 30, 30))
            _text(img, x0 + bar_w // 2, max(top - 14, y_top - 14 if sd <= 0 else y_axis - int(plot_h * (v + sd) / vmax) - 14),
                  f"{v:.1f}", center=True)
            label = labels[i]
            for k, part in enumerate([label[j:j + 10] for j in range(0, min(len(label), 30), 10)]):
                _text(img, x0 + bar_w // 2, y_axis + 8 + k * 14, part, center=True)
    return encode_png(img)
