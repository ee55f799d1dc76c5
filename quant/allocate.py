"""The per-tensor choice of `--budget`: one type per matrix within a byte limit, by error saved per byte.

Start every matrix at its cheapest candidate, then repeatedly give the bytes to the upgrade with the best
error saved per byte along each matrix's lower convex hull of (bytes, error), until the next would pass
the limit. quant/budget.py supplies the errors (proxy x measured gain) and the limit.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from edgellm.errors import QuantizeError


@dataclass
class Matrix:
    name: str
    rows: int
    cols: int
    options: list[tuple[str, int, float]]  # (type, bytes, weighted error), cheapest first


def hull(options: list[tuple[str, int, float]]) -> list[tuple[str, int, float]]:
    """The options on the lower convex hull of (bytes, error): the only ones a per-byte greedy should visit."""
    pts: list[tuple[str, int, float]] = []
    for o in options:
        if pts and o[2] >= pts[-1][2]:
            continue  # more bytes, no less error
        while len(pts) >= 2:
            (_, b1, e1), (_, b2, e2) = pts[-2], pts[-1]
            if (e1 - e2) * (o[1] - b2) <= (e2 - o[2]) * (b2 - b1):
                pts.pop()  # the middle point is above the line: skipping it saves more per byte
            else:
                break
        pts.append(o)
    return pts


def allocate(mats: list[Matrix], limit: int) -> tuple[dict[str, str], int]:
    """Greedy by error saved per byte along each hull, within `limit` bytes for the matrices."""
    hulls = {m.name: hull(m.options) for m in mats}
    level = {n: 0 for n in hulls}
    used = sum(h[0][1] for h in hulls.values())
    if used > limit:
        raise QuantizeError("budget below the smallest file")  # caught and reworded by the caller
    heap: list[tuple[float, str]] = []
    for n, h in hulls.items():
        if len(h) > 1:
            heapq.heappush(heap, (-(h[0][2] - h[1][2]) / (h[1][1] - h[0][1]), n))
    while heap:
        _gain, n = heapq.heappop(heap)
        h, k = hulls[n], level[n]
        extra = h[k + 1][1] - h[k][1]
        if used + extra > limit:
            continue  # this upgrade does not fit; cheaper ones of other matrices may
        used += extra
        level[n] = k + 1
        if k + 2 < len(h):
            heapq.heappush(heap, (-(h[k + 1][2] - h[k + 2][2]) / (h[k + 2][1] - h[k + 1][1]), n))
    return {n: hulls[n][level[n]][0] for n in hulls}, used


def group_options(ms: list[Matrix]) -> list[tuple[str, int, float]]:
    """A group's (type, bytes, error) summed over its matrices, cheapest first (they share the candidate types)."""
    per: dict[str, list[float]] = {}
    for m in ms:
        for t, b, e in m.options:
            acc = per.setdefault(t, [0, 0.0])
            acc[0] += b
            acc[1] += e
    return sorted(((t, int(b), e) for t, (b, e) in per.items()), key=lambda o: (o[1], o[2]))
