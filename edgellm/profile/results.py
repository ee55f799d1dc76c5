"""Bench results kept per model and machine under `results_dir()/bench/` (read by `recommend` and the TUI), and the `--plot` PNG."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from edgellm.engine.hardware import cpu_model, memory
from edgellm.errors import UsageError
from edgellm.fsutil import atomic_path, atomic_write_text
from edgellm.paths import results_dir
from edgellm.plot import pyplot
from edgellm.profile.rows import Bandwidth, BenchRow

log = logging.getLogger(__name__)


# -- results in the store --------------------------------------------------------


def machine_id() -> str:
    """A short stable id of this machine: host, CPU, core count and RAM."""

    try:
        ram = memory().total_bytes
    except Exception:
        ram = 0
    key = f"{platform.node()}|{platform.machine()}|{cpu_model()}|{os.cpu_count()}|{ram >> 30}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _results_folder() -> Path:
    return results_dir() / "bench"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def save_results(model: str, rows: list[BenchRow], *, bandwidth: Optional[Bandwidth] = None) -> Path:
    """Write this model's latest figures on this machine (atomic; one file per model and machine)."""

    mid = rows[0].machine_id if rows else machine_id()
    doc = {
        "model": model,
        "machine_id": mid,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "timestamp": rows[0].timestamp if rows else time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "bandwidth": bandwidth.to_json() if bandwidth else None,
        "rows": [r.to_json() for r in rows],
    }
    target = _results_folder() / f"{_safe(model)}-{mid}.json"
    atomic_write_text(target, json.dumps(doc, indent=2))
    return target


def load_bench_results(model_name: Optional[str] = None, *, all_machines: bool = False) -> list[dict[str, Any]]:
    """Saved rows (dicts, newest file first), of this machine unless `all_machines`; unreadable files are skipped."""
    folder = _results_folder()
    if not folder.is_dir():
        return []
    mid = machine_id()
    out: list[dict[str, Any]] = []
    for f in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            log.warning("skipping unreadable bench result %s", f)
            continue
        if model_name is not None and doc.get("model") != model_name:
            continue
        if not all_machines and doc.get("machine_id") != mid:
            continue
        for row in doc.get("rows", []):
            out.append(dict(row, model=doc.get("model"), machine_id=doc.get("machine_id")))
    return out


# -- plot -----------------------------------------------------------------------


def write_plot(rows: Sequence[BenchRow], path: Path | str) -> Path:
    """A PNG of tokens/s per model (level): pp and tg bars with ± sd; matplotlib if installed."""

    path = Path(path)
    if not rows:
        raise UsageError("nothing to plot")
    labels: list[str] = []
    for r in rows:
        if r.model not in labels:
            labels.append(r.model)
    tests = sorted({r.test for r in rows}, key=lambda t: (not t.startswith("pp"), t))
    series = {
        t: [next(((r.avg_ts, r.stddev_ts) for r in rows if r.model == m and r.test == t), (0.0, 0.0)) for m in labels]
        for t in tests
    }
    levels = [next(r.model_type for r in rows if r.model == m) for m in labels]
    if len(set(levels)) == len(levels) and all(levels):
        labels = levels  # "tokens/s per level" reads best with the level alone
    plt = pyplot()
    with atomic_path(path) as tmp:
        fig, axes = plt.subplots(1, len(tests), figsize=(4 * len(tests), 3.5), squeeze=False)
        for ax, t in zip(axes[0], tests, strict=False):
            vals = series[t]
            ax.bar(range(len(labels)), [v for v, _ in vals], yerr=[s for _, s in vals], capsize=3)
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
            ax.set_title(f"{t} tokens/s")
        fig.tight_layout()
        fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
    return path
