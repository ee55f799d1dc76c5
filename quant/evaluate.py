"""All-level quality evaluation, saved results, and the recommendation.

`evaluate()` answers "what does each level cost me?" in one call: it
quantizes the levels the store lacks (quant.quantize), runs the base once
over the text keeping its compact log-probs (quant.kld.BaseLogProbs, cached
under the results folder), then runs every level against them: PPL ± err,
ΔPPL, KLD statistics, same-top-p, RMS Δp and eval speed, exactly as
`llama-perplexity --kl-divergence` defines them. The report is saved as JSON
under `<results>/eval/`; `load_eval_results()` reads them back for the TUI
and for `recommend()`, which picks the best measured level that fits in RAM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from edgellm.engine.hardware import cpu_model
from edgellm.engine.memory import Shape, kv_bytes_per_token
from edgellm.engine.rpc import prepare
from edgellm.errors import EvalError, UsageError
from edgellm.gguf.reader import read_gguf
from edgellm.models.resolve import derived_name, resolve
from edgellm.models.store import Store
from edgellm.progress import CancelToken, ProgressCallback, no_progress
from quant.eval_report import (
    EvalReport,
    LevelEval,
    is_edgellm_recipe,
    level_tag,
    load_eval_results,
    results_folder,
    save_report,
    write_plot,
)
from quant.imatrix import calibration_warnings
from quant.kld import DEFAULT_TAIL_SAMPLES, DEFAULT_TOPK, BaseLogProbs, KLDAccumulator
from quant.levels import parse_level
from quant.perplexity import LogitsRunner, Scoring, ppl_with_error, score
from quant.quantize import quantize

log = logging.getLogger(__name__)

_QUANT_TAG = re.compile(r"(?i)(?:^|[-_.])(i?q\d(?:_[0-9a-z]+)*)(?:[-_.]|$)")


def _machine() -> str:
    return f"{cpu_model()}, {_cores()} cores, {platform.system()}"


def _cores() -> int:
    return os.cpu_count() or 1


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{int(st.st_mtime_ns)}"


def lineage_warning(resolved: Any, info: Any, store: Any) -> Optional[str]:
    """A float base that came from a quantized file is not a true reference; say so."""
    if not info.level.startswith(("f16", "bf16", "f32")):
        return None
    rec = resolved.record
    src = None
    if rec is not None:
        src = rec.extra.get("dequantized_from") or rec.extra.get("base_dequantized_from")
        if not src and rec.parent:
            parent = store.find(rec.parent)
            if parent is not None and not parent.level.startswith(("f16", "bf16", "f32")) and parent.level:
                src = parent.level
        if not src and rec.extra.get("converted_from"):
            try:
                lv = read_gguf(Path(str(rec.extra["converted_from"]))).level
                if not lv.startswith(("f16", "bf16", "f32")):
                    src = lv
            except Exception:
                pass
    if not src:
        m = _QUANT_TAG.search(Path(resolved.path).stem)
        if m:
            src = m.group(1).lower()
    if not src:
        return None
    return (
        f"the base {resolved.label} is {info.level} dequantized from {src}: its weights sit on the {src} grid, so "
        f"KLD/ΔPPL measure distance to that grid, not to the original weights (levels close to {src} look better than they are)"
    )


def _find_level(base_rec: Any, key: str, store: Any) -> Optional[Any]:
    if base_rec is None:
        return None
    for child in store.children(base_rec.name):
        # a --budget file records q4_k_m and an imatrix one its level: neither is the stock level asked for
        if child.level == key and not is_edgellm_recipe(child.name) and child.path.is_file():
            return child
    rec = store.find(derived_name(base_rec, key))
    if rec is not None and rec.level == key and rec.path.is_file():
        return rec
    return None


@dataclass
class _Target:
    label: str  # level key, or the ref the user gave
    name: str
    path: Path


def _targets(
    base: Any,
    items: Sequence[str],
    *,
    threads: Optional[int],
    store: Any,
    on_progress: ProgressCallback,
    cancel: Optional[CancelToken],
) -> list[_Target]:
    """Each --levels item: a level (found in the store or quantized now) or a model ref/path."""

    out: list[Optional[_Target]] = []
    missing: dict[str, int] = {}
    for item in items:
        try:
            key = parse_level(item).key
        except UsageError as level_error:
            try:
                r = resolve(item, store=store)
            except Exception:
                raise level_error from None
            out.append(_Target(r.record.level if r.record else read_gguf(Path(r.path)).level, r.label, Path(r.path)))
            continue
        rec = _find_level(base.record, key, store)
        if rec is not None:
            out.append(_Target(key, rec.name, rec.path))
        else:
            missing[key] = len(out)
            out.append(None)
    if missing:
        if cancel is not None:
            cancel.check()
        results = quantize(
            base.record.name if base.record else str(base.path),
            list(missing),
            threads=threads,
            store=store,
            on_progress=on_progress,
            cancel=cancel,
        )
        for res in results:
            out[missing[res.level]] = _Target(res.level, res.name, Path(res.path))
    if any(t is None for t in out):
        raise EvalError("quantize returned fewer levels than asked for")
    return [t for t in out if t is not None]


# long: one evaluation in llama-perplexity's order: base log-probs once, then each level against them; the shared chunk plan and totals stay local
def evaluate(
    base_ref: str | Path,
    levels: Sequence[str],
    scoring: Scoring,
    *,
    topk: int = DEFAULT_TOPK,
    tail_samples: int = DEFAULT_TAIL_SAMPLES,
    store: Any = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
    save: bool = True,
    rpc: Optional[str] = None,
    rpc_split: Optional[str] = None,
    on_rpc_plan: Any = None,
) -> EvalReport:
    """PPL, ΔPPL and KLD of each level against `base_ref`, saved under the results folder.

    With `rpc` (HOST:PORT[,...]) every model is split across those llama.cpp RPC workers, each
    planned (and `on_rpc_plan(plan)` told) before it loads."""

    store = store or Store()
    if isinstance(levels, str):
        levels = [s for s in levels.split(",") if s.strip()]
    levels = [s.strip() for s in levels if s and s.strip()]
    if not levels:
        raise UsageError("give at least one level (--levels q4_0,q4_k_m,q5_k_m,q8_0)")
    scoring.check()
    src = scoring.load_text()
    ctx = scoring.ctx
    base = resolve(str(base_ref), store=store)
    info = read_gguf(base.path)
    warnings = []
    w = lineage_warning(base, info, store)
    if w:
        warnings.append(w)
        log.warning("%s", w)

    def runner_for(path: Path) -> LogitsRunner:
        plan = None
        if rpc:
            plan = prepare(path, rpc, n_ctx=ctx * scoring.n_seq, split=rpc_split)
            if on_rpc_plan is not None:
                on_rpc_plan(plan)
        return scoring.runner(path, plan)

    # Tokenize (and refuse a short text) before spending minutes on quantizing.
    with runner_for(base.path) as runner:
        tokens = runner.tokenize(src.data)
        plan = scoring.plan(len(tokens))
        n_vocab = runner.n_vocab
        for_check = runner.tokenize(src.data[:4096])
        threads_used = runner.threads

    targets = _targets(base, levels, threads=scoring.threads, store=store, on_progress=on_progress, cancel=cancel)
    for t in targets:
        ti = read_gguf(t.path)
        if ti.vocab_size and info.vocab_size and ti.vocab_size != info.vocab_size:
            raise EvalError(
                f"{t.name} has a vocabulary of {ti.vocab_size} tokens, the base {base.label} {info.vocab_size}: "
                "KL divergence needs the same vocabulary"
            )

    for w in calibration_warnings([t.name for t in targets], src.sha256, store):
        warnings.append(w)
        log.warning("%s", w)

    n_scored = plan.n_chunk * plan.n_scored_per_chunk
    meta_key = {
        "base": _file_key(base.path),
        "text": src.sha256,
        "ctx": ctx,
        "chunks": plan.n_chunk,
        "k": topk,
        "m": tail_samples,
    }
    cache = (
        results_folder() / "logprobs" / (hashlib.sha256(json.dumps(meta_key, sort_keys=True).encode()).hexdigest()[:24] + ".npz")
    )
    base_lp: Optional[BaseLogProbs] = None
    if cache.is_file():
        try:
            base_lp = BaseLogProbs.load(cache)
            if base_lp.meta.get("key") != meta_key or base_lp.n_tokens != n_scored:
                base_lp = None
        except EvalError:
            base_lp = None
    if base_lp is None:
        base_lp = BaseLogProbs(n_scored, n_vocab, k=topk, m=tail_samples, meta={"key": meta_key})
        per = plan.n_scored_per_chunk

        def keep(idx, logits, targets_, nll, sm) -> None:
            base_lp.add_chunk(idx * per, logits, targets_, nll, sm, seed=idx)

        with runner_for(base.path) as runner:
            s, s2, count, secs = score(
                runner, tokens, plan, task=f"eval {base.label} (base)", on_chunk=keep, on_progress=on_progress, cancel=cancel
            )
        base_ppl, base_err = ppl_with_error(s, s2, count)
        base_lp.meta.update(ppl=base_ppl, ppl_err=base_err, tokens_per_second=plan.n_chunk * ctx / secs if secs > 0 else 0.0)
        base_lp.save(cache)
    base_ppl, base_err = float(base_lp.meta["ppl"]), float(base_lp.meta["ppl_err"])

    results: list[LevelEval] = []
    for t in targets:
        if cancel is not None:
            cancel.check()
        acc = KLDAccumulator(base_lp)
        per = plan.n_scored_per_chunk

        def compare(idx, logits, targets_, nll, sm, acc=acc, per=per) -> None:
            acc.add_chunk(idx * per, logits, nll, sm)

        with runner_for(t.path) as runner:
            if runner.n_vocab != n_vocab or not _same_tokens(runner.tokenize(src.data[:4096]), for_check):
                raise EvalError(
                    f"{t.name} tokenizes the text differently from the base {base.label} (a different vocabulary); "
                    "KL divergence needs the same vocabulary"
                )
            s, s2, count, secs = score(
                runner, tokens, plan, task=f"eval {t.label}", on_chunk=compare, on_progress=on_progress, cancel=cancel
            )
        ppl, err = ppl_with_error(s, s2, count)
        r = acc.result()
        ti = read_gguf(t.path)
        results.append(
            LevelEval(
                level=t.label,
                name=t.name,
                path=str(t.path),
                size_bytes=ti.size_bytes,
                bpw=ti.bpw,
                ppl=ppl,
                ppl_err=err,
                dppl_pct=100.0 * (ppl / base_ppl - 1.0),
                kld_mean=r.kld_mean,
                kld_err=r.kld_err,
                kld_median=r.kld_median,
                kld_p99=r.kld_p99,
                kld_max=r.kld_max,
                same_top_p=100.0 * r.same_top_p,
                same_top_p_err=100.0 * r.same_top_p_err,
                rms_dp=100.0 * r.rms_dp,
                rms_dp_err=100.0 * r.rms_dp_err,
                tokens_per_second=plan.n_chunk * ctx / secs if secs > 0 else 0.0,
                seconds=secs,
                kld=r.to_json(),
            )
        )

    report = EvalReport(
        base=base.label,
        base_path=str(base.path),
        base_level=info.level,
        base_size_bytes=info.size_bytes,
        base_bpw=info.bpw,
        base_ppl=base_ppl,
        base_ppl_err=base_err,
        base_tokens_per_second=float(base_lp.meta.get("tokens_per_second", 0.0)),
        parameters=info.parameters,
        kv_bytes_per_token=kv_bytes_per_token(info),
        shape=asdict(Shape.of(info)),
        corpus=src.label,
        corpus_sha256=src.sha256,
        ctx=ctx,
        chunks=plan.n_chunk,
        n_tokens_scored=n_scored,
        batch=plan.n_batch,
        threads=threads_used,
        topk=base_lp.k,
        tail_samples=base_lp.m,
        machine=_machine(),
        created=time.time(),
        levels=results,
        warnings=warnings,
    )
    if save:
        report.path = str(save_report(report))
    return report


def _same_tokens(a: Any, b: Any) -> bool:
    return len(a) == len(b) and bool((a == b).all())


__all__ = [
    "is_edgellm_recipe",
    "level_tag",
    "evaluate",
    "EvalReport",
    "LevelEval",
    "load_eval_results",
    "save_report",
    "write_plot",
    "lineage_warning",
    "results_folder",
]
