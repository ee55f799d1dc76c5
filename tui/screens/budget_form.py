"""What the Quantize screen checks and runs, so the screen holds only widgets:
its level jobs (a float level of a quantized base is `edgellm convert`, as
the CLI's own error advises), the size-budget search, a saved recipe, and
the pickers' choices (this base's stored matrices, the saved recipes, what a
search will cost).

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
SEARCH_LABEL = "none: search"


def exclude_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def budget_error(base: str, text: str, exclude: Sequence[str], imatrix: str = IMATRIX_AUTO) -> Optional[str]:
    """The CLI's `error: ...` line for this budget on `base`, or None when the search may start.

    Reads the base's header and tensor table (the check needs the sizes); no measuring."""
    from quant.budget import check_budget, parse_budget  # numpy: only once a budget is asked for
    from quant.recipe import resolve_base

    if imatrix == IMATRIX_NONE:
        return "error: the size-budget search measures with an importance matrix: pick auto or a stored one"
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


def recipe_error(base: str, recipe: str) -> Optional[str]:
    """The CLI's line when the saved recipe cannot apply to `base` (another architecture or layout), else None."""
    from quant.recipe import check_recipe, load_recipe, resolve_base

    try:
        src = resolve_base(base, Store())
        check_recipe(load_recipe(recipe), src.path, src.info, src.label)
    except EdgeLLMError as e:
        return f"error: {e}"
    return None


def run_budget(
    base: str, budget: str, exclude: Sequence[str], imatrix: str, recipe: str = "", *, feedback: bool = True, **kw: Any
):
    """`edgellm quantize BASE --budget B --exclude-types ... --imatrix I` (with `--no-error-feedback` when the box
    is cleared), or `--recipe FILE` when one is picked (a recipe says itself whether it feeds back)."""
    if recipe:
        from quant.recipe import apply_recipe

        return apply_recipe(base, recipe, imatrix=imatrix or None, **kw)
    from quant.budget import quantize_to_budget

    fb = None if feedback else False  # ticked: the CLI's default, which goes on without where RAM is short
    return quantize_to_budget(base, budget=budget, exclude=list(exclude), imatrix=imatrix or None, feedback=fb, **kw)


def run_level(base: str, level: str, imatrix: str, *, allow_requantize: bool, **kw: Any) -> list[Any]:
    """One level as the CLI makes it: `edgellm convert` for a float level of a quantized base, else `quantize -l`."""
    from quant.levels import is_quantized, parse_level
    from quant.quantize import quantize

    if parse_level(level).is_float:
        from edgellm.gguf.reader import read_gguf
        from edgellm.models.resolve import resolve
        from quant.convert import convert

        if is_quantized(read_gguf(resolve(base, store=Store()).path)):
            return [convert(base, level, **kw)]
    return quantize(base, [level], allow_requantize=allow_requantize, imatrix=imatrix or None, **kw)


def imatrix_choices(base: str) -> list[tuple[str, str]]:
    """This base's stored matrices (name, text, tokens, date), newest first: `auto` would take the first."""
    import time

    from quant.imatrix import list_imatrices, stored_for

    try:
        rec = Store().get(base) if base else None
    except EdgeLLMError:
        rec = None
    # the record's hash only: hashing a multi-GB base on every pick would stall the picker
    sha = rec.sha256 if rec is not None and len(rec.sha256) == 64 else None
    mine = stored_for(sha) if sha else sorted(list_imatrices(), key=lambda r: -r.created)
    return [(f"{r.name}  {r.text}  {r.tokens} tok  {time.strftime('%Y-%m-%d', time.localtime(r.created))}", r.name) for r in mine]


def recipe_choices() -> list[tuple[str, str]]:
    """The saved recipes (name, architecture, budget, date), newest first."""
    from quant.recipe import list_recipes

    return [(r.describe(), str(r.path)) for r in list_recipes()]


def cost_hint(base: str, imatrix: str, recipe: str) -> str:
    """What the job will cost before it runs: a recipe skips the search; a search says what is cached and how long."""
    if recipe:
        return "cost: a saved recipe, no search; the quantization only"
    if imatrix == IMATRIX_NONE:
        return ""
    from quant.search_cost import search_cost

    try:
        return "cost: " + search_cost(base, imatrix).describe()
    except EdgeLLMError as e:
        return f"cost: {e}"


def describe_budget(res: Any, recipe: Any) -> str:
    """The result row's note: predicted vs measured size and the recipe's name."""
    from pathlib import Path

    fed = f", error feedback on {int(recipe.feedback_seconds.get('matrices', 0))} matrices" if recipe.feedback else ""
    if recipe.feedback_skipped:
        fed = ", error feedback left out (too little free RAM)"
    return (
        f"predicted {human_size(recipe.predicted_bytes)}, measured {human_size(res.size_bytes)}, "
        f"recipe {Path(recipe.file).name}{fed}"
    )
