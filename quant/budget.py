"""`quantize --budget SIZE`: one type per tensor, chosen for a size, from measured sensitivity.

The measurement: for every weight matrix and every candidate type, llama.cpp's
own quantizer (`ggml_quantize_chunk`, with the importance matrix exactly as
llama_model_quantize passes it) rounds a sample of the matrix's rows, ggml's
`to_float` reads them back, and the error is weighted by the importance
matrix: sum over columns of E[x_c^2] * sum over rows of (w - q(w))^2 -- the
expected squared error that tensor adds to its matmul's output on the
calibration text. The importance matrix comes from the calibration text (the
shipped one unless `--imatrix` names another), never from an evaluation text.
A matrix without an importance entry (token_embd as an embedding; the output
layer in a matrix from llama-imatrix, which leaves it out, where `edgellm
imatrix` gives it one) is weighted with the mean importance of the layers'
attention inputs (the output layer's own input is the same normed hidden state).

That proxy ranks matrices of one kind at one depth, but not kinds or depths
against each other (a unit of error in the first layers' attn_v moves the
logits ~100x more than one in the last layers' attn_output). So each
matrix's error is multiplied by its gain: its group's (kind x slice of the
layers, quant/sensitivity.depth_buckets), interpolated by layer between the
groups of its kind, measured by quant/sensitivity.py as KL divergence per
unit of proxy error on the calibration text, and cached per model and matrix.

The choice (quant/allocate.py): start every matrix at its cheapest candidate, then repeatedly
give the byte to the upgrade with the best error saved per byte (along each
matrix's lower convex hull) until the next one would pass the budget. Sizes
are exact: rows x ggml_row_size(type, cols), as llama.cpp's dry run counts
them, plus the input's metadata and the alignment padding.

The result is a recipe (tensor-name regex -> type) that llama_model_quantize
applies through `tt_overrides`, the same thing llama-quantize's
`--tensor-type-file` reads (the recipe's `.txt` twin). Candidate types are
those whose block divides the row width, so llama.cpp never falls back.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edgellm import units
from edgellm.engine.memory import DEFAULT_CTX, available_ram, default_threads, weights_room
from edgellm.errors import QuantizeError, UsageError
from edgellm.fsutil import atomic_write_text, sha256_file
from edgellm.gguf.layout import read_tensors
from edgellm.gguf.reader import GGUFInfo
from edgellm.models.store import Store
from edgellm.progress import CancelToken, Progress, ProgressCallback, no_progress, staged
from quant import rounding, sensitivity
from quant._common import BaseInput, base_name
from quant._ggml import ggml
from quant.allocate import Matrix, allocate, group_options
from quant.allocate import hull as hull_of
from quant.imatrix import ImatrixChoice, calibration_text
from quant.imatrix_file import IMatrix
from quant.quantize import QuantizeResult
from quant.recipe import FILE_TYPE, NEEDS_IMATRIX, TYPES, Recipe, RecipeJob, llama_quantize_text, recipes_folder, resolve_base

SAMPLE_ROWS = 256
ROW_CAP = 8.0  # a sampled row's proxy error counts at most this many times the matrix's median row's
# What a --budget job reports, in order (its progress tasks are prefixed "2/4 calibrate: ..."):
# the proxy error of every matrix in every type, the probes on the calibration text, the allocation, the file.
STAGES = ("measure", "calibrate", "allocate", "quantize")


@dataclass
class Budget:
    bytes: int
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "text": self.text}


def parse_budget(text: str, info: GGUFInfo, *, ctx: int = DEFAULT_CTX) -> Budget:
    """`100MB`, `95.5MiB`, `4.5bpw` (bits per weight over the whole file), or `ram` (what this machine
    can hold beside a `ctx`-token KV cache, compute buffers and the process: edgellm.engine.memory's estimate)."""
    t = text.strip().lower().replace(" ", "")
    if t == "ram":
        # The load guard's own estimate solved for the weights: the file it makes is one the guard lets load.
        n = weights_room(info, available_ram(), ctx=ctx)
        return Budget(n, f"ram ({n / 1e6:.1f} MB free for weights beside a {ctx}-token KV cache)")
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)bpw", t):
        return Budget(int(float(m.group(1)) * info.parameters / 8), text)
    size: Optional[int]
    try:
        size = units.parse_size(t, option="--budget")
    except UsageError:
        size = None
    if size is None:
        raise UsageError(f"--budget {text!r}: give a size (100MB, 95MiB; {units.SIZE_HELP}), bits per weight (4.5bpw) or ram")
    return Budget(size, text)


