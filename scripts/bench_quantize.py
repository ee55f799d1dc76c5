#!/usr/bin/env python3
"""edgellm quantize vs llama.cpp's llama-quantize: speed and identical output.

Both sides quantize the same F16 GGUF with the same total thread count,
`--runs` times, alternating which goes first so drift in machine load hits
both alike. Two comparisons, each a ratio of medians against llama-quantize
(built from the same vendored llama.cpp with the same CPU flags by
scripts/build_llama_tools.sh; goal <= 1.03):

  four levels (the headline)
      llama-quantize once per level, one after another (a shell loop), vs
      ONE `edgellm quantize IN -l q4_0 -l q4_k_m -l q5_k_m -l q8_0` CLI call,
      which runs two levels side by side on half the threads each

  one level per call, per level
      llama-quantize   the tool
      llama_model_quantize call   the same C call inside edgellm's worker
                       (the engine alone, without edgellm's checks)
      edgellm API      quant.quantize.quantize(): worker process, llama.cpp,
                       validation, sha256, fsync, store registration
      edgellm CLI      `python -m edgellm.cli quantize ...` end to end (adds
                       the interpreter and CLI start-up)

Every edgellm file must be byte-identical to llama-quantize's (or at least
tensor-identical); the script exits 1 if one is not.

    .venv/bin/python scripts/bench_quantize.py                 # F16 of the default model
    .venv/bin/python scripts/bench_quantize.py --input model-f16.gguf --threads 2 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def default_f16(home: Path) -> Path:
    """Pull the default model and convert it to F16 in a scratch store."""
    from edgellm.models.pull import pull
    from quant.convert import convert

    rec = pull("smollm2-135m-instruct")
    return convert(rec.name, "f16").path


def tensors_equal(a: Path, b: Path) -> bool:
    import numpy as np

    from quant.convert import _read_for_copy

    ta = {t.name: t for t in _read_for_copy(a).tensors}
    tb = {t.name: t for t in _read_for_copy(b).tensors}
    return set(ta) == set(tb) and all(
        ta[n].tensor_type == tb[n].tensor_type and np.array_equal(ta[n].data, tb[n].data) for n in ta
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", type=Path, help="F16/F32/BF16 GGUF (default: F16 of the default model)")
    ap.add_argument("--levels", default="q4_0,q4_k_m,q5_k_m,q8_0")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores")
    ap.add_argument("--llama-quantize", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-quantize-"))
    os.environ["EDGELLM_HOME"] = str(scratch / "home")
    from edgellm.profile.llama_bench import find_llama_tool
    from edgellm.engine.runtime import default_threads
    from quant.levels import parse_level
    from quant.quantize import quantize

    threads = args.threads or default_threads()
    tool = args.llama_quantize or find_llama_tool("llama-quantize")
    src = (args.input or default_f16(scratch)).resolve()
    levels = [parse_level(x) for x in args.levels.split(",") if x.strip()]
    print(f"input {src.name}, {threads} threads, {args.runs} runs per level, llama-quantize: {tool}", flush=True)

    def run_tool(lv, out: Path) -> float:
        t0 = time.perf_counter()
        p = subprocess.run([str(tool), str(src), str(out), lv.name, str(threads)], capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if p.returncode != 0:
            sys.exit(f"llama-quantize failed: {p.stderr[-500:]}")
        return dt

    core: dict[str, list[float]] = {}

    def run_api(lv, out: Path) -> float:
        t0 = time.perf_counter()
        res = quantize(src, [lv.key], output=out, threads=threads, force=True)
        core.setdefault(lv.key, []).append(res[0].quantize_seconds)  # llama_model_quantize alone
        return time.perf_counter() - t0

    def quantize_cli(level_args: list[str], out: Path) -> tuple[float, str]:
        """`python -m edgellm.cli quantize` of src to `out`: its wall seconds and its --json stdout."""
        cmd = [
            sys.executable,
            "-m",
            "edgellm.cli",
            "quantize",
            str(src),
            *level_args,
            "-o",
            str(out),
            "--threads",
            str(threads),
            "--force",
            "--json",
            "--no-progress",
        ]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        dt = time.perf_counter() - t0
        if p.returncode != 0:
            sys.exit(f"edgellm quantize failed: {p.stderr[-500:]}")
        return dt, p.stdout

    def run_cli(lv, out: Path) -> float:
        return quantize_cli(["-l", lv.key], out)[0]

    def run_tool_all(outs: dict[str, Path]) -> float:
        return sum(run_tool(lv, outs[lv.key]) for lv in levels)

    def run_cli_all(folder: Path) -> tuple[float, dict[str, Path]]:
        folder.mkdir(exist_ok=True)
        dt, stdout = quantize_cli([a for lv in levels for a in ("-l", lv.key)], folder)
        return dt, {o["level"]: Path(o["path"]) for o in json.loads(stdout)}

    # the headline: all levels, llama-quantize one after another vs one edgellm call
    refs = {lv.key: scratch / f"ref-{lv.key}.gguf" for lv in levels}
    all_times: dict[str, list[float]] = {"llama-quantize": [], "cli": []}
    cli_files: dict[str, Path] = {}
    for i in range(args.runs):
        for key in ("llama-quantize", "cli") if i % 2 == 0 else ("cli", "llama-quantize"):
            if key == "cli":
                dt, cli_files = run_cli_all(scratch / "all")
            else:
                dt = run_tool_all(refs)
            all_times[key].append(dt)
    all_med = {k: statistics.median(v) for k, v in all_times.items()}
    all_same = {lv.key: _identical(cli_files[lv.key], refs[lv.key]) for lv in levels}
    print(
        f"{len(levels)} levels  llama-quantize one after another {all_med['llama-quantize']:6.2f} s   "
        f"one edgellm CLI call {all_med['cli']:6.2f} s (x{all_med['cli'] / all_med['llama-quantize']:.3f}, goal <= 1.03)   "
        f"runs: {' '.join(f'{x:.2f}' for x in all_times['llama-quantize'])} vs {' '.join(f'{x:.2f}' for x in all_times['cli'])}   "
        f"outputs identical: {', '.join(f'{k} {v}' for k, v in all_same.items())}",
        flush=True,
    )

    rows = []
    for lv in levels:
        ref, api_out, cli_out = scratch / f"ref-{lv.key}.gguf", scratch / f"api-{lv.key}.gguf", scratch / f"cli-{lv.key}.gguf"
        times: dict[str, list[float]] = {"llama-quantize": [], "api": [], "cli": []}
        order = [("llama-quantize", run_tool, ref), ("api", run_api, api_out), ("cli", run_cli, cli_out)]
        for i in range(args.runs):
            seq = order if i % 2 == 0 else order[::-1]
            for key, fn, out in seq:
                times[key].append(fn(lv, out))
        times["core"] = core[lv.key]
        med = {k: statistics.median(v) for k, v in times.items()}
        a, c = _identical(api_out, ref), _identical(cli_out, ref)
        identical = "DIFFERENT" if "DIFFERENT" in (a, c) else ("tensors" if "tensors" in (a, c) else "bytes")
        rows.append(
            {
                "level": lv.key,
                "median_s": med,
                "runs_s": times,
                "ratio_api": med["api"] / med["llama-quantize"],
                "ratio_cli": med["cli"] / med["llama-quantize"],
                "ratio_core": med["core"] / med["llama-quantize"],
                "identical": identical,
                "size_bytes": ref.stat().st_size,
            }
        )
        print(
            f"{lv.key:8} llama-quantize {med['llama-quantize']:6.2f} s   llama_model_quantize call {med['core']:6.2f} s "
            f"(x{rows[-1]['ratio_core']:.3f})   edgellm API {med['api']:6.2f} s "
            f"(x{rows[-1]['ratio_api']:.3f})   edgellm CLI {med['cli']:6.2f} s (x{rows[-1]['ratio_cli']:.3f})   "
            f"output identical: {identical}",
            flush=True,
        )

    tot = {k: sum(r["median_s"][k] for r in rows) for k in ("llama-quantize", "core", "api", "cli")}
    print(
        f"{'all':8} llama-quantize {tot['llama-quantize']:6.2f} s   llama_model_quantize call {tot['core']:6.2f} s "
        f"(x{tot['core'] / tot['llama-quantize']:.3f})   edgellm API {tot['api']:6.2f} s "
        f"(x{tot['api'] / tot['llama-quantize']:.3f})   edgellm CLI {tot['cli']:6.2f} s (x{tot['cli'] / tot['llama-quantize']:.3f})   goal <= 1.03"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "threads": threads,
                    "runs": args.runs,
                    "input": str(src),
                    "levels": rows,
                    "all_levels": {
                        "runs_s": all_times,
                        "median_s": all_med,
                        "ratio_cli": all_med["cli"] / all_med["llama-quantize"],
                        "identical": all_same,
                    },
                },
                indent=1,
            )
        )
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)
    ok = all(r["identical"] != "DIFFERENT" for r in rows) and "DIFFERENT" not in all_same.values()
    return 0 if ok else 1


def _identical(a: Path, b: Path) -> str:
    from edgellm.fsutil import sha256_file

    if sha256_file(a) == sha256_file(b):
        return "bytes"
    return "tensors" if tensors_equal(a, b) else "DIFFERENT"


if __name__ == "__main__":
    sys.exit(main())
