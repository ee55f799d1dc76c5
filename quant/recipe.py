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
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from edgellm import paths
from edgellm.errors import InsufficientResources, QuantizeError, UsageError
from edgellm.gguf.layout import model_matmul_widths
from edgellm.models.store import Store
from edgellm.progress import CancelToken, ProgressCallback, no_progress
from quant._common import BaseInput, open_input
from quant.levels import is_quantized, type_id_block
from quant.quantize import QuantizeResult, TensorOverrides, quantize
from quant.rounding import ROUNDINGS, STOCK

if TYPE_CHECKING:  # annotations only: quant.imatrix loads numpy, which applying a recipe without a matrix skips
    from quant.imatrix import ImatrixChoice

FILE_TYPE = "q4_k_m"  # the file type llama.cpp records; every quantized tensor is overridden anyway
# the types a recipe may name, in the order --budget offers them, as (ggml type id, block width)
TYPES: dict[str, tuple[int, int]] = {
    name: type_id_block(name)
    for name in (
        "IQ2_S", "Q2_K", "Q3_K", "IQ3_S", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K",
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q8_0",
    )
}  # fmt: skip
# llama.cpp refuses these without an importance entry for the matrix (tensor_requires_imatrix(), which spares
# token_embd and output): the search offers them only where the matrix has one
NEEDS_IMATRIX = frozenset({"IQ2_S"})


@dataclass
class Recipe:
    """One type per tensor (anchored name pattern -> ggml type name), with how it was found.

    `--budget` writes it (quant/budget.py), `--recipe` reads it back; its JSON is the file's content."""

    architecture: str
    tensor_types: list[tuple[str, str]]
    block_count: int = 0
    file_type: str = FILE_TYPE
    budget: dict[str, Any] = field(default_factory=dict)  # {"bytes": n, "text": "90MB"}
    excluded_types: list[str] = field(default_factory=list)
    predicted_bytes: int = 0
    smallest_bytes: int = 0
    type_counts: dict[str, int] = field(default_factory=dict)
    search_seconds: float = 0.0
    measure: str = ""
    calibration: dict[str, Any] = field(default_factory=dict)  # the sensitivity probes (quant/sensitivity.py)
    model: Optional[str] = None
    imatrix: Optional[dict[str, Any]] = None  # ImatrixChoice.lineage()
    rounding: str = STOCK  # how its K-quant blocks are rounded (quant/rounding.py); recipes before it: stock
    feedback: bool = False  # its file's plain-scale matrices rounded with error feedback (quant/feedback.py)
    # the sequences the model wrote for feedback's inputs (quant/selfgen.py); None: a recipe from before the count
    # followed the model's size, when every model wrote GEN_SEQS
    feedback_sequences: Optional[int] = None
    # "tokens" (quant/selfgen.py), "inputs" (the pass), "rewrite"; "matrices", "passes", "sequences"
    feedback_seconds: dict[str, float] = field(default_factory=dict)
    # why a --budget job left feedback out where it is the default (too little free RAM for its covariances)
    feedback_skipped: str = ""
    file: str = ""  # where it is saved

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tensor_types"] = [list(p) for p in self.tensor_types]
        return d

    def overrides(self) -> list[tuple[str, int]]:
        return tt_overrides(self.tensor_types)


def recipes_folder() -> Path:
    """Where `--budget` saves its recipes (JSON, and the same types as a llama-quantize --tensor-type-file)."""
    return paths.home() / "recipes"


@dataclass(frozen=True)
class SavedRecipe:
    """A stored recipe as a picker lists it: what it was made for, for which budget, and when."""

    path: Path
    architecture: str
    model: str
    budget: str  # the budget as typed: "88MB", "4.5bpw", "ram (...)"
    predicted_bytes: int
    created: float  # the file's modification time

    def describe(self) -> str:
        day = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.created))
        return f"{self.path.stem}  {self.architecture}  {self.budget}  {day}"


