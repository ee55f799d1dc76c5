"""An evaluation's report: the per-level figures, the JSON files they are saved
in, and the size-vs-quality plot.

`quant.evaluate` measures and fills an `EvalReport`; the TUI, `recommend()`
and `eval --plot` read reports back through this module without loading the
evaluation itself (numpy, llama.cpp).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm import paths
from edgellm.errors import UsageError
from edgellm.fsutil import atomic_path, atomic_write_text
from edgellm.plot import pyplot

log = logging.getLogger(__name__)

RESULTS_SUBDIR = "eval"


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
