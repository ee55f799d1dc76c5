#!/usr/bin/env python3
"""edgellm bench vs llama-bench, as ratios from one run.

Makes the default model's Q4_K_M and Q8_0 (requantized from the shipped Q4_1
with llama.cpp's own quantizer, allow_requantize: speed is the point here,
not quality), then runs pp512 and tg128 through `edgellm.profile.bench.bench` and
through `llama-bench` (built from the same vendored llama.cpp with the same
CPU flags by scripts/build_llama_tools.sh), alternating which tool goes first
for each model in each round, so drift and background load hit both alike.
Prints per test each tool's mean avg_ts over the rounds, the ratio of those
means, and the median of the per-round paired ratios (the headline figure,
robust to a burst of load landing on one call; goal >= 0.97).

    .venv/bin/python scripts/bench_vs_llama_bench.py --threads 2 --rounds 10 -r 2
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

from _bench_common import mean_sd, paired_ratios, ratio_cells, speed_parser, verdict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FTYPES = {"q4_k_m": 15, "q8_0": 7}
GOAL = 0.97


def default_source() -> Path:
    from edgellm.models.catalog import load_catalog
    from edgellm.errors import ModelNotFound
    from edgellm.models.pull import pull
    from edgellm.models.resolve import resolve

    name = load_catalog().default.name
    try:
        return resolve(name).path
    except ModelNotFound:
        print(f"pulling {name} ...", file=sys.stderr)
        return pull(name).path


def quantized(src: Path, level: str) -> Path:
    import llama_cpp

    from edgellm.paths import cache_dir

    out = cache_dir() / "bench-models" / f"{src.stem}-requant-{level}.gguf"
    if out.is_file() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.partial")
    quiet = llama_cpp.llama_log_callback(lambda level, text, ud: None)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))  # the per-tensor log would bury the figures
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[level]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        sys.exit(f"error: quantizing {src.name} to {level} failed")
    os.replace(tmp, out)
    return out


def main() -> int:
    ap = speed_parser(
        __doc__, per="tool", rounds=10, rounds_help="rounds; each runs both tools once per model, alternating first"
    )
    ap.add_argument("--source", type=Path, default=None, help="GGUF to requantize (default: the catalog default model)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()

    from edgellm.profile.bench import bench, measure_bandwidth_now
    from edgellm.profile.llama_bench import find_llama_bench, run_llama_bench
    from edgellm.profile.settings import BenchSettings

    src = args.source or default_source()
    levels = [lv.strip().lower() for lv in args.levels.split(",") if lv.strip()]
    files = [quantized(src, lv) for lv in levels]
    exe = find_llama_bench()
    print(f"source {src.name}, requantized to {', '.join(levels)} with llama_model_quantize(allow_requantize=True)")
    print(f"llama-bench {exe}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    ours: dict[tuple[str, str], list[float]] = {}
    theirs: dict[tuple[str, str], list[float]] = {}
    settings = BenchSettings(pp=args.pp, tg=args.tg, repetitions=args.repetitions, threads=args.threads)
    t_start = time.time()
    for rnd in range(args.rounds):
        # one model at a time, the tools alternating who goes first: a burst of background load
        # then lands on one pair, and the median of the paired ratios shrugs it off
        for mi, f in enumerate(files):
            order = ["edgellm", "llama-bench"] if (rnd + mi) % 2 == 0 else ["llama-bench", "edgellm"]
            for tool in order:
                if tool == "edgellm":
                    for row in bench([f], settings, measure_bandwidth=False, save=False):
                        ours.setdefault((f.name, row.test), []).append(row.avg_ts)
                else:
                    for rec in run_llama_bench([f], settings, exe=exe):
                        test = f"pp{rec['n_prompt']}" if rec["n_prompt"] else f"tg{rec['n_gen']}"
                        theirs.setdefault((f.name, test), []).append(float(rec["avg_ts"]))
        print(f"round {rnd + 1}/{args.rounds} done ({time.time() - t_start:.0f} s)", file=sys.stderr)
    bw = measure_bandwidth_now(threads=args.threads)
    load1 = os.getloadavg() if hasattr(os, "getloadavg") else None

    results = []
    print()
    print(f"{'model':48} {'test':6} {'edgellm t/s':>17} {'llama-bench t/s':>17} {'mean/mean':>9} {'median paired':>13}")
    for key in sorted(ours, key=lambda k: (k[0], not k[1].startswith("pp"))):
        a, b = ours[key], theirs.get(key, [])
        if not b:
            continue
        (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
        per_round, ratio = paired_ratios(a, b)
        results.append(
            {
                "model": key[0],
                "test": key[1],
                "edgellm_ts": ma,
                "edgellm_sd": sa,
                "llama_bench_ts": mb,
                "llama_bench_sd": sb,
                "ratio_of_means": ma / mb,
                "ratio": ratio,
                "per_round_ratio": per_round,
            }
        )
        print(f"{key[0]:48} {key[1]:6} {ratio_cells(ma, sa, mb, sb, ma / mb, ratio, GOAL)}")
    print()
    print(f"threads {args.threads}, {args.rounds} rounds x {args.repetitions} repetitions per tool, tools alternating first")
    print(f"memory bandwidth ({bw.reader}, {args.threads} threads, best of 5): read {bw.read_bytes_per_s / 1e9:.1f} GB/s")
    verdict(results, GOAL, load0, load1)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "results": results,
                    "threads": args.threads,
                    "rounds": args.rounds,
                    "repetitions": args.repetitions,
                    "load": [load0, load1],
                    "bandwidth_read": bw.read_bytes_per_s,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