def measure(
    model_path: Path,
    imatrix: IMatrix,
    types: Sequence[str],
    *,
    cancel: Optional[CancelToken] = None,
    on_progress: Optional[ProgressCallback] = None,
    threads: Optional[int] = None,
) -> tuple[list[Matrix], int]:
    """Every quantizable matrix's (type, bytes, error) options; and the bytes of the tensors kept as they are.
    A matrix's candidate types are rounded side by side, `threads` at a time (ggml's quantizer runs
    outside the GIL): at x4 the serial loop was ~1x a whole llama-quantize run."""

    g = ggml()
    parsed = read_tensors(model_path)
    entries = {n: e.normalized().astype(np.float32) for n, e in imatrix.entries.items()}
    attn_in = [v for n, v in entries.items() if n.endswith("attn_q.weight")]
    out_imp = np.mean(attn_in, axis=0).astype(np.float32) if attn_in else None
    raw = np.memmap(model_path, np.uint8, mode="r")
    dtypes = {"F16": np.float16, "F32": np.float32}
    mats, kept = [], 0
    todo = [t for t in parsed.tensors if len(t.shape) == 2 and t.name.endswith(".weight") and t.type_name in dtypes]
    for t in parsed.tensors:
        if t not in todo:
            kept += t.n_bytes
    with ThreadPoolExecutor(max(1, threads or default_threads()), thread_name_prefix="budget-measure") as pool:
        for i, t in enumerate(todo):
            if cancel is not None:
                cancel.check()
            cols, rows = t.shape
            data = np.frombuffer(raw[t.data_offset : t.data_offset + t.n_bytes], dtypes[t.type_name]).reshape(rows, cols)
            pick = np.unique(np.linspace(0, rows - 1, min(rows, SAMPLE_ROWS)).astype(np.int64))
            src = np.ascontiguousarray(data[pick], np.float32)
            imp = entries.get(t.name)
            weight = imp if imp is not None else (out_imp if out_imp is not None and out_imp.size == cols else None)

            def option(name: str, src=src, imp=imp, weight=weight, rows=rows, cols=cols):
                tid, blk = TYPES[name]
                if cols % blk or (name in NEEDS_IMATRIX and imp is None):
                    return None
                back = g.to_float(tid, g.quantize(tid, src, imp), src.shape)
                d2 = np.square(src - back, dtype=np.float64)
                err = proxy_error((d2 * weight).sum(1) if weight is not None else d2.sum(1), rows)
                return (name, rows * g.row_size(tid, cols), err)

            options = [o for o in pool.map(option, types) if o is not None]
            if not options:
                kept += t.n_bytes
                continue
            options.sort(key=lambda o: (o[1], o[2]))
            mats.append(Matrix(t.name, rows, cols, options))
            if on_progress is not None:
                on_progress(Progress("measure tensor sensitivity", i + 1, len(todo), "tensor", message=t.name))
    return mats, kept


def proxy_error(per_row: np.ndarray, rows: int) -> float:
    """A matrix's proxy error from its sampled rows' errors, scaled to all its rows; a row counts at most
    ROW_CAP x the median row. A few rows can blow up in one type (IQ3_S: one sampled row of the gridless x4
    model's blk.11.ffn_down held 95% of that matrix's error), and uncapped that one row sets the whole group's
    proxy, so its measured gain (KLD / proxy) comes out ~7x low for every other matrix of the group."""
    hit = per_row[per_row > 0]  # rows rounded exactly (all-zero padding rows) must not cap the others to 0
    capped = np.minimum(per_row, ROW_CAP * np.median(hit)) if hit.size else per_row
    return float(capped.sum()) * rows / max(1, len(per_row))


