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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm import paths
from edgellm.engine.hardware import cpu_model
from edgellm.engine.memory import Shape, kv_bytes_per_token
from edgellm.engine.rpc import prepare
from edgellm.errors import EvalError, UsageError
from edgellm.fsutil import atomic_path, atomic_write_text
from edgellm.gguf.reader import read_gguf
from edgellm.models.resolve import derived_name, resolve
from edgellm.models.store import Store
from edgellm.plot import pyplot
from edgellm.progress import CancelToken, ProgressCallback, no_progress
from quant.corpus import load_text
from quant.imatrix import calibration_warnings
from quant.kld import DEFAULT_TAIL_SAMPLES, DEFAULT_TOPK, BaseLogProbs, KLDAccumulator
from quant.levels import parse_level
from quant.perplexity import DEFAULT_BATCH, DEFAULT_CTX, LogitsRunner, check_options, plan_chunks, ppl_with_error, score
from quant.quantize import quantize

log = logging.getLogger(__name__)

RESULTS_SUBDIR = "eval"
_QUANT_TAG = re.compile(r"(?i)(?:^|[-_.])(i?q\d(?:_[0-9a-z]+)*)(?:[-_.]|$)")


@dataclass
class LevelEval:
    level: str
    name: str
    path: str
    size_bytes: int
    bpw: float
    ppl: float
    ppl_err: float
    dppl_pct: float  # 100 * (PPL / PPL(base) - 1)
    kld_mean: float
    kld_err: float
    kld_median: float
    kld_p99: float
    kld_max: float
    same_top_p: float  # percent, as llama.cpp prints it
    same_top_p_err: float
    rms_dp: float  # percent
    rms_dp_err: float
    tokens_per_second: float  # eval (prompt-processing) throughput of this pass
    seconds: float
    kld: dict[str, Any] = field(default_factory=dict)  # every llama.cpp statistic

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 6)
        return d


@dataclass
class EvalReport:
    base: str
    base_path: str
    base_level: str
    base_size_bytes: int
    base_bpw: float
    base_ppl: float
    base_ppl_err: float
    base_tokens_per_second: float
    parameters: int
    kv_bytes_per_token: int
    corpus: str
    corpus_sha256: str
    ctx: int
    chunks: int
    n_tokens_scored: int
    batch: int
    threads: int
    topk: int
    tail_samples: int
    machine: str
    created: float
    levels: list[LevelEval]
    warnings: list[str] = field(default_factory=list)
    path: Optional[str] = None  # where it was saved
    shape: Optional[dict[str, int]] = None  # the base's memory.Shape, for levels no longer in the store

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["levels"] = [lv.to_json() for lv in self.levels]
        for k in ("base_ppl", "base_ppl_err", "base_bpw", "base_tokens_per_second"):
            d[k] = round(d[k], 6)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EvalReport:
        levels = [LevelEval(**lv) for lv in d.get("levels", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known and k != "levels"}, levels=levels)


def results_folder() -> Path:
    return paths.results_dir() / RESULTS_SUBDIR


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
        if child.level == key and child.path.is_file():
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
    *,
    text: Optional[str | Path] = None,
    corpus: Optional[str] = None,
    ctx: int = DEFAULT_CTX,
    chunks: Optional[int] = None,
    batch: Optional[int] = None,
    threads: Optional[int] = None,
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
    check_options(ctx, DEFAULT_BATCH if batch is None else batch, threads, chunks)
    src = load_text(text, corpus)
    base = resolve(str(base_ref), store=store)
    info = read_gguf(base.path)
    warnings = []
    w = lineage_warning(base, info, store)
    if w:
        warnings.append(w)
        log.warning("%s", w)
    batch = DEFAULT_BATCH if batch is None else batch
    n_seq = max(1, batch // ctx)
    n_batch = min(batch, n_seq * ctx)

    def runner_for(path: Path) -> LogitsRunner:
        plan = None
        if rpc:
            plan = prepare(path, rpc, n_ctx=ctx * n_seq, split=rpc_split)
            if on_rpc_plan is not None:
                on_rpc_plan(plan)
        return LogitsRunner(path, n_ctx=ctx, n_seq=n_seq, n_batch=n_batch, threads=threads, rpc_plan=plan)

    # Tokenize (and refuse a short text) before spending minutes on quantizing.
    with runner_for(base.path) as runner:
        tokens = runner.tokenize(src.data)
        plan = plan_chunks(len(tokens), ctx, chunks, batch)
        n_vocab = runner.n_vocab
        for_check = runner.tokenize(src.data[:4096])
        threads_used = runner.threads

    targets = _targets(base, levels, threads=threads, store=store, on_progress=on_progress, cancel=cancel)
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


def save_report(report: EvalReport) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._+-]+", "_", f"{report.base}--{report.corpus}--ctx{report.ctx}--{report.chunks}ch")
    path = results_folder() / f"{safe}.json"
    report.path = str(path)
    # One file per (base, text, ctx, chunks): levels measured by an earlier run
    # on the same tokens stay, so `eval BASE --levels q8_0` adds, never drops.
    try:
        old = EvalReport.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        old = None
    if old is not None and (old.base_path, old.corpus_sha256, old.ctx, old.chunks) == (
        report.base_path,
        report.corpus_sha256,
        report.ctx,
        report.chunks,
    ):
        new = {lv.level for lv in report.levels}
        doc = report.to_json()
        doc["levels"] = [lv.to_json() for lv in old.levels if lv.level not in new] + doc["levels"]
    else:
        doc = report.to_json()
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    return path