def list_recipes() -> list[SavedRecipe]:
    """The stored recipes, newest first; an unreadable file is skipped (it names no architecture to apply to)."""
    d = recipes_folder()
    out = []
    for p in d.glob("*.json") if d.is_dir() else []:
        try:
            r = load_recipe(p)
            created = p.stat().st_mtime
        except (QuantizeError, UsageError, OSError):
            continue
        out.append(SavedRecipe(p, r.architecture, r.model or "", str(r.budget.get("text", "")), r.predicted_bytes, created))
    return sorted(out, key=lambda r: r.created, reverse=True)


def load_recipe(path: Path | str) -> Recipe:
    p = Path(path).expanduser()
    try:
        r = json.loads(p.read_text(encoding="utf-8"))
        pairs = [(str(a), str(b).upper()) for a, b in r["tensor_types"]]
        known = {k: v for k, v in r.items() if k in Recipe.__dataclass_fields__ and k != "tensor_types"}
        recipe = Recipe(**{**known, "architecture": str(r["architecture"]), "tensor_types": pairs, "file": str(p)})
    except FileNotFoundError:
        raise UsageError(f"{p}: no such recipe file") from None
    except (ValueError, KeyError, TypeError, OSError):
        raise QuantizeError(f"{p.name}: not an edgellm recipe (JSON with architecture and tensor_types)") from None
    if recipe.rounding not in ROUNDINGS:
        raise QuantizeError(f"{p.name}: rounding {recipe.rounding!r} is not one this edgellm knows (a newer edgellm's recipe?)")
    return recipe


def check_recipe(recipe: Recipe, model_path: Path, info: Any, label: str) -> None:
    """A recipe applies to a model of its architecture whose every matrix it names exists and fits the type."""

    if recipe.architecture != info.architecture:
        raise QuantizeError(
            f"the recipe {Path(recipe.file).name} is for {recipe.architecture} models; "
            f"{label} is {info.architecture or 'unknown'}"
        )
    _arch, widths = model_matmul_widths(model_path)
    for pattern, tname in recipe.tensor_types:
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
            raise QuantizeError(
                f"the recipe's pattern {pattern} matches no tensor of {label}: it was made for another model layout"
            )
        bad = [n for n in hit if widths[n][0] % TYPES[tname][1]]
        if bad:
            raise QuantizeError(f"the recipe puts {bad[0]} ({widths[bad[0]][0]} wide) in {tname}, whose blocks do not fit")


def _literal(pattern: str) -> Optional[str]:
    """The tensor name an anchored, escaped pattern (^blk\\.0\\.attn_k\\.weight$) matches, else None."""
    if len(pattern) < 3 or pattern[0] != "^" or pattern[-1] != "$":
        return None
    name = pattern[1:-1].replace("\\.", ".")
    return name if re.escape(name) == pattern[1:-1] else None


def tt_overrides(recipe_pairs: Sequence[tuple[str, str]]) -> list[tuple[str, int]]:
    return [(p, TYPES[t][0]) for p, t in recipe_pairs]


def llama_quantize_text(recipe_pairs: Sequence[tuple[str, str]]) -> str:
    """The same recipe for llama-quantize --tensor-type-file (pattern=type, one per line)."""
    return "".join(f"{p}={t.lower()}\n" for p, t in recipe_pairs)


def resolve_base(model: str | Path | BaseInput, store: Store) -> BaseInput:
    """The model, resolved and parsed once; refuses a quantized one (recipes and budgets start from F16/BF16/F32)."""
    src = open_input(model, store)
    if is_quantized(src.info):
        raise QuantizeError(
            f"--budget and --recipe start from an F16/BF16/F32 file; {src.label} is {src.info.level} "
            f"(`edgellm convert {src.label} --to f16` first)"
        )
    return src


