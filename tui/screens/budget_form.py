"""The Quantize screen's "size budget" mode: checking what was typed with the
core's own rules, and running the search, so the screen holds only widgets.

The budget field takes what `quantize --budget` takes; a bad one is refused
by quant.budget's parse_budget/check_budget (never a second copy of the
rule) with the line the CLI prints, and nothing starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from edgellm.errors import EdgeLLMError
from edgellm.fsutil import human_size
from edgellm.models.store import Store

IMATRIX_AUTO = "auto"  # this model's newest stored matrix, else computed now on the shipped text (as --imatrix auto)
IMATRIX_NONE = ""


def exclude_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def budget_error(base: str, text: str, exclude: Sequence[str]) -> Optional[str]:
    """The CLI's `error: ...` line for this budget on `base`, or None when the search may start.

    Reads the base's header and tensor table (the check needs the sizes); no measuring."""
    from quant.budget import check_budget, parse_budget  # numpy: only once a budget is asked for
    from quant.recipe import resolve_base

    if not text.strip():
        return "error: --budget: give a size (100MB, 95MiB), bits per weight (4.5bpw) or ram"
    try:
        src = resolve_base(base, Store())
        b = parse_budget(text, src.info)
        check_budget(src.path, src.info, b, exclude)
    except EdgeLLMError as e:
        return f"error: {e}"
    return None


def ram_hint(base: str) -> str:
    """What `ram` means for `base` on this machine: the memory estimate's room for the weights."""
    from quant.budget import parse_budget
    from quant.recipe import resolve_base

    try:
        return parse_budget("ram", resolve_base(base, Store()).info).text
    except EdgeLLMError as e:
        return f"ram: {e}"


def dequantized_from(base: str) -> str:
    """The type the base was dequantized from (its store record's lineage), "" when it was not."""
    try:
        rec = Store().get(base)
    except Exception:  # a path, or gone: nothing to pre-tick
        return ""
    extra = getattr(rec, "extra", None) or {}
    return str(extra.get("dequantized_from") or "")


def run_budget(base: str, budget: str, exclude: Sequence[str], imatrix: str, **kw: Any):
    """quant.budget.quantize_to_budget, as `edgellm quantize BASE --budget B --exclude-types ... --imatrix I` runs it."""
    from quant.budget import quantize_to_budget

    return quantize_to_budget(base, budget=budget, exclude=list(exclude), imatrix=imatrix or None, **kw)


def describe_budget(res: Any, recipe: Any) -> str:
    """The result row's note: predicted vs measured size and the recipe's name."""
    from pathlib import Path

    return (
        f"predicted {human_size(recipe.predicted_bytes)}, measured {human_size(res.size_bytes)}, recipe {Path(recipe.file).name}"
    )
