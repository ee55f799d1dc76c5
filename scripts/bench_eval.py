#!/usr/bin/env python3
"""edgellm ppl/eval vs llama-perplexity, in one run: agreement and wall time.

On the default model's F16 base (dequantized from Q4_1) and its four levels
(q4_0, q4_k_m, q5_k_m, q8_0), on WikiText-2 test, ctx 512, the first N
chunks (default 40), same llama.cpp build, same CPU flags, same threads:

  1. PPL of the base: `edgellm ppl` vs `llama-perplexity`, and the wall-time
     ratio of the two processes (goal <= 1.10);
  2. `edgellm eval` of the four levels vs `llama-perplexity
     --kl-divergence-base` + `--kl-divergence`: PPL, mean KLD, same-top-p;
  3. the table (markdown) and the plot, ready for docs/quality.md.

Usage: .venv/bin/python scripts/bench_eval.py [--chunks 40] [--threads N] [--out docs]
Runs in a scratch EDGELLM_HOME; needs ~2 GB of scratch disk for llama.cpp's
own KLD base file (2 bytes x vocab x tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEVELS = ["q8_0", "q4_k_m", "q5_k_m", "q4_0"]


def sh(cmd: list[str], env: dict, *, check: bool = True) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if check and p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return p, dt


def edgellm(*args, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    return sh([sys.executable, "-m", "edgellm.cli", *map(str, args)], env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--text", type=Path, default=ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw")
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    ap.add_argument("--skip-timing", action="store_true", help="Skip the plain ppl timing runs.")
    ap.add_argument("--rounds", type=int, default=1, help="Timing rounds; each tool's best round counts (default 1).")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from edgellm.engine.hardware import cpu_model
    from edgellm.profile.llama_bench import find_llama_tool
    from edgellm.engine.runtime import default_threads

    threads = a.threads or default_threads()
    tool = str(find_llama_tool("llama-perplexity"))
    scratch = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    env = dict(os.environ, EDGELLM_HOME=str(scratch / "home"))
    common = ["-f", str(a.text), "-c", str(a.ctx), "-b", "2048", "--chunks", str(a.chunks), "-t", str(threads)]
    # the same text, ctx, chunks and threads, in edgellm's flags
    ours = ["--text", a.text, "--ctx", a.ctx, "--chunks", a.chunks, "--threads", threads]

    print(f"# scratch {scratch}; {threads} threads; {a.chunks} chunks of {a.ctx}", flush=True)
    edgellm("pull", "smollm2-135m-instruct", "--json", "--no-progress", env=env)
    conv, _ = edgellm("convert", "smollm2-135m-instruct-q4_1", "--to", "f16", "--json", "--no-progress", env=env)
    base = json.loads(conv.stdout)
    q, _ = edgellm("quantize", base["name"], "-l", ",".join(LEVELS), "--json", "--no-progress", env=env)
    paths = {r["level"]: r["path"] for r in json.loads(q.stdout)}

    result: dict = {
        "chunks": a.chunks,
        "ctx": a.ctx,
        "threads": threads,
        "machine": f"{cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()}",
    }
    if not a.skip_timing:
        # Alternate the two tools; each one's best round counts (the machine may be shared).
        t_ll, t_ed = [], []
        for _ in range(max(1, a.rounds)):
            p, dt = sh([tool, "-m", base["path"], *common], env)
            t_ll.append(dt)
            ll_ppl = float(re.search(r"Final estimate: PPL = ([\d.]+)", p.stdout + p.stderr).group(1))
            p2, dt2 = edgellm("ppl", base["name"], *ours, "--json", "--no-progress", env=env)
            t_ed.append(dt2)
            ed = json.loads(p2.stdout)
        result["ppl"] = {
            "llama": ll_ppl,
            "edgellm": ed["ppl"],
            "edgellm_err": ed["ppl_err"],
            "rel_diff": ed["ppl"] / ll_ppl - 1,
            "llama_seconds": min(t_ll),
            "edgellm_seconds": min(t_ed),
            "wall_ratio": min(t_ed) / min(t_ll),
        }
        print(json.dumps(result["ppl"], indent=1), flush=True)

    plot = a.out / "quality-smollm2-135m.png"
    t0 = time.perf_counter()
    ev, _ = edgellm("eval", base["name"], "--levels", ",".join(LEVELS), *ours, "--plot", plot, "--json", "--no-progress", env=env)
    rep = json.loads(ev.stdout)
    result["edgellm_eval_seconds"] = time.perf_counter() - t0
    kld_file = scratch / "base.kld"
    t0 = time.perf_counter()
    p, _ = sh([tool, "-m", base["path"], *common, "--kl-divergence-base", str(kld_file)], env)
    result["llama_base_ppl"] = float(re.search(r"Final estimate: PPL = ([\d.]+)", p.stdout + p.stderr).group(1))
    ref = {}
    for lv in LEVELS:
        p, _ = sh([tool, "-m", paths[lv], *common, "--kl-divergence-base", str(kld_file), "--kl-divergence"], env)
        t = p.stdout + p.stderr
        ref[lv] = {
            "ppl": float(re.search(r"Mean PPL\(Q\)\s+:\s+([\d.]+)", t).group(1)),
            "kld": float(re.search(r"Mean\s+KLD:\s+([\d.]+)", t).group(1)),
            "same_top_p": float(re.search(r"Same top p:\s+([\d.]+)", t).group(1)),
        }
    result["llama_kld_seconds"] = time.perf_counter() - t0
    result["llama_kld_file_bytes"] = kld_file.stat().st_size
    kld_file.unlink()
    cached = list((scratch / "home" / "results" / "eval" / "logprobs").glob("*.npz"))
    result["edgellm_logprobs_bytes"] = cached[0].stat().st_size if cached else None

    rows = []
    by = {lv["level"]: lv for lv in rep["levels"]}
    for lv in LEVELS:
        e, r = by[lv], ref[lv]
        rows.append(
            {
                "level": lv,
                "size_bytes": e["size_bytes"],
                "bpw": e["bpw"],
                "ppl": e["ppl"],
                "ppl_err": e["ppl_err"],
                "dppl_pct": e["dppl_pct"],
                "kld_mean": e["kld_mean"],
                "kld_err": e["kld_err"],
                "kld_median": e["kld_median"],
                "kld_p99": e["kld_p99"],
                "kld_max": e["kld_max"],
                "same_top_p": e["same_top_p"],
                "rms_dp": e["rms_dp"],
                "tokens_per_second": e["tokens_per_second"],
                "llama": r,
                "ppl_rel_diff": e["ppl"] / r["ppl"] - 1,
                "kld_rel_diff": e["kld_mean"] / r["kld"] - 1,
                "top_rel_diff": e["same_top_p"] / r["same_top_p"] - 1,
            }
        )
    result.update(
        base=rep["base"], base_ppl=rep["base_ppl"], base_ppl_err=rep["base_ppl_err"], levels=rows, warnings=rep["warnings"]
    )
    out_json = a.out / "bench_eval.json"
    out_json.write_text(json.dumps(result, indent=1) + "\n")

    print(
        f"\nbase {rep['base']}: PPL {rep['base_ppl']:.4f} ± {rep['base_ppl_err']:.4f} (llama-perplexity {result['llama_base_ppl']:.4f})"
    )
    print(
        "| level | size | bpw | PPL | ΔPPL | mean KLD | median | 99% | max | same top | RMS Δp | llama KLD | llama top | ΔKLD | Δtop |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['level']} | {r['size_bytes'] / 2**20:.1f} MiB | {r['bpw']:.2f} | {r['ppl']:.4f} ± {r['ppl_err']:.4f} | {r['dppl_pct']:+.2f}% "
            f"| {r['kld_mean']:.5f} ± {r['kld_err']:.5f} | {r['kld_median']:.5f} | {r['kld_p99']:.4f} | {r['kld_max']:.4f} "
            f"| {r['same_top_p']:.2f}% | {r['rms_dp']:.2f}% | {r['llama']['kld']:.6f} | {r['llama']['same_top_p']:.3f}% "
            f"| {100 * r['kld_rel_diff']:+.2f}% | {100 * r['top_rel_diff']:+.3f}% |"
        )
    if "ppl" in result:
        print(
            f"\nppl wall time: edgellm {result['ppl']['edgellm_seconds']:.1f} s, llama-perplexity {result['ppl']['llama_seconds']:.1f} s, "
            f"ratio {result['ppl']['wall_ratio']:.3f} (goal <= 1.10)"
        )
    print(
        f"KLD base data: llama.cpp {result['llama_kld_file_bytes'] / 2**20:.0f} MiB, edgellm {(result['edgellm_logprobs_bytes'] or 0) / 2**20:.1f} MiB"
    )
    print(f"written: {out_json}, {plot}")


if __name__ == "__main__":
    main()