def apply_recipe(
    model: str | Path,
    recipe_file: str | Path,
    *,
    imatrix: Optional[str] = None,
    output: Optional[Path] = None,
    threads: Optional[int] = None,
    force: bool = False,
    store: Optional[Store] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> tuple[QuantizeResult, Recipe]:
    """Quantize `model` with the recipe's per-tensor types. Returns (QuantizeResult, recipe)."""

    store = store or Store()
    job = RecipeJob(resolve_base(model, store), store, output, threads, force, on_progress, cancel)
    recipe = load_recipe(recipe_file)
    check_recipe(recipe, job.src.path, job.src.info, job.src.label)
    label = "recipe-" + re.sub(r"[^a-z0-9._+-]", "-", Path(recipe_file).stem.lower())[:40]
    lineage = {"file": recipe.file, "made_for": recipe.model, "tensors": len(recipe.tensor_types), "rounding": recipe.rounding}
    recipe.search_seconds = 0.0
    choice = job.imatrix(imatrix) if imatrix is not None else None
    needy = sorted({t for _p, t in recipe.tensor_types if t in NEEDS_IMATRIX})
    if needy and choice is None:
        raise UsageError(
            f"the recipe uses {', '.join(needy)}, which llama.cpp quantizes only with an importance matrix: "
            "add --imatrix auto (or the matrix the recipe names)"
        )
    rewrite = job.feedback(recipe, choice) if recipe.feedback else None
    return job.quantize(recipe, lineage, label, choice, rewrite), recipe


@dataclass(frozen=True)
class RecipeJob:
    """One `--recipe` or `--budget` run: its base, resolved and parsed once, and quantize()'s options as given."""

    src: BaseInput
    store: Store
    output: Optional[Path]
    threads: Optional[int]
    force: bool
    on_progress: ProgressCallback
    cancel: Optional[CancelToken]

    def imatrix(self, ref: str) -> ImatrixChoice:
        """`--imatrix NAME|FILE|auto`, chosen for this base and checked against it."""
        from quant.imatrix import choose_imatrix  # only with a matrix: it loads the calibration machinery

        return choose_imatrix(ref, self.src.resolved, store=self.store, on_progress=self.on_progress, cancel=self.cancel)

    def feedback(
        self, recipe: Recipe, imatrix: Optional[ImatrixChoice], *, short_ram: str = "refuse"
    ) -> Optional[Callable[[Path], None]]:
        """The error-feedback rewrite for this recipe's file (its inputs measured now); it needs the matrix.

        Where free RAM cannot hold the widest input's covariance, `short_ram` says what happens: "refuse" (a
        recipe made with feedback: its bytes need it), "ask" (refuse, naming --no-error-feedback: the user asked
        for it), or "skip" (feedback is --budget's default: the job goes on without it, and the recipe says why)."""
        from quant.feedback import prepare  # numpy and the calibration pass: only with feedback
        from quant.imatrix import model_sha256
        from quant.selfgen import GEN_SEQS

        if imatrix is None:
            raise UsageError("the recipe was made with error feedback, which rounds with an importance matrix: add --imatrix")
        sequences = GEN_SEQS if recipe.feedback_sequences is None else recipe.feedback_sequences
        try:
            rewrite, recipe.feedback_seconds = prepare(
                self.src.path, recipe.tensor_types, imatrix.matrix, recipe.rounding, model_sha256=model_sha256(self.src.resolved),
                sequences=sequences, threads=self.threads, on_progress=self.on_progress, cancel=self.cancel,
            )  # fmt: skip
        except InsufficientResources as e:
            if short_ram == "skip":
                recipe.feedback, recipe.feedback_sequences, recipe.feedback_skipped = False, None, str(e)
                return None
            advice = (
                ", or quantize with --no-error-feedback" if short_ram == "ask" else " (the recipe was made with error feedback)"
            )
            raise InsufficientResources(f"{e}: free some memory{advice}") from None
        return rewrite

    def quantize(
        self,
        recipe: Recipe,
        lineage: dict[str, Any],
        label: str,
        imatrix: Optional[ImatrixChoice],
        rewrite: Optional[Callable[[Path], None]] = None,
    ) -> QuantizeResult:
        """One file with the recipe's per-tensor types: what `--recipe` and `--budget` both end in."""
        return quantize(
            self.src,
            [FILE_TYPE],
            output=self.output,
            threads=self.threads,
            force=self.force,
            imatrix=imatrix,
            overrides=TensorOverrides(recipe.overrides(), lineage, label, recipe.rounding, rewrite),
            store=self.store,
            on_progress=self.on_progress,
            cancel=self.cancel,
        )[0]