def check_budget(
    model_path: Path, info: GGUFInfo, budget: Budget, exclude: Sequence[str]
) -> tuple[list[str], set[str], int, int]:
    """(candidate types, excluded, metadata overhead, smallest file); refuses an impossible budget
    from sizes alone, before any measuring."""
    excl = {e.strip().upper() for e in exclude if e.strip()}
    unknown = excl - set(TYPES) - {"F16", "F32", "BF16"}
    if unknown:
        raise UsageError(f"--exclude-types: unknown type(s) {', '.join(sorted(unknown))} (known: {', '.join(TYPES)})")
    types = [t for t in TYPES if t not in excl]
    if not types:
        raise UsageError("--exclude-types leaves no type to choose from")
    overhead = max(0, info.size_bytes - info.tensor_bytes) + 4096 + 32 * info.tensor_count
    smallest = overhead + smallest_bytes(model_path, types)
    if budget.bytes < smallest:
        raise QuantizeError(
            f"--budget {budget.text} ({budget.bytes / 1e6:.1f} MB) is below the smallest file these types allow: "
            f"{smallest / 1e6:.1f} MB ({smallest} bytes)" + (f" with {', '.join(sorted(excl))} excluded" if excl else "")
        )
    return types, excl, overhead, smallest


def smallest_bytes(model_path: Path, types: Sequence[str]) -> int:
    """Tensor bytes with every matrix in its cheapest candidate type (the rest as they are)."""

    g = ggml()
    total = 0
    for t in read_tensors(model_path).tensors:
        sizes = [
            t.shape[1] * g.row_size(TYPES[n][0], t.shape[0])
            for n in types
            if len(t.shape) == 2
            and (n not in NEEDS_IMATRIX or t.name.startswith("blk."))  # output: IQ2_S only with its entry, not known here
            and t.name.endswith(".weight")
            and t.type_name in ("F16", "F32")
            and t.shape[0] % TYPES[n][1] == 0
        ]
        total += min(sizes) if sizes else t.n_bytes
    return total


MAX_ROUNDS = 3  # probe what the allocation picks, allocate again; stops when every pick is measured
PICKS_PER_GROUP = 2  # per round, a group's most used unmeasured picks: the rest borrow the nearest measured gain


def type_bpw(type_name: str) -> float:
    """Bits per weight of a candidate type (a row of 8192 values fits every block)."""
    return ggml().row_size(TYPES[type_name][0], 8192) * 8 / 8192


def _scaled(mats: list[Matrix], gain: Callable[[str, str], float], n_layers: int) -> list[Matrix]:
    """Each matrix's errors times its gain in that type: a block matrix's interpolated, log-linearly by layer,
    between the measured gains of its kind's groups (their mean layers), so the gain follows depth within a
    group rather than stepping at its edges; a matrix outside the blocks takes its own group's."""
    kinds: dict[str, list[tuple[float, str]]] = {}
    for g in {sensitivity.group_of(m.name, n_layers) for m in mats}:
        c = sensitivity.group_centre(g)
        if c is not None:
            kinds.setdefault(g.split("/")[0], []).append((c, g))
    for lst in kinds.values():
        lst.sort()

    def matrix_gain(m: Matrix, t: str) -> float:
        g = sensitivity.group_of(m.name, n_layers)
        layer = sensitivity.layer_of(m.name)
        lst = kinds.get(g.split("/")[0]) if layer is not None else None
        if layer is None or not lst or len(lst) < 2:
            return gain(g, t)
        centres = [c for c, _ in lst]
        logs = [np.log(max(gain(gg, t), 1e-300)) for _, gg in lst]
        return float(np.exp(np.interp(layer, centres, logs)))

    return [Matrix(m.name, m.rows, m.cols, [(t, b, e * matrix_gain(m, t)) for t, b, e in m.options]) for m in mats]


