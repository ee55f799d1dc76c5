"""`quantize --recipe FILE`: a saved `--budget` recipe applied to a model of
the same architecture.

Apart from quant/budget.py because applying a recipe needs none of the
search (numpy sensitivity measurement, calibration, the engine's memory
model): importing only this keeps the command's start-up small next to the
quantization itself, which `scripts/bench_imatrix.py` times against
`llama-quantize --tensor-type-file` (docs/quantize.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from edgellm.errors import QuantizeError, UsageError
from edgellm.gguf.layout import model_matmul_widths
from edgellm.gguf.reader import read_gguf
from edgellm.models.resolve import resolve
from edgellm.models.store import Store
from quant.levels import is_quantized
from quant.quantize import quantize

FILE_TYPE = "q4_k_m"  # the file type llama.cpp records; every quantized tensor is overridden anyway
# ggml_type ids of the pinned ggml.h, and their block widths
TYPES: dict[str, tuple[int, int]] = {
    "Q2_K": (10, 256), "Q3_K": (11, 256), "IQ4_XS": (23, 256), "Q4_K": (12, 256), "Q5_K": (13, 256), "Q6_K": (14, 256),
    "Q4_0": (2, 32), "Q4_1": (3, 32), "Q5_0": (6, 32), "Q5_1": (7, 32), "IQ4_NL": (20, 32), "Q8_0": (8, 32),
}


def load_recipe(path: Path | str) -> dict[str, Any]:
    p = Path(path).expanduser()
    try:
        r = json.loads(p.read_text(encoding="utf-8"))
        pairs = [(str(a), str(b).upper()) for a, b in r["tensor_types"]]
        str(r["architecture"])
    except FileNotFoundError:
        raise UsageError(f"{p}: no such recipe file") from None
    except (ValueError, KeyError, TypeError, OSError):
        raise QuantizeError(f"{p.name}: not an edgellm recipe (JSON with architecture and tensor_types)") from None
    r["tensor_types"] = pairs
    r["file"] = str(p)
    return r


def check_recipe(recipe: dict[str, Any], model_path: Path, info: Any, label: str) -> None:
    """A recipe applies to a model of its architecture whose every matrix it names exists and fits the type."""

    if recipe["architecture"] != info.architecture:
        raise QuantizeError(f"the recipe {Path(recipe['file']).name} is for {recipe['architecture']} models; "
                            f"{label} is {info.architecture or 'unknown'}")
    _arch, widths = model_matmul_widths(model_path)
    for pattern, tname in recipe["tensor_types"]:
        if tname not in TYPES:
            raise QuantizeError(f"the recipe names an unknown type {tname}")
        name = _literal(pattern)
        if name is not None:  # what --budget writes: one anchored name, a lookup instead of a regex over every tensor
            hit = [name] if name in widths else []
        else:
            try:
                rx = re.compile(pattern)
            except re.error as e:
                raise QuantizeError(f"the recipe's pattern {pattern} is not a regular expression ({e})") from None
            hit = [n for n in widths if rx.search(n)]
        if not hit:
            raise QuantizeError(f"the recipe's pattern {pattern} matches no tensor of {label}: it was made for "
                                "another model layout")
        bad = [n for n in hit if widths[n][0] % TYPES[tname][1]]
        if bad:
            raise QuantizeError(f"the recipe puts {bad[0]} ({widths[bad[0]][0]} wide) in {tname}, whose blocks do not fit")


def _literal(pattern: str) -> Optional[str]:
    """The tensor name an anchored, escaped pattern (^blk\\.0\\.attn_k\\.weight$) matches, else None."""
    if len(pattern) < 3 or pattern[0] != "^" or pattern[-1] != "$":
        return None
    name = pattern[1:-1].replace("\\.", ".")
    return name if re.escape(name) == pattern[1:-1] else None


def tt_overrides(recipe_pairs: Sequence[tuple[str, str]]) -> list[list[Any]]:
    return [[p, TYPES[t][0]] for p, t in recipe_pairs]


def llama_quantize_text(recipe_pairs: Sequence[tuple[str, str]]) -> str:
    """The same recipe for llama-quantize --tensor-type-file (pattern=type, one per line)."""
    return "".join(f"{p}={t.lower()}\n" for p, t in recipe_pairs)


def resolve_base(model: str | Path, store: Any) -> tuple[Any, Any]:
    """The model and its GGUF info; refuses a quantized one (recipes and budgets start from F16/BF16/F32)."""
    resolved = resolve(str(model), store=store)
    info = read_gguf(resolved.path)
    if is_quantized(info):
        raise QuantizeError(f"--budget and --recipe start from an F16/BF16/F32 file; {resolved.label} is {info.level} "
                            f"(`edgellm convert {resolved.label} --to f16` first)")
    return resolved, info


def apply_recipe(
    model: str | Path,
    recipe_file: str | Path,
    *,
    imatrix: Optional[str] = None,
    output: Optional[Path] = None,
    threads: Optional[int] = None,
    force: bool = False,
    store: Any = None,
    on_progress: Any = None,
    cancel: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """Quantize `model` with the recipe's per-tensor types. Returns (QuantizeResult, recipe)."""

    store = store or Store()
    resolved, info = resolve_base(model, store)
    recipe = load_recipe(recipe_file)
    check_recipe(recipe, resolved.path, info, resolved.label)
    label = "recipe-" + re.sub(r"[^a-z0-9._+-]", "-", Path(recipe_file).stem.lower())[:40]
    lineage = {"file": recipe["file"], "made_for": recipe.get("model"), "tensors": len(recipe["tensor_types"])}
    recipe["search_seconds"] = 0.0
    choice = None
    if imatrix is not None:
        from quant.imatrix import choose_imatrix  # only with a matrix: it loads the calibration machinery

        choice = choose_imatrix(imatrix, resolved, store=store, on_progress=on_progress, cancel=cancel)
    res = quantize(resolved.record.name if resolved.record is not None else resolved.path, [FILE_TYPE],
                   output=output, threads=threads, force=force, imatrix=choice,  # type: ignore[arg-type]
                   tensor_types=tt_overrides(recipe["tensor_types"]), recipe=lineage, label=label, store=store,
                   on_progress=on_progress, cancel=cancel)[0]
    return res, recipe