def load_eval_results() -> list[EvalReport]:
    """Every saved report, newest first; unreadable files are skipped with a log line."""
    folder = results_folder()
    if not folder.is_dir():
        return []
    out = []
    for f in folder.glob("*.json"):
        try:
            out.append(EvalReport.from_json(json.loads(f.read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError) as e:
            log.warning("skipping unreadable eval result %s: %s", f, e)
    return sorted(out, key=lambda r: r.created, reverse=True)


# -- plot ---------------------------------------------------------------------


def is_edgellm_recipe(name: str) -> bool:
    """A file made with an importance matrix or a per-tensor recipe (quant/imatrix.py, quant/budget.py names)."""
    return name.endswith("-imat") or "-budget-" in name or "-recipe-" in name


def level_tag(report: EvalReport, lv: LevelEval) -> str:
    """How a level is labelled in the plot, the TUI table and chart: the stock level's name, or for an
    imatrix/--budget/--recipe file what tells it apart (`q4_k_m-imat`, `budget-100mb`)."""
    if not is_edgellm_recipe(lv.name):
        return lv.level
    return lv.name.split(report.base.rsplit("-", 1)[0] + "-")[-1]


def write_plot(report: EvalReport, path: Path | str) -> Path:
    """PNG: file size vs mean KLD (left) and vs ΔPPL % (right), one point per level."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise UsageError(f"--plot writes a PNG; give a path ending in .png, not {path.name}")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    # two series on one size axis: llama.cpp's stock levels, and edgellm's imatrix/--budget/--recipe files
    series = [
        ("llama.cpp levels", "o-", [x for x in report.levels if not is_edgellm_recipe(x.name)]),
        ("edgellm imatrix / --budget", "s--", [x for x in report.levels if is_edgellm_recipe(x.name)]),
    ]
    for label, fmt, group in series:
        lv = sorted(group, key=lambda x: x.size_bytes)
        if not lv:
            continue
        mb = [x.size_bytes / 1e6 for x in lv]
        for ax, vals, err in (
            (axes[0], [x.kld_mean for x in lv], [x.kld_err for x in lv]),
            # llama.cpp's ± of PPL(Q)/PPL(base): it accounts for the two runs' correlation.
            (axes[1], [x.dppl_pct for x in lv], [100 * float(x.kld.get("ppl_ratio_err", 0.0)) for x in lv]),
        ):
            ax.errorbar(mb, vals, yerr=err, fmt=fmt, capsize=3, label=label)
            for x, y, t in zip(mb, vals, lv, strict=False):
                ax.annotate(level_tag(report, t), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    import matplotlib.ticker as mticker  # matplotlib (~0.5 s) only with --plot

    for ax, ylabel in ((axes[0], "mean KLD vs base (nats)"), (axes[1], "ΔPPL vs base (%)")):
        ax.xaxis.set_major_locator(mticker.MaxNLocator(5))
        ax.xaxis.set_major_formatter(mticker.FormatStrFormatter("%.1f"))
        ax.set_xlabel("file size (MB)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len([g for _l, _f, g in series if g]) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(
        f"{report.base} ({report.base_level}, PPL {report.base_ppl:.2f}) — {report.corpus}, ctx {report.ctx}, "
        f"{report.chunks} chunks",
        fontsize=9,
    )
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


__all__ = [
    "evaluate",
    "EvalReport",
    "LevelEval",
    "load_eval_results",
    "save_report",
    "write_plot",
    "lineage_warning",
    "results_folder",
]
