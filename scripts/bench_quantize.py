#!/usr/bin/env python3
"""edgellm quantize vs llama.cpp's llama-quantize: speed and identical output.

Both sides quantize the same F16 GGUF with the same thread count, one level
per call, `--runs` times per level, alternating which goes first so drift in
machine load hits both alike. Reported per level: median wall seconds of

  llama-quantize   the tool built from the same vendored llama.cpp with the
                   same CPU flags (scripts/build_llama_tools.sh)
  llama_model_quantize call   the same C call inside edgellm's worker (the
                   engine alone, without edgellm's checks around it)
  edgellm API      quant.quantize.quantize(): worker process, llama.cpp,
                   validation, sha256, store registration
  edgellm CLI      `python -m edgellm.cli quantize ...` end to end (adds the
                   interpreter and CLI start-up)

and the ratio of medians against llama-quantize (goal: <= 1.03). It also
checks that edgellm's file is byte-identical to llama-quantize's (or at least
tensor-identical) for every level.

    .venv/bin/python scripts/bench_quantize.py                 # F16 of the default model
    .venv/bin/python scripts/bench_quantize.py --input model-f16.gguf --threads 2 --runs 3
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


def llama_quantize_bin() -> Path:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_tools.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"building llama-quantize failed: {out.stderr[-500:]}")
    return Path(out.stdout.strip().splitlines()[-1]) / "llama-quantize"


def default_f16(home: Path) -> Path:
    """Pull the default model and convert it to F16 in a scratch store."""
    from edgellm import models
    from quant.convert import convert

    rec = models.pull("smollm2-135m-instruct")
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
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores")
    ap.add_argument("--llama-quantize", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-quantize-"))
    os.environ["EDGELLM_HOME"] = str(scratch / "home")
    from edgellm.fsutil import sha256_file
    from edgellm.runtime import default_threads
    from quant.levels import parse_level
    from quant.quantize import quantize

    threads = args.threads or default_threads()
    tool = args.llama_quantize or llama_quantize_bin()
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

    def run_cli(lv, out: Path) -> float:
        cmd = [sys.executable, "-m", "edgellm.cli", "quantize", str(src), "-l", lv.key, "-o", str(out),
               "--threads", str(threads), "--force", "--json", "--no-progress"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        dt = time.perf_counter() - t0
        if p.returncode != 0:
            sys.exit(f"edgellm quantize failed: {p.stderr[-500:]}")
        return dt

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
        same = sha256_file(api_out) == sha256_file(ref) == sha256_file(cli_out)
        identical = "bytes" if same else ("tensors" if tensors_equal(api_out, ref) else "DIFFERENT")
        rows.append({"level": lv.key, "median_s": med, "runs_s": times, "ratio_api": med["api"] / med["llama-quantize"],
                     "ratio_cli": med["cli"] / med["llama-quantize"], "ratio_core": med["core"] / med["llama-quantize"],
                     "identical": identical,
                     "size_bytes": ref.stat().st_size})
        print(f"{lv.key:8} llama-quantize {med['llama-quantize']:6.2f} s   llama_model_quantize call {med['core']:6.2f} s "
              f"(x{rows[-1]['ratio_core']:.3f})   edgellm API {med['api']:6.2f} s "
              f"(x{rows[-1]['ratio_api']:.3f})   edgellm CLI {med['cli']:6.2f} s (x{rows[-1]['ratio_cli']:.3f})   "
              f"output identical: {identical}", flush=True)

    tot = {k: sum(r["median_s"][k] for r in rows) for k in ("llama-quantize", "core", "api", "cli")}
    print(f"{'all':8} llama-quantize {tot['llama-quantize']:6.2f} s   llama_model_quantize call {tot['core']:6.2f} s "
          f"(x{tot['core'] / tot['llama-quantize']:.3f})   edgellm API {tot['api']:6.2f} s "
          f"(x{tot['api'] / tot['llama-quantize']:.3f})   edgellm CLI {tot['cli']:6.2f} s (x{tot['cli'] / tot['llama-quantize']:.3f})   goal <= 1.03")
    if args.json:
        print(json.dumps({"threads": threads, "runs": args.runs, "input": str(src), "levels": rows}, indent=1))
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(r["identical"] != "DIFFERENT" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