def _wanted(
    groups: dict[str, list[Matrix]],
    choice: Optional[dict[str, str]],
    results: dict[tuple[str, str], sensitivity.ProbeResult],
    target_bpw: float,
) -> list[tuple[str, str, list[str], float]]:
    """The (group, type) probes the next allocation needs: before the first one, each group in its type
    nearest the budget's bits per weight; after, every type the allocation picked that is not measured."""
    want = []
    for g, ms in groups.items():
        if choice is None:
            # among the types on the group's hull only: one off it (Q4_1 at 256-multiple widths, where
            # Q4_K is smaller and as good) is never picked, so its probe would only feed this first guess
            hull = hull_of(group_options(ms))
            picks = {min(hull, key=lambda o: (abs(type_bpw(o[0]) - target_bpw), o[1]))[0]}
            if any(k[0] == g for k in results):
                picks = set()  # measured before at some type: its gain stands in until the allocation asks
        else:
            used = Counter(choice[m.name] for m in ms if (g, choice[m.name]) not in results)
            picks = {t for t, _n in used.most_common(PICKS_PER_GROUP)}
        for t in sorted(picks):
            err = group_error(ms, t) if (g, t) not in results else None
            if err is not None:  # a type some of the group's matrices cannot take is not probed: it borrows
                want.append((g, t, [m.name for m in ms], err))
    return want


def group_error(ms: Sequence[Matrix], type_name: str) -> Optional[float]:
    """The group's proxy error in a type: the sum over its matrices; None if any of them cannot take it."""
    errs = [next((o[2] for o in m.options if o[0] == type_name), None) for m in ms]
    return None if not errs or None in errs else sum(e for e in errs if e is not None)


def with_current_errors(
    results: dict[tuple[str, str], sensitivity.ProbeResult], groups: dict[str, list[Matrix]]
) -> dict[tuple[str, str], sensitivity.ProbeResult]:
    """Cached probes with this run's proxy error: a probe's KLD is the measured fact, its error is the proxy's,
    so a gain (KLD / error) stays consistent with the errors it scales when the proxy changes (the row cap)."""
    out = dict(results)
    for (g, t), r in results.items():
        err = group_error(groups.get(g, []), t)
        if err is not None:
            out[(g, t)] = replace(r, error=err)
    return out


def pickable(
    results: dict[tuple[str, str], sensitivity.ProbeResult], mats: Sequence[Matrix]
) -> dict[tuple[str, str], sensitivity.ProbeResult]:
    """The cached probes of types this search may pick. A probe of an excluded type must not lend its gain to
    the others: on the grid base a Q4_1 probe (nearly exact there, so its KLD per unit error is noise) cached by
    an all-types run set Q5_0's borrowed gain ~3x too high in the q4_1,q5_1-excluded run after it, which then
    chose 24 fewer Q5_0 matrices: 0.726x llama-quantize's Q4_K_M KLD instead of the 0.541x a cold search gets,
    which this filter gives back to the digit (docs/quantize.md, the grid base)."""
    types = {t for m in mats for t, _b, _e in m.options}
    return {k: r for k, r in results.items() if k[1] in types}


