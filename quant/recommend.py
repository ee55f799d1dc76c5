"""`recommend`: the lowest-loss measured level that fits this machine.

It reads the saved `edgellm eval` reports (quant.evaluate) and the saved
bench speeds, and sizes every candidate with the core's one memory
estimate, so its figures are those `models list` and the load guard give.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Optional

from edgellm.engine.memory import DEFAULT_CTX as MEMORY_CTX
from edgellm.engine.memory import Shape, available_ram, estimate, shape_from_size, weights_room
from edgellm.errors import EvalError, GGUFError, InsufficientResources, UsageError
from edgellm.fsutil import human_size
from edgellm.gguf.reader import read_gguf
from edgellm.profile.results import load_bench_results
from quant.evaluate import EvalReport, LevelEval, level_tag, load_eval_results

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    base: str
    level: str
    name: str
    size_bytes: int
    need_bytes: int  # edgellm.engine.memory.estimate(...).total_bytes at ctx
    kld_mean: float
    dppl_pct: float
    same_top_p: float
    eval_tokens_per_second: float
    gen_tokens_per_second: Optional[float]  # from `edgellm bench`, when measured
    corpus: str
    fits: bool

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class Recommendation:
    ram_bytes: int
    ctx: int
    best: Candidate
    runner_up: Optional[Candidate]
    considered: list[Candidate]
    reason: str
    # `quantize --budget` when this machine holds a bigger file than every stored level of the base
    budget_hint: Optional[dict[str, Any]] = None

    def to_json(self) -> dict[str, Any]:
        return {
            "ram_bytes": self.ram_bytes,
            "ctx": self.ctx,
            "best": self.best.to_json(),
            "runner_up": self.runner_up.to_json() if self.runner_up else None,
            "considered": [c.to_json() for c in self.considered],
            "reason": self.reason,
            "budget_hint": self.budget_hint,
        }


def need_bytes(report: EvalReport, lv: LevelEval, ctx: int) -> int:
    """What loading `lv` at `ctx` needs: from its GGUF header while the file
    is there (the very figure the load guard computes), else from the shape
    saved with the report."""
    try:
        return estimate(read_gguf(lv.path, check=False), ctx=ctx).total_bytes
    except (GGUFError, OSError):
        pass
    if report.shape:
        shape = Shape(**{**report.shape, "tensor_bytes": lv.size_bytes})
    else:
        shape = shape_from_size(lv.size_bytes, report.parameters)
    return estimate(shape, ctx=ctx).total_bytes


def _bench_speeds() -> dict[str, float]:
    speeds: dict[str, float] = {}
    try:
        for row in load_bench_results():
            if str(row.get("test", "")).startswith("tg") and row.get("model") and row.get("avg_ts"):
                speeds.setdefault(str(row["model"]), float(row["avg_ts"]))
    except Exception as e:  # bench results are a bonus, never a failure
        log.debug("bench results unreadable: %s", e)
    return speeds


def recommend(ram_bytes: Optional[int] = None, ctx: Optional[int] = None) -> Recommendation:
    """The lowest-loss measured level that fits in `ram_bytes` (default: available RAM) at `ctx`.

    Candidates: per base and level, the saved measurement over the most
    tokens (the newest on a tie); a larger model
    that fits ranks before a smaller one, then lower mean KLD wins. The
    runner-up is the next candidate that fits (usually smaller and faster).
    """
    if ram_bytes is not None and ram_bytes <= 0:
        raise UsageError("--ram must be positive")
    if ctx is not None and ctx < 16:
        raise UsageError(f"--ctx {ctx} is too small (at least 16)")
    reports = load_eval_results()
    if not reports:
        raise EvalError("no saved eval results; run `edgellm eval BASE --levels q4_0,q4_k_m,q5_k_m,q8_0` first")
    ram = int(ram_bytes if ram_bytes is not None else available_ram())
    n_ctx = int(ctx or MEMORY_CTX)
    # Per (base, file): the measurement over the most tokens, the newest on a tie. The file, not its header's
    # level: a --budget file records q4_k_m and an imatrix Q4_0 q4_0, and each must compete with the stock one.
    chosen: dict[tuple[str, str], tuple[EvalReport, LevelEval]] = {}
    for r in sorted(reports, key=lambda r: (r.n_tokens_scored, r.created), reverse=True):
        for lv in r.levels:
            chosen.setdefault((r.base, lv.name), (r, lv))
    speeds = _bench_speeds()
    cands: list[tuple[int, Candidate]] = []
    for r, lv in chosen.values():
        need = need_bytes(r, lv, n_ctx)
        cands.append(
            (
                r.parameters,
                Candidate(
                    base=r.base,
                    level=level_tag(r, lv),
                    name=lv.name,
                    size_bytes=lv.size_bytes,
                    need_bytes=need,
                    kld_mean=lv.kld_mean,
                    dppl_pct=lv.dppl_pct,
                    same_top_p=lv.same_top_p,
                    eval_tokens_per_second=lv.tokens_per_second,
                    gen_tokens_per_second=speeds.get(lv.name),
                    corpus=f"{r.corpus}, ctx {r.ctx}, {r.chunks} chunks",
                    fits=need <= ram,
                ),
            )
        )
    fitting = sorted((c for c in cands if c[1].fits), key=lambda pc: (-pc[0], pc[1].kld_mean))
    considered = [c for _, c in sorted(cands, key=lambda pc: (-pc[0], pc[1].kld_mean))]
    if not fitting:
        smallest = min((c for _, c in cands), key=lambda c: c.need_bytes)
        raise InsufficientResources(
            f"no evaluated level fits in {human_size(ram)} at ctx {n_ctx}: the smallest, {smallest.name}, "
            f"needs {human_size(smallest.need_bytes)} (weights + KV cache + compute + process)"
        )
    best = fitting[0][1]
    runner = fitting[1][1] if len(fitting) > 1 else None
    reason = (
        f"{best.level} is the lowest-loss level of {best.base} that fits: mean KLD {best.kld_mean:.4f}, "
        f"ΔPPL {best.dppl_pct:+.2f}%, needs {human_size(best.need_bytes)} of {human_size(ram)} at ctx {n_ctx}"
    )
    hint = budget_hint(chosen, best, ram, n_ctx, ram_given=ram_bytes is not None)
    return Recommendation(
        ram_bytes=ram, ctx=n_ctx, best=best, runner_up=runner, considered=considered, reason=reason, budget_hint=hint
    )


def budget_hint(
    chosen: dict[tuple[str, str], tuple[EvalReport, LevelEval]], best: Candidate, ram: int, ctx: int, *, ram_given: bool
) -> Optional[dict[str, Any]]:
    """Propose `quantize BASE --budget` when the machine holds a file at least 5% bigger than every
    stored level of the best's base and the float base itself does not fit: a recipe searched for
    that size spends the spare bytes where they lower the loss most (quant/budget.py)."""
    reports = [r for (base, _), (r, _) in chosen.items() if base == best.base]
    if not reports or reports[0].base_level not in ("f16", "bf16", "f32"):
        return None
    r = reports[0]
    try:
        info = read_gguf(r.base_path, check=False)
    except (GGUFError, OSError):
        return None  # the base is gone: nothing to quantize from
    if estimate(info, ctx=ctx).total_bytes <= ram:
        return None  # the float base fits as it is
    room = weights_room(info, ram, ctx=ctx)
    largest = max(lv.size_bytes for (base, _), (_, lv) in chosen.items() if base == best.base)
    if room < 1.05 * largest:
        return None
    size = "ram" if not ram_given else str(room)
    return {
        "command": f"edgellm quantize {r.base} --budget {size}",
        "budget_bytes": room,
        "largest_stored_bytes": largest,
        "reason": f"this machine holds {human_size(room)} of weights at ctx {ctx}, more than {r.base}'s largest "
        f"stored level ({human_size(largest)}): a --budget recipe of that size should beat them",
    }
