#!/usr/bin/env python3
"""Figures for docs/quantize.md: importance matrix, --budget recipes and --recipe speed, in one run.

On the default model's F16 (dequantized from Q4_1: a Q4_1 quant reproduces
it almost exactly, so every figure is given with q4_1 excluded from the
search too), with evaluation on WikiText-2's test split (never the
calibration text), ctx 512, --chunks (>= 40):

1. agreement: `edgellm imatrix` vs `llama-imatrix` from the same tree on the
   same text, ctx and chunks: largest per-tensor relative difference (goal
   <= 1e-4), equal counts;
2. identity: `quantize --imatrix FILE` vs `llama-quantize --imatrix FILE`:
   sha256 of the outputs (goal: equal) at every level below;
3. mean KLD without vs with the matrix at Q2_K, Q3_K_M, IQ4_XS, Q4_K_M;
4. --budget at each stock level's file size (Q2_K, Q3_K_M, Q4_0, Q4_K_M):
   size and mean KLD, all types allowed and with q4_1,q5_1 excluded, as a ratio
   to `llama-quantize --imatrix` at that level with the same matrix (goal
   <= 0.8), with the search's cost apart from the quantization's (each
   `--budget --no-error-feedback`: the search alone); with --error-feedback,
   the excluded ones again with feedback, --budget's default (--only-budget:
   this part alone, with the KLDs its ratios are to);
5. --recipe speed: `quantize --recipe` vs `llama-quantize --tensor-type-file`
   with the same per-tensor types and threads, median of --runs (goal <= 1.03).

    .venv/bin/python scripts/bench_imatrix.py --chunks 40 --threads 2 --json figures.json
    .venv/bin/python scripts/bench_imatrix.py --only-speed --threads 2 --runs 9    # part 5 alone, minutes
    .venv/bin/python scripts/bench_imatrix.py --only-budget --error-feedback --chunks 40 --json grid-fb.json
    .venv/bin/python scripts/bench_imatrix.py --gridless 1 --gridless 4 --chunks 20 --json gridless.json

6. --gridless F (repeatable; with it only this part runs): the default model
   dithered (scripts/make_wide_model.py --factor F --dither: no quantization
   grid, and at F = 4 rows of 2304/6144/768, so no K-quant falls back), then
   on it: `llama-quantize --imatrix` at Q3_K_M, Q4_K_M, Q5_K_M and IQ4_XS
   (the Q4_K_M run timed), `--budget` at each one's file size (no type
   excluded): size, mean KLD and the ratio to llama-quantize's (goal <= 0.8),
   search seconds against the timed Q4_K_M run (goal <= 10x), and the
   search's extra disk (files under EDGELLM_HOME beyond the output, sampled
   every 0.2 s) against one Q8_0 file (goal <= 1.5x).

Needs llama.cpp's tools (scripts/build_llama_tools.sh, or $EDGELLM_LLAMA_TOOLS)
and ../shared/data/wikitext-2-raw (or $EDGELLM_CORPUS_DIR). Long: an hour or
more on 2 cores; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from quant import rounding  # noqa: E402  (a recipe's rounding -> llama-quantize's GGML_QUANT_REFINE)

IMATRIX_LEVELS = ["q2_k", "q3_k_m", "iq4_xs", "q4_k_m"]
BUDGET_LEVELS = ["q2_k", "q3_k_m", "q4_0", "q4_k_m"]
GRIDLESS_LEVELS = ["q3_k_m", "q4_k_m", "q5_k_m", "iq4_xs"]


def sh(args: list[str], env: dict, timeout: float = 7200, stderr: bool = False) -> str:
    proc = subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, args))}\n{proc.stderr[-3000:]}")
    return proc.stdout + (proc.stderr if stderr else "")


def edgellm(env: dict, *args: str, timeout: float = 7200):
    out = sh([sys.executable, "-m", "edgellm.cli", *args], env, timeout)
    return json.loads(out) if "--json" in args else out


def quantize(env: dict, base: str, t: str, *args) -> list[dict]:
    """`edgellm quantize BASE ARGS` on `t` threads: the JSON record of each file it made."""
    return edgellm(env, "quantize", base, *args, "--threads", t, "--json", "--no-progress")


def report(fig: dict, args) -> int:
    """The figures on stdout, and in --json's file when given."""
    text = json.dumps(fig, indent=1, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


def sha(p: Path | str) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tools_dir() -> Path:
    env = os.environ.get("EDGELLM_LLAMA_TOOLS")
    if env:
        return Path(env)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_tools.sh")], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def kld(env: dict, base: str, names: list[str], args) -> dict[str, dict]:
    rep = edgellm(
        env,
        "eval",
        base,
        "--levels",
        ",".join(names),
        "--corpus",
        "wikitext-2",
        "--ctx",
        "512",
        "--chunks",
        str(args.chunks),
        "--threads",
        str(args.threads),
        "--json",
        "--no-progress",
    )
    return {lv["name"]: lv for lv in rep["levels"]}


def recipe_speed(env: dict, base: str, f16_path: str, recipe: str, tools: Path, work: Path, args) -> dict:
    """`quantize --recipe` vs `llama-quantize --tensor-type-file` with the same types and threads, alternating.

    Beside the two commands' wall times: each tool's own timer of the
    llama_model_quantize call, and edgellm's whole job (the call, then
    validating, hashing, syncing and registering the file), so the fixed
    start and finish costs show apart from the quantization."""
    t = str(args.threads)
    mine_s, ref_s, mine_call, mine_job, ref_call = [], [], [], [], []
    # the recipe's rounding (quant/rounding.py) on both sides: the same work, and the same bytes
    ref_env = dict(env, GGML_QUANT_REFINE=str(rounding.level(json.loads(Path(recipe).read_text()).get("rounding", ""))))
    for i in range(args.runs):
        for which in [0, 1] if i % 2 == 0 else [1, 0]:
            t0 = time.perf_counter()
            if which == 0:
                r = quantize(env, base, t, "--recipe", recipe, "--force")[0]
                mine_s.append(time.perf_counter() - t0)
                mine_call.append(r["quantize_seconds"])
                mine_job.append(r["seconds"])
            else:
                out = sh(
                    [
                        tools / "llama-quantize",
                        "--tensor-type-file",
                        Path(recipe).with_suffix(".txt"),
                        f16_path,
                        work / "ref-recipe.gguf",
                        "Q4_K_M",
                        t,
                    ],
                    ref_env,
                    stderr=True,
                )
                ref_s.append(time.perf_counter() - t0)
                m = re.search(r"quantize time =\s*([0-9.]+) ms", out)
                ref_call.append(float(m.group(1)) / 1000 if m else float("nan"))
    med = statistics.median
    return {
        "edgellm_s": med(mine_s),
        "llama_quantize_s": med(ref_s),
        "ratio": med(mine_s) / med(ref_s),
        "call_ratio": med(mine_call) / med(ref_call),
        "job_ratio": med(mine_job) / med(ref_s),
        "edgellm_call_s": med(mine_call),
        "edgellm_job_s": med(mine_job),
        "llama_quantize_call_s": med(ref_call),
        "runs": args.runs,
        "edgellm_runs_s": mine_s,
        "llama_quantize_runs_s": ref_s,
    }


def _tree_bytes(root: Path) -> int:
    n = 0
    for p in root.rglob("*"):
        try:
            if p.is_file():
                n += p.stat().st_size
        except OSError:
            pass
    return n


def gridless_figures(env: dict, q4_1_path: str, factor: int, tools: Path, work: Path, args) -> dict:
    """Part 6 on the dithered base widened `factor` times (see the module docstring)."""
    import threading

    t = str(args.threads)
    gl = work / f"gridless-x{factor}-f16.gguf"
    name = f"gl{factor}-f16"
    home = Path(env["EDGELLM_HOME"])
    if not (home / "models" / name).is_dir():  # else left by an earlier --work run: the script is deterministic
        sh(
            [sys.executable, ROOT / "scripts" / "make_wide_model.py", q4_1_path, "--factor", str(factor), "--dither", "-o", gl],
            env,
        )
        edgellm(env, "import", str(gl), "--name", name, "--link")
    kept = home / "imatrix" / f"{name}-imatrix.gguf"
    im = str(kept) if kept.is_file() else edgellm(env, "imatrix", name, "--threads", t, "--json", "--no-progress")["file"]
    fig: dict = {"factor": factor, "levels": {}}
    refs = {}
    levels = [lv.strip().lower() for lv in args.levels.split(",") if lv.strip()]
    # Q4_K_M first: its llama-quantize run is the one the search is timed against, and its search is the
    # cold one (the later sizes reuse the probes it cached), so its search seconds are the figure that counts
    levels = ["q4_k_m"] + [lv for lv in levels if lv != "q4_k_m"]
    for lv in levels:
        ref = work / f"gl{factor}-{lv}-imat.gguf"
        t0 = time.perf_counter()
        sh([tools / "llama-quantize", "--imatrix", im, gl, ref, lv.upper(), t], env)
        fig["levels"][lv] = {"llama_quantize_s": time.perf_counter() - t0, "size_bytes": ref.stat().st_size}
        refs[lv] = f"gl{factor}-{lv}-imat"
        if (home / "models" / refs[lv]).is_dir():  # a --work rerun: the reference was just made again
            edgellm(env, "rm", refs[lv])
        edgellm(env, "import", str(ref), "--name", refs[lv], "--link")
    q8 = work / f"gl{factor}-q8_0.gguf"
    sh([tools / "llama-quantize", gl, q8, "Q8_0", t], env)
    fig["q8_0_bytes"] = q8.stat().st_size
    q8.unlink()
    home = Path(env["EDGELLM_HOME"])
    for lv in levels:
        size = fig["levels"][lv]["size_bytes"]
        before, peak, stop = _tree_bytes(home), [0], threading.Event()

        def sample(stop: threading.Event = stop, peak: list[int] = peak) -> None:
            while not stop.wait(0.2):
                peak[0] = max(peak[0], _tree_bytes(home))

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        r = quantize(env, name, t, "--budget", str(size), "--imatrix", im, "--force", "--no-error-feedback")[0]
        stop.set()
        th.join()
        extra = max(0, peak[0] - before - r["size_bytes"])
        fig["levels"][lv].update(
            budget_name=r["name"],
            budget_size_bytes=r["size_bytes"],
            search_seconds=r["search_seconds"],
            quantize_seconds=r["quantize_seconds"],
            extra_disk_bytes=extra,
            tensor_types=r["tensor_types"],
            probes_cached=json.loads(Path(r["recipe_file"]).read_text())["calibration"].get("probes_cached", 0),
        )
        print(f"x{factor} {lv}: searched in {r['search_seconds']:.0f} s, quantized in {r['quantize_seconds']:.0f} s", flush=True)
        if args.error_feedback:
            # the same search (its probes are cached now) and the same types, then error feedback (quant/feedback.py)
            f = quantize(env, name, t, "--budget", str(size), "--imatrix", im, "--force", "--error-feedback")[0]
            fig["levels"][lv].update(fb_name=f["name"], fb_size_bytes=f["size_bytes"], feedback_seconds=f["feedback_seconds"])
            print(f"x{factor} {lv}: with error feedback, {f['feedback_seconds']}", flush=True)
    # one eval for every file: the base's log-probs are computed once, not once per level
    names = [n for lv in levels for n in (fig["levels"][lv]["budget_name"], refs[lv], fig["levels"][lv].get("fb_name"))]
    k = kld(env, name, [n for n in names if n], args)
    for lv in levels:
        row = fig["levels"][lv]
        row.update(budget_kld=k[row["budget_name"]]["kld_mean"], imatrix_kld=k[refs[lv]]["kld_mean"])
        row["ratio"] = row["budget_kld"] / row["imatrix_kld"]
        if "fb_name" in row:
            row["fb_kld"] = k[row["fb_name"]]["kld_mean"]
            row["fb_ratio"] = row["fb_kld"] / row["imatrix_kld"]
            fs = row["feedback_seconds"]
            row["fb_search_vs_q4_k_m_quantize"] = (
                row["search_seconds"] + fs.get("tokens", 0) + fs["inputs"] + fs["rewrite"]
            ) / fig["levels"]["q4_k_m"]["llama_quantize_s"]
            print(
                f"x{factor} {lv}: with error feedback KLD {row['fb_kld']:.5f} ({row['fb_ratio']:.3f}x imatrix); search "
                f"+ feedback {row['fb_search_vs_q4_k_m_quantize']:.1f}x llama-quantize Q4_K_M",
                flush=True,
            )
        row["search_vs_q4_k_m_quantize"] = row["search_seconds"] / fig["levels"]["q4_k_m"]["llama_quantize_s"]
        row["extra_disk_vs_q8_0"] = row["extra_disk_bytes"] / fig["q8_0_bytes"]
        print(
            f"x{factor} {lv}: budget {row['budget_size_bytes']} B KLD {row['budget_kld']:.5f} vs imatrix "
            f"{row['size_bytes']} B {row['imatrix_kld']:.5f} ({row['ratio']:.3f}x); search {row['search_seconds']:.0f} s "
            f"({row['search_vs_q4_k_m_quantize']:.1f}x llama-quantize Q4_K_M, {row['probes_cached']} probes cached); "
            f"extra disk {row['extra_disk_vs_q8_0']:.3f}x Q8_0",
            flush=True,
        )
    return fig


def level_files(env: dict, base: str, t: str, imat: str) -> tuple[list[str], dict, dict]:
    """Every level parts 2-4 compare at, quantized without and with the matrix: (levels, stock, with matrix)."""
    levels = sorted(set(IMATRIX_LEVELS + BUDGET_LEVELS))
    level_args = sum((["-l", lv] for lv in levels), [])
    stock = {r["level"]: r for r in quantize(env, base, t, *level_args)}
    withm = {r["level"]: r for r in quantize(env, base, t, *level_args, "--imatrix", imat)}
    return levels, stock, withm


def budget_figures(env: dict, base: str, t: str, imat: str, stock: dict, withm: dict, levels: list[str], fig: dict, args) -> dict:
    """Part 4: --budget at each stock level's size, all types and with q4_1,q5_1 excluded (and with
    --error-feedback, the excluded one again with feedback), as ratios to llama-quantize --imatrix at that level."""
    budgets = {}
    for lv in BUDGET_LEVELS:
        size = stock[lv]["size_bytes"]
        for excl in ("", "q4_1,q5_1"):  # q5_1's grid holds q4_1's: both go for the fair figure
            exclude = ["--exclude-types", excl] if excl else []
            runs = [("", ["--no-error-feedback"])] + ([("-fb", ["--error-feedback"])] if args.error_feedback and excl else [])
            for tag, extra in runs:
                r = quantize(env, base, t, "--budget", str(size), "--imatrix", imat, "--force", *exclude, *extra)[0]
                # the two runs share a name (budget-<bytes>): keep the first under another name by evaluating it now
                budgets[(lv, excl + tag)] = {
                    "name": r["name"],
                    "size_bytes": r["size_bytes"],
                    "search_seconds": r["search_seconds"],
                    "quantize_seconds": r["quantize_seconds"],
                    "recipe_file": r["recipe_file"],
                    "kld": kld(env, base, [r["name"]], args)[r["name"]]["kld_mean"],
                    **({"feedback_seconds": r["feedback_seconds"]} if tag else {}),
                }
                kl = budgets[(lv, excl + tag)]["kld"]
                print(f"grid base {lv} {excl or 'all types'}{tag}: {r['size_bytes']} B KLD {kl:.5f}", flush=True)
    names = [stock[lv]["name"] for lv in levels] + [withm[lv]["name"] for lv in levels]
    k = kld(env, base, names, args)
    fig["kld"] = {
        lv: {
            "stock": k[stock[lv]["name"]]["kld_mean"],
            "imatrix": k[withm[lv]["name"]]["kld_mean"],
            "size_stock": stock[lv]["size_bytes"],
        }
        for lv in levels
    }
    fig["budget"] = {
        f"{lv}{'-no-' + excl.replace(',', '-') if excl else ''}": {
            **v,
            "ratio_vs_imatrix_level": v["kld"] / fig["kld"][lv]["imatrix"],
        }
        for (lv, excl), v in budgets.items()
    }
    return fig["budget"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=40, help="WikiText-2 chunks of 512 for KLD (>= 40)")
    ap.add_argument("--imatrix-chunks", type=int, default=None, help="calibration chunks (default: all of the text)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--runs", type=int, default=3, help="timed runs for the --recipe speed ratio")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here too")
    ap.add_argument(
        "--gridless",
        type=int,
        action="append",
        default=[],
        metavar="F",
        help="only part 6, on the dithered default model widened F times (repeatable: --gridless 1 --gridless 4)",
    )
    ap.add_argument(
        "--levels",
        default=",".join(GRIDLESS_LEVELS),
        help="with --gridless: the stock levels to compare at (default: the four the issue names)",
    )
    ap.add_argument(
        "--error-feedback",
        action="store_true",
        help="also each --budget file with error feedback, --budget's default (same types), evaluated beside the "
        "--no-error-feedback one (on the grid base, the q4_1,q5_1-excluded ones)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=None,
        help="work folder (default: a new temporary one); with --gridless, a gridless model and importance "
        "matrix a killed run left there are used again instead of made again",
    )
    ap.add_argument(
        "--only-speed",
        action="store_true",
        help="only part 5 (its recipe from one --budget search at Q4_K_M's size): minutes, not an hour",
    )
    ap.add_argument(
        "--only-budget",
        action="store_true",
        help="only part 4 on the grid base (and the stock and --imatrix KLDs its ratios are to): no llama-imatrix, "
        "identity or speed runs",
    )
    args = ap.parse_args()
    tools = tools_dir()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-imatrix-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, EDGELLM_HOME=str(work / "home"))
    fig: dict = {"chunks": args.chunks, "threads": args.threads, "ctx": 512}
    t = str(args.threads)

    pulled = edgellm(env, "pull", "smollm2-135m-instruct", "--json", "--no-progress")
    f16 = edgellm(env, "convert", "smollm2-135m-instruct", "--to", "f16", "--json", "--no-progress", "--force")
    base, f16_path = f16["name"], f16["path"]
    if args.gridless:
        q4_1 = pulled["path"]  # the Q4_1 file: make_wide_model.py reads each block's step from it
        fig["gridless"] = {f"x{f}": gridless_figures(env, q4_1, f, tools, work, args) for f in args.gridless}
        return report(fig, args)
    if args.only_speed:
        size = quantize(env, base, t, "-l", "q4_k_m")[0]["size_bytes"]
        r = quantize(env, base, t, "--budget", str(size), "--exclude-types", "q4_1,q5_1", "--no-error-feedback")[0]
        fig["recipe_speed"] = recipe_speed(env, base, f16_path, r["recipe_file"], tools, work, args)
        return report(fig, args)

    # 1. the matrix, both ways
    im_args = ["--chunks", str(args.imatrix_chunks)] if args.imatrix_chunks else []
    t0 = time.perf_counter()
    mine = edgellm(env, "imatrix", base, "--threads", t, "--json", "--no-progress", *im_args)
    fig["imatrix_seconds"] = time.perf_counter() - t0
    if args.only_budget:
        levels, stock, withm = level_files(env, base, t, mine["file"])
        budget_figures(env, base, t, mine["file"], stock, withm, levels, fig, args)
        return report(fig, args)
    from quant._imatrix_collect import OUTPUT_NAMES
    from quant.imatrix import calibration_path
    from quant.imatrix_file import read_imatrix

    ref_path = work / "llama-imatrix.gguf"
    t0 = time.perf_counter()
    sh(
        [
            tools / "llama-imatrix",
            "-m",
            f16_path,
            "-f",
            calibration_path(),
            "-c",
            "512",
            "-t",
            t,
            "--no-ppl",
            "-o",
            ref_path,
            *(["--chunks", str(args.imatrix_chunks)] if args.imatrix_chunks else []),
        ],
        env,
    )
    fig["llama_imatrix_seconds"] = time.perf_counter() - t0
    a, b = read_imatrix(mine["file"]), read_imatrix(ref_path)
    # ours has the output layer's entry too (quant/imatrix.py); llama-imatrix's are compared
    assert sorted(set(a.entries) - set(OUTPUT_NAMES)) == sorted(b.entries)
    fig["imatrix_extra_entries"] = sorted(set(a.entries) - set(b.entries))
    fig["imatrix_max_rel_diff"] = max(
        float(abs(a.entries[n].sums - e.sums).max() / abs(e.sums).max()) for n, e in b.entries.items()
    )
    fig["imatrix_counts_equal"] = all((a.entries[n].counts == e.counts).all() for n, e in b.entries.items())
    fig["imatrix_chunks"] = b.chunk_count
    imat = mine["file"]

    # 2 + 3. stock vs imatrix levels; identity with llama-quantize --imatrix
    levels, stock, withm = level_files(env, base, t, imat)
    fig["identical_to_llama_quantize"] = {}
    for lv in levels:
        ref = work / f"ref-{lv}.gguf"
        sh([tools / "llama-quantize", "--imatrix", imat, f16_path, ref, lv.upper(), t], env)
        fig["identical_to_llama_quantize"][lv] = sha(ref) == withm[lv]["sha256"]

    # 4. budgets at the stock sizes, with and without q4_1
    budgets = budget_figures(env, base, t, imat, stock, withm, levels, fig, args)

    # 5. --recipe speed vs llama-quantize --tensor-type-file (same types, same threads, no imatrix on either side)
    fig["recipe_speed"] = recipe_speed(env, base, f16_path, budgets["q4_k_m-no-q4_1-q5_1"]["recipe_file"], tools, work, args)
    return report(fig, args)


if __name__ == "__main__":
    sys.exit(main())
