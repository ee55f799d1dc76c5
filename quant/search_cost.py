"""What a `--budget` search will cost before it runs: the importance matrix it
would use (stored, or computed first), how many of its probes are cached for
that base and matrix, and how long the searches this machine already ran
suggest it takes.

The estimate is only ever taken from this machine's own saved recipes (their
search seconds, probe seconds and probe counts), never from a constant: the
cost of a probe differs ~4x between the CPUs these tools run on. With no
search on record for the base there is no figure, and the line says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from edgellm.errors import EdgeLLMError
from edgellm.fsutil import sha256_file
from edgellm.models.store import Store
from quant import rounding, sensitivity
from quant.imatrix import ImatrixRecord, get_imatrix, model_sha256, stored_for
from quant.recipe import list_recipes, load_recipe, resolve_base


@dataclass(frozen=True)
class SearchCost:
    imatrix: Optional[str]  # the stored matrix the search would use; None: one is computed first
    probes_cached: int
    estimate_seconds: Optional[float]
    basis: str  # the past search the estimate scales, or why there is none

    def describe(self) -> str:
        parts = [
            f"matrix {self.imatrix}" if self.imatrix else "matrix: computed first on the shipped text",
            f"{self.probes_cached} probes cached" if self.probes_cached else "no probes cached",
        ]
        if self.estimate_seconds is not None:
            parts.append(f"search ~{_duration(self.estimate_seconds)} ({self.basis})")
        else:
            parts.append(f"time unknown: {self.basis}")
        return "; ".join(parts)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _matrix(ref: str, sha: str) -> Optional[ImatrixRecord]:
    """The stored matrix `--imatrix ref` resolves to for this base (auto: its newest), None when auto computes one."""
    if ref in ("", "auto"):
        return next(iter(stored_for(sha)), None)
    return get_imatrix(ref)


def search_cost(base: str, imatrix: str = "auto", *, store: Optional[Store] = None) -> SearchCost:
    """The cost of `quantize BASE --budget ... --imatrix IMATRIX`, from what is stored; reads, never measures."""
    src = resolve_base(base, store or Store())
    model_sha = model_sha256(src.resolved)
    matrix = _matrix(imatrix, model_sha)
    cached = 0
    if matrix is not None:
        cached = len(sensitivity.load_results(sensitivity.cache_key(model_sha, sha256_file(matrix.path), rounding.BUDGET)))
    for saved in list_recipes():  # newest first: the latest search of this base on this machine
        if saved.model != src.label:
            continue
        try:
            past = load_recipe(saved.path)
            cal, search_s = past.calibration, float(past.search_seconds)
            measured, before, probe_s = int(cal["probes_measured"]), int(cal["probes_cached"]), float(cal["probe_seconds"])
        except (EdgeLLMError, KeyError, TypeError, ValueError):
            continue
        if measured <= 0:
            continue  # a fully cached search says nothing about a probe's cost
        per_probe = probe_s / measured
        todo = max(0, measured + before - cached)
        estimate = max(0.0, search_s - probe_s) + per_probe * todo
        return SearchCost(
            matrix.name if matrix else None, cached, estimate, f"{todo} probes at {per_probe:.1f} s, as in {saved.path.stem}"
        )
    return SearchCost(matrix.name if matrix else None, cached, None, "no search of this base on this machine yet")
