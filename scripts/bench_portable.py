#!/usr/bin/env python3
"""The portable build vs the host-flags build, as ratios from one run.

`edgellm bench` (pp512, tg128) of the default model's Q4_K_M and Q8_0 (the
requantized files bench_vs_llama_bench.py makes and caches) from .venv (the
wheel built for this CPU's flags) and from .venv-portable (`setup.sh
--portable`: every CPU variant, the one edgellm chose loaded at run time),
alternating which venv goes first for each model in each round, so drift and
background load hit both alike. The headline is the median of the per-round
paired ratios portable / host-flags (goal >= 0.98). Also prints the variant
the portable build runs (its `doctor --json`).

    .venv/bin/python scripts/bench_portable.py --threads 2 --rounds 6 -r 2

Run it on an otherwise idle machine (it says the load average before/after).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _bench_common import mean_sd, paired_ratios, ratio_cells, speed_parser, verdict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

GOAL = 0.98


def bench_rows(py: Path, model: Path, args) -> dict[str, float]:
    cmd = [
        str(py),
        "-m",
        "edgellm.cli",
        "bench",
        str(model),
        "--pp",
        str(args.pp),
        "--tg",
        str(args.tg),
        "-r",
        str(args.repetitions),
        "--threads",
        str(args.threads),
        "--json",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
    data = json.loads(proc.stdout)
    rows = data if isinstance(data, list) else data.get("rows", data.get("results", []))
    return {r["test"]: float(r["avg_ts"]) for r in rows}


def main() -> int:
    ap = speed_parser(__doc__, per="bench", rounds=6)
    ap.add_argument("--host-venv", type=Path, default=ROOT / ".venv")
    ap.add_argument("--portable-venv", type=Path, default=ROOT / ".venv-portable")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()

    from bench_vs_llama_bench import default_source, quantized

    venvs = {"host": args.host_venv / "bin" / "python", "portable": args.portable_venv / "bin" / "python"}
    for name, py in venvs.items():
        if not py.exists():
            sys.exit(
                f"error: no {name} venv at {py.parent.parent} (scripts/setup.sh{' --portable --venv ' + str(args.portable_venv) if name == 'portable' else ''})"
            )
    doc = subprocess.run([str(venvs["portable"]), "-m", "edgellm.cli", "doctor", "--json"], capture_output=True, text=True)
    cb = (json.loads(doc.stdout) if doc.stdout.strip().startswith("{") else {}).get("cpu_backend") or {}
    if not cb:
        sys.exit(
            f"error: {args.portable_venv} does not run a portable build (no cpu_backend in doctor): {doc.stderr.strip()[-300:]}"
        )
    src = default_source()
    levels = [lv.strip().lower() for lv in args.levels.split(",") if lv.strip()]
    files = [quantized(src, lv) for lv in levels]
    print(f"portable variant: {cb['variant']} ({cb['source']}): {cb['reason']}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    load0 = os.getloadavg()
    got: dict[tuple[str, str, str], list[float]] = {}
    t0 = time.time()
    for rnd in range(args.rounds):
        for mi, f in enumerate(files):
            order = ["host", "portable"] if (rnd + mi) % 2 == 0 else ["portable", "host"]
            for v in order:
                for test, ts in bench_rows(venvs[v], f, args).items():
                    got.setdefault((v, f.name, test), []).append(ts)
        print(f"round {rnd + 1}/{args.rounds} done ({time.time() - t0:.0f} s)", file=sys.stderr)
    load1 = os.getloadavg()
    results = []
    print()
    print(f"{'model':44} {'test':6} {'host t/s':>17} {'portable t/s':>17} {'mean/mean':>9} {'median paired':>13}")
    keys = sorted({(m, t) for _, m, t in got}, key=lambda k: (k[0], not k[1].startswith("pp")))
    for m, t in keys:
        a, b = got[("host", m, t)], got[("portable", m, t)]
        per_round, ratio = paired_ratios(b, a)
        (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
        results.append(
            {
                "model": m,
                "test": t,
                "host_ts": ma,
                "portable_ts": mb,
                "ratio_of_means": mb / ma,
                "ratio": ratio,
                "per_round_ratio": per_round,
            }
        )
        print(
            f"{m:44} {t:6} {ratio_cells(ma, sa, mb, sb, mb / ma, ratio, GOAL)}   rounds: {' '.join(f'{r:.2f}' for r in per_round)}"
        )
    print()
    print(f"threads {args.threads}, {args.rounds} rounds x {args.repetitions} repetitions per call, venvs alternating first")
    worst = verdict(results, GOAL, load0, load1, "portable/host ")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "variant": cb,
                    "results": results,
                    "threads": args.threads,
                    "rounds": args.rounds,
                    "repetitions": args.repetitions,
                    "load": [load0, load1],
                },
                indent=1,
            )
            + "\n"
        )
    return 0 if worst >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
