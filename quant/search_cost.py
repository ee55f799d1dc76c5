"""What a `--budget` search will cost before it runs: the importance matrix it
would use (stored, or computed first), how many of its probes are cached for
that base and matrix, and how long the searches this machine already ran
suggest it takes, with the error feedback that follows by default (as the
base's last fed-back job took it).

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
from quant.recipe import Recipe, list_recipes, load_recipe, resolve_base


@dataclass(frozen=True)
class SearchCost:
    imatrix: Optional[str]  # the stored matrix the search would use; None: one is computed first
    probes_cached: int
    estimate_seconds: Optional[float]
    basis: str  # the past search the estimate scales, or why there is none
    # error feedback after the search (--budget's default), as this base's last fed-back job took it; None: none yet
    feedback_seconds: Optional[float] = None
    feedback_basis: str = ""

    def describe(self) -> str:
        parts = [
            f"matrix {self.imatrix}" if self.imatrix else "matrix: computed first on the shipped text",
            f"{self.probes_cached} probes cached" if self.probes_cached else "no probes cached",
        ]
        if self.estimate_seconds is not None:
            parts.append(f"search ~{_duration(self.estimate_seconds)} ({self.basis})")
        else:
            parts.append(f"time unknown: {self.basis}")
        if self.feedback_seconds is not None:
            parts.append(f"then error feedback ~{_duration(self.feedback_seconds)} ({self.feedback_basis})")
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
    mine = _recipes_of(src.label)
    feedback = _feedback(mine, model_sha)
    for name, past in mine:
        try:
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
            matrix.name if matrix else None, cached, estimate, f"{todo} probes at {per_probe:.1f} s, as in {name}",
            *feedback,
        )  # fmt: skip
    return SearchCost(matrix.name if matrix else None, cached, None, "no search of this base on this machine yet", *feedback)


def _recipes_of(label: str) -> list[tuple[str, Recipe]]:
    """This base's saved recipes on this machine (name, recipe), newest first, each read once."""
    out = []
    for saved in list_recipes():
        if saved.model != label:
            continue
        try:
            out.append((saved.path.stem, load_recipe(saved.path)))
        except EdgeLLMError:
            continue  # removed or rewritten since it was listed
    return out


def _feedback(mine: list[tuple[str, Recipe]], model_sha: str) -> tuple[Optional[float], str]:
    """Error feedback's seconds as the newest fed-back job of this base took them: its pass and rewrite, and its
    tokens only if they are not cached now (quant/selfgen.py keeps them for the next job)."""
    for name, past in mine:
        try:
            fs = {k: float(v) for k, v in past.feedback_seconds.items()}
        except (TypeError, ValueError, AttributeError):
            continue
        if not past.feedback or not fs.get("passes"):
            continue  # plain, or nothing fed back: says nothing about feedback's cost
        seconds = fs.get("inputs", 0.0) + fs.get("rewrite", 0.0)
        if fs.get("sequences") and not fs.get("tokens_cached"):
            from quant.selfgen import tokens_kept  # numpy and llama_cpp: only once a fed-back job is on record

            seconds += 0.0 if tokens_kept(model_sha, int(fs["sequences"])) else fs.get("tokens", 0.0)
        return seconds, f"as in {name}"
    return None, ""