# long: the search's rounds (probe, allocate, probe what it picked), with the prober's lifetime and the cache around them
def calibrated_choice(
    model_path: Path,
    tensors: Sequence[sensitivity.TensorInfo],
    imatrix: IMatrix,
    mats: list[Matrix],
    limit: int,
    *,
    n_layers: int,
    model_sha256: str,
    imatrix_sha256: str,
    threads: Optional[int],
    cancel: Optional[CancelToken],
    on_progress: Optional[ProgressCallback],
) -> tuple[dict[str, str], int, dict[str, Any]]:
    """The allocation with each matrix's error scaled by its group's measured KLD per unit of error in the
    type at hand (quant/sensitivity.py); probes are measured as the allocation asks for them."""
    t0 = time.perf_counter()
    sensitivity.clean_legacy()  # probe folders an older, file-based search left when it was killed
    key = sensitivity.cache_key(model_sha256, imatrix_sha256, rounding.BUDGET)
    results = sensitivity.load_results(key)
    cached = len(results)
    groups: dict[str, list[Matrix]] = {}
    for m in mats:
        groups.setdefault(sensitivity.group_of(m.name, n_layers), []).append(m)
    results = with_current_errors(results, groups)
    elements = sum(m.rows * m.cols for m in mats)
    target = limit * 8 / max(1, elements)
    entries = {n: e.normalized().astype(np.float32) for n, e in imatrix.entries.items()}
    prober = sensitivity.Prober(model_path, {t.name: t for t in tensors}, entries, threads=threads, cancel=cancel)
    choice: Optional[dict[str, str]] = None
    used, rounds = 0, 0
    type_ids = {k: v[0] for k, v in TYPES.items()}
    try:
        for rnd in range(1, MAX_ROUNDS + 1):
            rounds = rnd
            want = _wanted(groups, choice, pickable(results, mats), target)
            if not want and choice is not None:
                break
            if want:
                missing = [w for w in want if not prober.can_probe(w[2])]
                want = [w for w in want if w not in missing]
                sensitivity.run_probes(prober, want, type_ids, results, on_progress=on_progress, cancel=cancel)
            gain = sensitivity.gain_lookup(pickable(results, mats), type_bpw)
            choice, used = allocate(_scaled(mats, gain, n_layers), limit)
    finally:
        prober.close()
    if len(results) > cached:
        sensitivity.save_results(key, results)
    # picks of the last round that no round measured take the nearest measured gain of their group (gain_lookup)
    picked = choice or {}
    unmeasured = {g: sorted({picked[m.name] for m in ms} - {t for gg, t in results if gg == g}) for g, ms in groups.items()}
    info = {
        "probes_measured": len(results) - cached,
        "probes_cached": cached,
        "rounds": rounds,
        "probe_seconds": round(prober.seconds, 3),
        "seconds": round(time.perf_counter() - t0, 3),
        "tokens": sensitivity.PROBE_CHUNKS * sensitivity.PROBE_CTX,
        "text": calibration_text().label,
        "text_sha256": calibration_text().sha256,
        "borrowed": {g: ts for g, ts in sorted(unmeasured.items()) if ts},
        "groups": {
            g: {
                t: {"kld": r.kld, "kld_err": r.kld_err, "error": r.error, "gain": r.gain}
                for (gg, t), r in sorted(results.items())
                if gg == g
            }
            for g in groups
        },
    }
    return choice or {}, used, info


def plan(
    src: BaseInput,
    imatrix: ImatrixChoice,
    budget: Budget,
    *,
    exclude: Sequence[str] = (),
    cancel: Optional[CancelToken] = None,
    on_progress: Optional[ProgressCallback] = None,
    calibrate: bool = True,
    threads: Optional[int] = None,
) -> Recipe:
    """The recipe for `budget`: measured with `imatrix`'s matrix, allocated, with its exact predicted size and the search cost.

    With `calibrate`, each matrix's error is scaled by its group's gain in that type, measured on the
    calibration text (quant/sensitivity.py); without, the proxy errors count as they are."""
    t0 = time.perf_counter()
    model_path, info, rec = src.path, src.info, src.resolved.record
    types, excl, overhead, smallest = check_budget(model_path, info, budget, exclude)
    progress = on_progress or no_progress
    with ggml().rounding(rounding.BUDGET):  # every probe and proxy error rounds as the file will be written
        mats, kept = measure(
            model_path, imatrix.matrix, types, cancel=cancel, on_progress=staged(progress, STAGES, "measure"), threads=threads
        )
        limit = budget.bytes - overhead - kept
        calibration: dict[str, Any] = {}
        if calibrate:
            choice, used, calibration = calibrated_choice(
                model_path,
                read_tensors(model_path).tensors,
                imatrix.matrix,
                mats,
                limit,
                n_layers=info.block_count,
                model_sha256=(rec.sha256 if rec is not None else None) or sha256_file(model_path),
                imatrix_sha256=imatrix.sha256 or "none",
                threads=threads,
                cancel=cancel,
                on_progress=staged(progress, STAGES, "calibrate"),
            )
        else:
            choice, used = allocate(mats, limit)
    staged(progress, STAGES, "allocate")(Progress("per-tensor types", 1, 1, "recipe", message=f"{len(mats)} matrices"))
    return Recipe(
        architecture=info.architecture,
        block_count=info.block_count,
        file_type=FILE_TYPE,
        budget=budget.to_json(),
        excluded_types=sorted(excl),
        predicted_bytes=overhead + kept + used,
        smallest_bytes=smallest,
        tensor_types=[(f"^{re.escape(m.name)}$", choice[m.name]) for m in mats],
        type_counts={t: sum(1 for v in choice.values() if v == t) for t in sorted(set(choice.values()))},
        search_seconds=round(time.perf_counter() - t0, 3),
        measure="imatrix-weighted squared error"
        + (" x KLD per unit error of its group in that type, measured on the calibration text" if calibrate else ""),
        calibration=calibration,
        rounding=rounding.BUDGET,
    )


