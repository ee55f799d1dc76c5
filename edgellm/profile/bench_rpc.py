"""`edgellm bench --rpc`: tokens/s with the model split across llama.cpp RPC workers.

Each test runs twice in the bench worker subprocess (edgellm.profile._worker),
once on this machine alone and once split by the plan, so the network's
share of the time is measured, not guessed: share = 1 - (split t/s / local
t/s), the part of every token's time that the split adds. On loopback that
is the RPC transport itself (serialising, the loopback socket, waiting on
each worker in turn); across machines it also holds what the workers'
compute saves or costs. With --compare-llama-bench, llama.cpp's own
`llama-bench --rpc` runs against the same workers with the same split
(-ngl and -ts from the plan), the anchor for the ratio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from edgellm.engine.rpc import prepare
from edgellm.gguf.reader import read_gguf, split_set
from edgellm.models.resolve import resolve
from edgellm.profile.bench import _run_worker
from edgellm.profile.llama_bench import run_llama_bench
from edgellm.profile.settings import BenchSettings
from edgellm.progress import CancelToken, Progress, ProgressCallback, no_progress


@dataclass
class RpcBenchRow:
    model: str
    test: str
    n_prompt: int
    n_gen: int
    n_threads: int
    rpc_ts: float
    rpc_stddev_ts: float
    local_ts: float
    local_stddev_ts: float
    network_share: float  # of each token's time over RPC: 1 - rpc_ts / local_ts (0 when the split is faster)
    llama_bench_rpc_ts: Optional[float] = None
    ratio: Optional[float] = None  # rpc_ts / llama_bench_rpc_ts

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def llama_bench_args(plan: Any) -> list[str]:
    """llama-bench's flags for the plan's split: RPC devices come first in its device list, as in ours."""
    return [
        "--rpc",
        ",".join(str(w.endpoint) for w in plan.workers),
        "-ngl",
        str(plan.n_gpu_layers),
        "-ts",
        "/".join(f"{x:g}" for x in plan.tensor_split),
    ]


def bench_rpc(
    model: str,
    rpc: str,
    settings: BenchSettings = BenchSettings(),
    *,
    rpc_split: Optional[str] = None,
    compare_llama_bench: bool = False,
    on_plan: Callable[[Any], None] = lambda p: None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> tuple[Any, list[RpcBenchRow]]:
    settings.check()
    res = resolve(str(model))
    read_gguf(res.path)
    label = res.record.name if res.record else res.path.name
    n_threads, repetitions = settings.n_threads, settings.repetitions
    plan = prepare(res.path, rpc, n_ctx=settings.n_ctx or (settings.pp + settings.tg), split=rpc_split)
    on_plan(plan)
    tests = settings.tests()
    base = settings.request(res.path, [str(p) for p in split_set(res.path)])
    split = {
        "endpoints": [str(w.endpoint) for w in plan.workers],
        "n_gpu_layers": plan.n_gpu_layers,
        "tensor_split": plan.tensor_split,
    }
    runs: dict[str, list[dict]] = {}
    for k, (name, req) in enumerate([("local", base), ("rpc", {**base, "rpc": split})]):

        def forward(ev: dict[str, Any], k=k, name=name) -> None:
            on_progress(_progress(ev, k, len(tests), repetitions, f"{label} {name} {ev['test']}"))

        runs[name], _done = _run_worker(req, label=f"{label} ({name})", on_event=forward, cancel=cancel)
    local = {r["test"]: r for r in runs["local"]}
    rows = []
    for r in runs["rpc"]:
        lo = local[r["test"]]
        share = max(0.0, 1.0 - r["avg_ts"] / lo["avg_ts"]) if lo["avg_ts"] > 0 else 0.0
        rows.append(
            RpcBenchRow(
                label,
                r["test"],
                r["n_prompt"],
                r["n_gen"],
                n_threads,
                r["avg_ts"],
                r["stddev_ts"],
                lo["avg_ts"],
                lo["stddev_ts"],
                share,
            )
        )
    if compare_llama_bench:
        records = run_llama_bench([Path(res.path)], settings, extra_args=llama_bench_args(plan), cancel=cancel)
        by_test = {(int(x["n_prompt"]), int(x["n_gen"])): x for x in records}
        for row in rows:
            x = by_test.get((row.n_prompt, row.n_gen))
            if x is not None:
                row.llama_bench_rpc_ts = float(x["avg_ts"])
                row.ratio = row.rpc_ts / row.llama_bench_rpc_ts if row.llama_bench_rpc_ts > 0 else None
    return plan, rows


def _progress(ev: dict[str, Any], k: int, n_tests: int, reps: int, label: str) -> Any:
    first = ev["test"].startswith("pp")
    done = k * n_tests * reps + ev["done"] + (0 if first or n_tests == 1 else reps)
    return Progress("bench", done, 2 * n_tests * reps, "rep", f"{label} {ev['done']}/{ev['total']}")


def render(rows: list[RpcBenchRow]) -> str:
    anchor = any(r.llama_bench_rpc_ts is not None for r in rows)
    head = ["model", "test", "rpc t/s", "local t/s", "network share"] + (["llama-bench --rpc t/s", "ratio"] if anchor else [])
    table = [head]
    for r in rows:
        cells = [
            r.model,
            r.test,
            f"{r.rpc_ts:.2f} ± {r.rpc_stddev_ts:.2f}",
            f"{r.local_ts:.2f} ± {r.local_stddev_ts:.2f}",
            f"{100 * r.network_share:.0f}%",
        ]
        if anchor:
            cells += [
                "-" if r.llama_bench_rpc_ts is None else f"{r.llama_bench_rpc_ts:.2f}",
                "-" if r.ratio is None else f"{r.ratio:.3f}x",
            ]
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in table)


def as_bench_rows(plan: Any, rows: list[RpcBenchRow]) -> list[dict[str, Any]]:
    """The rows in a `BenchRow.to_json()`'s shape, for what shows both kinds in one table (the TUI's
    Bench screen): the split's speed, the layers on the workers and the plan's bytes there and here;
    what a split run does not measure is None, and `rpc` holds what only it has."""
    remote = sum(dev.total_bytes for dev in plan.devices[1:])
    workers = ", ".join(str(w.endpoint) for w in plan.workers)
    return [
        {
            "model": r.model,
            "test": r.test,
            "avg_ts": r.rpc_ts,
            "stddev_ts": r.rpc_stddev_ts,
            "ttft_seconds": None,
            "load_seconds": None,
            "n_gpu_layers": plan.n_gpu_layers,
            "device_bytes": remote,
            "host_bytes": plan.devices[0].total_bytes,
            "rss_bytes": None,
            "file_backed_bytes": None,
            "anon_bytes": None,
            "kv_bytes": None,
            "timestamp": "rpc",
            "samples_ts": [],
            "rpc": {"local_ts": r.local_ts, "network_share": r.network_share, "workers": workers},
        }
        for r in rows
    ]


__all__ = ["RpcBenchRow", "as_bench_rows", "bench_rpc", "llama_bench_args", "render"]