def quantize_to_budget(
    model: str | Path | BaseInput,
    *,
    budget: str,
    exclude: Sequence[str] = (),
    imatrix: Optional[str] = None,
    output: Optional[Path] = None,
    threads: Optional[int] = None,
    force: bool = False,
    store: Optional[Store] = None,
    on_progress: Optional[ProgressCallback] = None,
    cancel: Optional[CancelToken] = None,
    feedback: Optional[bool] = None,
) -> tuple[QuantizeResult, Recipe]:
    """`--budget SIZE`: search the per-tensor types, save them as a recipe, quantize with them.

    `feedback`: error feedback on the matrices it rewrites (quant/feedback.py); None, the default, feeds back
    where free RAM holds its covariances and says in the recipe why not elsewhere; True refuses without the RAM.

    Returns (QuantizeResult, recipe); the recipe carries `search_seconds`
    (measurement and allocation) apart from the result's quantization time.
    The input is resolved and parsed once, here, and handed down.
    `--recipe FILE` is quant/recipe.py's `apply_recipe`.
    """

    on_progress = on_progress or no_progress
    store = store or Store()
    job = RecipeJob(resolve_base(model, store), store, output, threads, force, on_progress, cancel)
    resolved, info = job.src.resolved, job.src.info
    b = parse_budget(budget, info)
    check_budget(resolved.path, info, b, exclude)
    # an imatrix first: the search measures with it and the quantization uses it
    choice = job.imatrix(imatrix or "auto")
    recipe = plan(job.src, choice, b, exclude=exclude, cancel=cancel, on_progress=on_progress, threads=threads)
    recipe.model, recipe.imatrix, recipe.feedback = resolved.label, choice.lineage(), feedback is not False
    rewrite = None
    if recipe.feedback:
        from quant.selfgen import sequences_for

        recipe.feedback_sequences = sequences_for(resolved.path)
        rewrite = job.feedback(recipe, choice, short_ram="ask" if feedback else "skip")
    label = "budget-" + re.sub(r"[^a-z0-9.]", "", budget.lower()) + ("-fb" if recipe.feedback else "")
    jpath = recipes_folder() / f"{base_name(resolved, info)}-{label}.json"
    recipe.file = str(jpath)
    lineage: dict[str, Any] = {
        "file": recipe.file,
        "budget": recipe.budget,
        "excluded_types": recipe.excluded_types,
        "predicted_bytes": recipe.predicted_bytes,
        "type_counts": recipe.type_counts,
        "search_seconds": recipe.search_seconds,
    }
    res = replace(job, on_progress=staged(on_progress, STAGES, "quantize")).quantize(recipe, lineage, label, choice, rewrite)
    if res.size_bytes > b.bytes:
        store.remove(res.name)  # cannot happen with exact sizes; never leave a file over the budget
        raise QuantizeError(f"the file came out at {res.size_bytes} bytes, over the budget; nothing was kept")
    # saved once the file is in place: a failed or killed job leaves no recipe for a file that does not exist,
    # and a feedback job's recipe carries the timing its rewrite measured
    atomic_write_text(jpath, json.dumps(recipe.to_json(), indent=1) + "\n")
    atomic_write_text(jpath.with_suffix(".txt"), llama_quantize_text(recipe.tensor_types))
    return res, recipe
