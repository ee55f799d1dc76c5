#!/usr/bin/env python3
"""Every edgellm job beside llama.cpp's own tool as the model grows 135M -> 0.54B -> 1.93B (-> 7.3B).

For each factor F (1, 2, 4; 8 only with --max-factor 8) the default model's
F16 is widened F times by scripts/make_wide_model.py into a model computing
the same function (cached under $EDGELLM_CACHE/scale/, reused), and each job
runs beside llama.cpp's tool from the same tree and flags (the tools of
scripts/build_llama_tools.sh, or $EDGELLM_LLAMA_TOOLS), interleaved
(edgellm, llama.cpp, llama.cpp, edgellm, ...), medians reported:

  imatrix   vs llama-imatrix (same text and chunks); edgellm again at --few-chunks for the RAM check
  q4_k_m    quantize --level q4_k_m vs llama-quantize Q4_K_M (same threads), outputs compared by sha256
  q8_0      the same at Q8_0
  budget    quantize --budget <the Q4_K_M size>: search and quantize seconds apart (edgellm only)
  recipe    quantize --recipe (the budget's) vs llama-quantize --tensor-type-file
  eval      eval of q4_k_m,q8_0 vs llama-perplexity base logits + 2 --kl-divergence runs
  bench     bench pp512/tg128 (+ roofline fraction) vs llama-bench, Q4_K_M and Q8_0
  chat      chat 128 tokens at temperature 0 vs llama-completion (scripts/bench_chat.py's runs)
  serve     serve --parallel 4 vs llama-server -np 4 under 4 clients (scripts/load_test_server.py's)
  ram       the RAM estimate (models list) vs a chat's peak RSS: ctx 4096, 512-token prompt, 128 tokens
  function  PPL within 1e-3 of the base's (WikiText-2, 4 x 512) and the base's 32-token replies

Per job: wall s, peak RSS of the process tree (anonymous and file-backed
apart, sampled every 50 ms), peak extra disk under the job's output folders,
and the growth exponent k (cost ~ parameters^k) from the smallest F to the
largest run. A failed job is an error row; the run goes on.

    .venv/bin/python scripts/bench_scale.py --factors 1,2,4 --threads 2 --out docs/scale.json --doc docs/scale.md

Uses the WikiText-2 test split at ../shared/data/wikitext-2-raw (or
$EDGELLM_CORPUS_DIR), which a clone alone does not have. Hours at F=4 on
2 cores: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import bench_chat  # noqa: E402  (its prompt, its edgellm chat and llama-completion runs and parsers)
import load_test_server as lts  # noqa: E402  (its servers and its client load)
from _bench_common import Sampler, measured, median_of  # noqa: E402
from bench_imatrix import sha, tools_dir  # noqa: E402

from quant import rounding  # noqa: E402  (a recipe's rounding -> llama-quantize's GGML_QUANT_REFINE)

JOBS = ["function", "imatrix", "q4_k_m", "q8_0", "budget", "recipe", "eval", "bench", "chat", "serve", "ram"]
SPEED_JOBS = {"q4_k_m", "q8_0", "recipe", "bench", "chat"}  # the rows with a speed goal: --runs interleaved runs
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a CPU does."]
MARK = ("<!-- scale-table -->", "<!-- /scale-table -->")


class JobError(Exception):
    pass


class Bench:
    """One run: the work folder, the environment every child gets, and the rows."""

    def __init__(self, args):
        from edgellm.paths import cache_dir

        self.a, self.t = args, str(args.threads)
        self.cache = Path(args.cache or cache_dir() / "scale")
        self.work = self.cache / f"run-{os.getpid()}"
        self.home, self.tmp, self.ref = self.work / "home", self.work / "tmp", self.work / "ref"
        for d in (self.home, self.tmp, self.ref):
            d.mkdir(parents=True, exist_ok=True)
        # every child (and the servers load_test_server starts, which inherit os.environ) uses this store
        os.environ.update(EDGELLM_HOME=str(self.home), TMPDIR=str(self.tmp))
        self.tools = tools_dir()
        self.wiki = (
            Path(os.environ.get("EDGELLM_CORPUS_DIR", ROOT.parent / "shared" / "data")) / "wikitext-2-raw" / "wiki.test.raw"
        )
        self.rows: list[dict] = []
        self.params: dict[int, int] = {}
        self.base: dict = {}  # F=1's PPL and replies, the function check's reference

    # -- running ---------------------------------------------------------------------------------------
    def edgellm(self, *args, dirs=None) -> dict:
        r = measured([sys.executable, "-m", "edgellm.cli", *args], dirs=dirs or [self.home, self.tmp], cwd=ROOT)
        if r["rc"] != 0:
            raise JobError(f"edgellm {args[0]} exit {r['rc']}: {r['stderr'].strip()[-400:]}")
        if "--json" in args:
            r["json"] = json.loads(r["stdout"])
        return r

    def llama(self, tool: str, *args, env: dict | None = None) -> dict:
        r = measured([self.tools / tool, *args], dirs=[self.ref, self.tmp], env=dict(os.environ, **(env or {})))
        if r["rc"] != 0:
            raise JobError(f"{tool} exit {r['rc']}: {r['stderr'].strip()[-400:]}")
        return r

    def llama_wiki(self, tool: str, model, chunks: str, *args) -> dict:
        """`tool` over `chunks` chunks of 512 tokens of WikiText-2 at this run's threads: edgellm's text and chunks."""
        return self.llama(tool, "-m", model, "-f", self.wiki, "-c", "512", "--chunks", chunks, "-t", self.t, *args)

    def paired(self, runs: int, mine, ref) -> tuple[dict, dict]:
        """Medians of `runs` interleaved runs of each, the order alternating so drift hits both alike."""
        a, b = [], []
        for i in range(runs):
            for which in (0, 1) if i % 2 == 0 else (1, 0):
                (a if which == 0 else b).append(mine() if which == 0 else ref())
        return median_of(a) | {"runs": runs}, median_of(b) | {"runs": runs}

    def row(self, f: int, job: str, fn) -> None:
        t0 = time.perf_counter()
        print(f"[scale] x{f} {job} ...", file=sys.stderr, flush=True)
        try:
            mine, ref, extra = fn(f)
            row = {"factor": f, "params": self.params.get(f), "job": job, "edgellm": mine, "llama": ref, **extra}
        except (JobError, SystemExit, Exception) as e:  # noqa: BLE001  a failed job is a row, the run goes on
            row = {"factor": f, "params": self.params.get(f), "job": job, "error": f"{type(e).__name__}: {e}"[:600]}
        row["job_seconds"] = round(time.perf_counter() - t0, 1)
        self.rows.append(row)
        print(f"[scale] x{f} {job}: {table_line(row)}", file=sys.stderr, flush=True)
        self.save()

    @staticmethod
    def warm(path) -> None:
        """Read the file once, so the first timed run (edgellm's) does not pay a page cache the last job emptied.

        At F = 8 the F16 and both quantized files do not all fit in RAM: a single cold run once put
        edgellm's chat at 4.9 against llama-completion's 6.4 t/s, which three warm runs gave as equal.
        """
        with open(path, "rb", buffering=0) as fh:
            while fh.read(1 << 24):
                pass

    def runs(self, f: int, job: str) -> int:
        return (self.a.runs if f <= 4 else self.a.big_runs) if job in SPEED_JOBS else 1

    # -- models ----------------------------------------------------------------------------------------
    def model(self, f: int) -> str:
        """Store name of the F16 at factor f (built into the cache once, hard-linked into this run's store)."""
        path = self.cache / f"x{f}-f16.gguf"
        if not path.is_file():
            if f == 1:
                self.edgellm("pull", "smollm2-135m-instruct", "--json", "--no-progress")
                r = self.edgellm("convert", "smollm2-135m-instruct", "--to", "f16", "--name", "x1-f16", "--json", "--no-progress")
                os.link(r["json"]["path"], path)
                self.params[f] = self.inspect("x1-f16")["parameters"]
                return "x1-f16"
            self.model(1)
            base = self.cache / "x1-f16.gguf"
            r = measured(
                [
                    sys.executable,
                    ROOT / "scripts" / "make_wide_model.py",
                    base,
                    "--factor",
                    f,
                    "-o",
                    path,
                    "--no-check",
                    "--threads",
                    self.t,
                ]
            )
            if r["rc"] != 0:
                raise JobError(f"make_wide_model x{f}: {r['stderr'].strip()[-400:]}")
        name = f"x{f}-f16"
        try:
            self.inspect(name)
        except JobError:
            self.edgellm("import", path, "--name", name, "--link", "--json")
        self.params[f] = self.inspect(name)["parameters"]
        return name

    def has(self, name: str) -> bool:
        return any(m["name"] == name for m in self.edgellm("models", "list", "--local", "--json")["json"]["models"])

    def level_path(self, f: int, lv: str) -> str:
        """The store's x{f}-{lv} (quantize names it so), quantized now when an earlier job did not leave it."""
        if not self.has(f"x{f}-{lv}"):
            self.edgellm("quantize", self.model(f), "-l", lv, "--threads", self.t, "--json", "--no-progress")
        return self.inspect(f"x{f}-{lv}")["path"]

    def inspect(self, name: str) -> dict:
        return self.edgellm("inspect", name, "--json")["json"]

    def save(self) -> None:
        doc = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(),
            "threads": self.a.threads,
            "rows": self.rows,
            "exponents": exponents(self.rows),
        }
        Path(self.a.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")


# -- the jobs: each returns (edgellm figures, llama.cpp figures, other figures) ---------------------------
def job_function(b: Bench, f: int):
    name = b.model(f)
    ppl = b.edgellm("ppl", name, "--text", b.wiki, "--chunks", "4", "--threads", b.t, "--json", "--no-progress")
    replies = [
        b.edgellm("chat", name, "-p", p, "--temperature", "0", "--max-tokens", "32", "--threads", b.t, "--no-history")[
            "stdout"
        ].strip()
        for p in PROMPTS
    ]
    got = {"ppl": ppl["json"]["ppl"], "replies": replies}
    if f == 1 or not b.base:
        b.base = got if f == 1 else job_function(b, 1)[2]["got"]
    rel = abs(got["ppl"] - b.base["ppl"]) / b.base["ppl"]
    same = sum(x == y for x, y in zip(replies, b.base["replies"]))
    return (
        {"wall_s": ppl["wall_s"], "peak_anon": ppl["peak_anon"], "peak_file": ppl["peak_file"]},
        None,
        {"got": got, "ppl_rel_diff": rel, "same_replies": same, "ok": rel <= 1e-3 and same == len(PROMPTS)},
    )


def job_imatrix(b: Bench, f: int):
    name, c = b.model(f), str(b.a.chunks)
    path = b.inspect(name)["path"]

    def imatrix(chunks: str) -> dict:
        return b.edgellm(
            "imatrix", name, "--text", b.wiki, "--chunks", chunks, "--threads", b.t, "--force", "--json", "--no-progress"
        )

    few = imatrix(str(b.a.few_chunks))
    mine, ref = b.paired(
        1, lambda: imatrix(c), lambda: b.llama_wiki("llama-imatrix", path, c, "--no-ppl", "-o", b.ref / "imatrix.gguf")
    )
    return mine, ref, {"anon_few_over_many": few["peak_anon"] / mine["peak_anon"], "few_chunks": b.a.few_chunks}


def quantize_pair(b: Bench, f: int, job: str, mine_args: list, ref_args: list, ref_type: str, ref_env: dict | None = None):
    name = b.model(f)
    path, out = b.inspect(name)["path"], b.ref / f"{job}.gguf"
    last: dict = {}

    def mine():
        r = b.edgellm("quantize", name, *mine_args, "--threads", b.t, "--force", "--json", "--no-progress")
        last.update(r["json"][0])
        return r | {"call_s": r["json"][0]["quantize_seconds"]}

    def ref():
        out.unlink(missing_ok=True)  # written afresh each run, as edgellm's is
        r = b.llama("llama-quantize", *ref_args, path, out, ref_type, b.t, env=ref_env)
        m = re.search(r"quantize time =\s*([0-9.]+) ms", r["stderr"] + r["stdout"])
        return r | ({"call_s": float(m.group(1)) / 1000} if m else {})

    m, r = b.paired(b.runs(f, job), mine, ref)
    same = sha(out) == last["sha256"]
    out.unlink(missing_ok=True)
    return m, r, {"identical": same, "size_bytes": last["size_bytes"], "output": last["name"]}


def job_budget(b: Bench, f: int):
    name = b.model(f)
    size = (
        b.sizes.get(f)
        or b.edgellm("quantize", name, "-l", "q4_k_m", "--threads", b.t, "--force", "--json", "--no-progress")["json"][0][
            "size_bytes"
        ]
    )
    # the search alone, and a recipe llama-quantize reproduces (the recipe rows compare the two byte for byte)
    r = b.edgellm(
        "quantize", name, "--budget", str(size), "--threads", b.t, "--force", "--json", "--no-progress", "--no-error-feedback"
    )
    j = r["json"][0]
    b.recipes[f] = j["recipe_file"]
    b.edgellm("rm", j["name"])
    return (
        median_of([r]),
        None,
        {
            "budget_bytes": size,
            "size_bytes": j["size_bytes"],
            "search_s": j["search_seconds"],
            "quantize_s": j["quantize_seconds"],
        },
    )


def job_eval(b: Bench, f: int):
    name, c = b.model(f), str(b.a.chunks)
    levels = [b.level_path(f, lv) for lv in ("q4_k_m", "q8_0")]
    common = ["--text", b.wiki, "--threads", b.t, "--json", "--no-progress"]
    few = b.edgellm("eval", name, "--levels", "q4_k_m,q8_0", "--chunks", str(b.a.few_chunks), *common)
    logits = b.ref / "kld-base.bin"

    def ref():
        runs = [b.llama_wiki("llama-perplexity", b.inspect(name)["path"], c, "--kl-divergence-base", logits)]
        runs += [b.llama_wiki("llama-perplexity", q, c, "--kl-divergence-base", logits, "--kl-divergence") for q in levels]
        logits.unlink(missing_ok=True)
        return {
            "wall_s": sum(r["wall_s"] for r in runs),
            **{k: max(r[k] for r in runs) for k in ("peak_anon", "peak_file", "peak_rss", "extra_disk")},
        }

    mine, r = b.paired(1, lambda: b.edgellm("eval", name, "--levels", "q4_k_m,q8_0", "--chunks", c, *common), ref)
    return mine, r, {"anon_few_over_many": few["peak_anon"] / mine["peak_anon"], "few_chunks": b.a.few_chunks}


def job_bench(b: Bench, f: int, level: str):
    path = b.level_path(f, level)
    reps = str(b.a.bench_reps)

    def mine():
        r = b.edgellm("bench", path, "--pp", "512", "--tg", "128", "-r", reps, "--threads", b.t, "--json", "--no-progress")
        rows = {x["test"]: x for x in r["json"]}
        return r | {
            "pp512_ts": rows["pp512"]["avg_ts"],
            "tg128_ts": rows["tg128"]["avg_ts"],
            "roofline_fraction": rows["tg128"].get("roofline_fraction") or float("nan"),
        }

    def ref():
        r = b.llama(
            "llama-bench", "-m", path, "-p", "512", "-n", "128", "-r", reps, "-t", b.t, "-lm", "mmap", "-ngl", "0", "-o", "json"
        )
        rows = {("pp" if x["n_prompt"] else "tg"): float(x["avg_ts"]) for x in json.loads(r["stdout"])}
        return r | {"pp512_ts": rows["pp"], "tg128_ts": rows["tg"]}

    b.warm(path)
    m, r = b.paired(b.runs(f, "bench"), mine, ref)
    return m, r, {"level": level, "tg_ratio": m["tg128_ts"] / r["tg128_ts"], "pp_ratio": m["pp512_ts"] / r["pp512_ts"]}


class _MeteredSubprocess:
    """Stands in for the subprocess module inside bench_chat, so its runs are measured without copying them."""

    def __init__(self, b: Bench):
        self.b, self.last = b, {}

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def run(self, cmd, **kw):
        r = measured(cmd, dirs=[self.b.home, self.b.tmp], cwd=kw.get("cwd"))
        self.last = r
        return subprocess.CompletedProcess(cmd, r["rc"], r["stdout"], r["stderr"])


def job_chat(b: Bench, f: int):
    path = b.level_path(f, "q4_k_m")
    exe = b.tools / "llama-completion"
    if not exe.is_file():
        raise JobError(f"{exe} missing: scripts/build_llama_tools.sh llama-completion llama-server")
    meter = _MeteredSubprocess(b)
    bench_chat.subprocess = meter
    text, _ = bench_chat.rendered_prompt(Path(path))

    def one(fn):
        got = fn()
        return {k: meter.last[k] for k in ("wall_s", "peak_anon", "peak_file", "peak_rss", "extra_disk")} | {
            "tokens_per_s": got["tokens_per_second"],
            "generated": got["generated"],
        }

    b.warm(path)
    m, r = b.paired(
        b.runs(f, "chat"),
        lambda: one(lambda: bench_chat.run_edgellm(Path(path), 128, b.a.threads, 4096)),
        lambda: one(lambda: bench_chat.run_completion(exe, Path(path), text, 128, b.a.threads, 4096)),
    )
    return m, r, {"tps_ratio": m["tokens_per_s"] / r["tokens_per_s"]}


def job_serve(b: Bench, f: int):
    name, path = f"x{f}-q4_k_m", b.level_path(f, "q4_k_m")
    if not (b.tools / "llama-server").is_file():
        raise JobError(f"{b.tools / 'llama-server'} missing: scripts/build_llama_tools.sh llama-completion llama-server")
    os.environ["EDGELLM_LLAMA_TOOLS"] = str(b.tools)

    def one(start, model):
        t0 = time.perf_counter()
        proc, url = start()
        s = Sampler(proc.pid, [b.home, b.tmp])
        try:
            load = lts.run_load(url, model, 4, b.a.serve_requests, 128, 1800)
        finally:
            peaks = s.stop()
            lts.stop_process(proc)
        if load["failed"]:
            raise JobError(f"{load['failed']} requests failed: {load['failures'][:2]}")
        return {"wall_s": time.perf_counter() - t0, "tokens_per_s": load["tokens_per_second"], **peaks}

    m, r = b.paired(
        1,
        lambda: one(lambda: lts.start_edgellm(name, b.a.threads, 64, 4, 4096), ""),
        lambda: one(lambda: lts.start_llama_server(Path(path), b.a.threads, 4, 4096), "default"),
    )
    return m, r, {"tps_ratio": m["tokens_per_s"] / r["tokens_per_s"]}


def job_ram(b: Bench, f: int):
    name, path = f"x{f}-q4_k_m", b.level_path(f, "q4_k_m")
    listed = {m["name"]: m for m in b.edgellm("models", "list", "--local", "--json")["json"]["models"]}
    est = listed[name]["ram_needed_bytes"]
    import llama_cpp  # lazy: only this job tokenizes

    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    words = b.wiki.read_text(encoding="utf-8").split()
    prompt = vocab.detokenize(vocab.tokenize(" ".join(words[:2000]).encode(), add_bos=False)[:500]).decode(errors="ignore")
    r = b.edgellm(
        "chat", name, "-p", prompt, "--temperature", "0", "--max-tokens", "128", "--ctx", "4096", "--threads", b.t, "--no-history"
    )
    m = re.search(r"\[(\d+) tokens, [\d.]+ tokens/s; prompt (\d+) tokens", r["stderr"])
    return (
        median_of([r]),
        None,
        {
            "estimate_bytes": est,
            "ratio": est / r["peak_rss"],
            "generated": int(m.group(1)) if m else None,
            "prompt_tokens": int(m.group(2)) if m else None,
        },
    )


# -- the table ---------------------------------------------------------------------------------------------
def mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:,.0f}"


def table_line(r: dict) -> str:
    if "error" in r:
        return f"ERROR {r['error']}"
    e, l = r["edgellm"], r.get("llama") or {}
    ratio = f"{e['wall_s'] / l['wall_s']:.3f}" if l.get("wall_s") else "-"
    keys = (
        "identical",
        "search_s",
        "quantize_s",
        "tg_ratio",
        "pp_ratio",
        "tps_ratio",
        "ratio",
        "anon_few_over_many",
        "ppl_rel_diff",
        "same_replies",
        "generated",
    )
    notes = [f"{k} {r[k]:.4g}" if isinstance(r[k], float) else f"{k} {r[k]}" for k in keys if k in r]
    for k in ("tokens_per_s", "tg128_ts", "pp512_ts", "roofline_fraction"):
        if k in e:
            notes.append(f"{k} {e[k]:.1f}/{l[k]:.1f}" if k in l else f"{k} {e[k]:.3g}")
    return (
        f"| {e['wall_s']:.1f} | {l.get('wall_s', 0) and round(l['wall_s'], 1) or '-'} | {ratio} | "
        f"{mb(e.get('peak_anon'))} / {mb(e.get('peak_file'))} | {mb(l.get('peak_anon'))} / {mb(l.get('peak_file'))} | "
        f"{mb(e.get('extra_disk'))} | {mb(l.get('extra_disk'))} | {'; '.join(notes)} |"
    )


def markdown(rows: list[dict]) -> str:
    out = [
        "| F | params | job | edgellm s | llama.cpp s | ratio | edgellm anon / file MB | llama.cpp anon / file MB | "
        "edgellm disk MB | llama.cpp disk MB | other (edgellm/llama.cpp) |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        p = f"{r['params'] / 1e9:.2f}B" if r.get("params") else "-"
        out.append(f"| {r['factor']} | {p} | {r['job']} " + table_line(r))
    ks = exponents(rows)
    if ks:
        out += ["", "| job | tool | k wall | k anon RSS | k extra disk |", "|---|---|---|---|---|"]
        out += [
            f"| {j} | {t} | {v.get('wall_s', '-')} | {v.get('peak_anon', '-')} | {v.get('extra_disk', '-')} |"
            for (j, t), v in ((tuple(k.split("/")), v) for k, v in ks.items())
        ]
    return "\n".join(out)


def exponents(rows: list[dict]) -> dict:
    """k in cost ~ parameters^k between the smallest and the largest factor each job ran at."""
    ok = [r for r in rows if "error" not in r and r.get("params")]
    out: dict = {}
    for job in dict.fromkeys(r["job"] for r in ok):
        rs = sorted((r for r in ok if r["job"] == job), key=lambda r: r["factor"])
        if len(rs) < 2:
            continue
        lo, hi = rs[0], rs[-1]
        for tool in ("edgellm", "llama"):
            if not lo.get(tool) or not hi.get(tool):
                continue
            ks = {}
            for m in ("wall_s", "peak_anon", "extra_disk"):
                a, c = lo[tool].get(m), hi[tool].get(m)
                if a and c and a > 0 and c > 0:
                    ks[m] = round(math.log(c / a) / math.log(hi["params"] / lo["params"]), 2)
            out[f"{job}/{tool}"] = ks
    return out


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.processor())
    mem = next(int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "ram_bytes": mem,
        "load_average": os.getloadavg(),
        "date": time.strftime("%F %T %Z"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factors", default="1,2,4", help="widening factors to run (default 1,2,4)")
    ap.add_argument("--max-factor", type=int, default=4, help="largest factor allowed (8 builds a ~15 GB F16)")
    ap.add_argument("--only", default=",".join(JOBS), help=f"jobs to run, of {','.join(JOBS)}")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs of the speed rows (quantize, recipe, bench, chat)")
    ap.add_argument("--big-runs", type=int, default=1, help="the same above F=4")
    ap.add_argument(
        "--big-only",
        default=None,
        help="jobs to run above F=4 (default: --only's); F=8 for a few rows in the same run as F=1,2,4",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=20, help="chunks of 512 for imatrix and eval")
    ap.add_argument("--few-chunks", type=int, default=4, help="edgellm's imatrix and eval again at this many: anon RAM vs chunks")
    ap.add_argument("--bench-reps", type=int, default=2, help="repetitions inside one bench / llama-bench call")
    ap.add_argument("--serve-requests", type=int, default=2, help="requests per client (4 clients, 128 tokens each)")
    ap.add_argument("--cache", default=None, help="where the widened models live (default $EDGELLM_CACHE/scale)")
    ap.add_argument("--out", default="docs/scale.json")
    ap.add_argument("--doc", default=None, help="also write the table into this markdown file between its markers")
    ap.add_argument("--keep", action="store_true", help="keep this run's store (quantized files) at the end")
    a = ap.parse_args()
    factors = sorted({int(x) for x in a.factors.split(",") if x.strip()})
    if max(factors) > a.max_factor:
        sys.exit(f"error: factor {max(factors)} needs --max-factor {max(factors)} (its F16 is large)")
    only = [j for j in JOBS if j in a.only.split(",")]
    big_only = [j for j in only if j in (a.big_only or a.only).split(",")]
    b = Bench(a)
    # checked before hours of other rows, not when the chat row comes (it was an error row at every F once)
    need = [t for job, t in (("chat", "llama-completion"), ("serve", "llama-server")) if job in only]
    if missing := [t for t in need if not (b.tools / t).is_file()]:
        shutil.rmtree(b.work, ignore_errors=True)
        sys.exit(f"error: {', '.join(missing)} not built: scripts/build_llama_tools.sh llama-completion llama-server")
    b.sizes, b.recipes = {}, {}
    steps = {
        "function": job_function,
        "imatrix": job_imatrix,
        "budget": job_budget,
        "eval": job_eval,
        "chat": job_chat,
        "serve": job_serve,
        "ram": job_ram,
        "q4_k_m": lambda b, f: quantize_pair(b, f, "q4_k_m", ["-l", "q4_k_m"], [], "Q4_K_M"),
        "q8_0": lambda b, f: quantize_pair(b, f, "q8_0", ["-l", "q8_0"], [], "Q8_0"),
        "recipe": lambda b, f: recipe_pair(b, f),
    }
    try:
        for f in factors:
            try:
                b.model(f)
            except (JobError, OSError) as e:
                b.rows.append({"factor": f, "job": "model", "error": str(e)[:600]})
                continue
            for job in only if f <= 4 else big_only:
                if job == "bench":
                    for lv in ("q4_k_m", "q8_0"):
                        b.row(f, f"bench {lv}", lambda f, lv=lv: job_bench(b, f, lv))
                else:
                    b.row(f, job, lambda f, job=job: steps[job](b, f))
                    if job == "q4_k_m" and "error" not in b.rows[-1]:
                        b.sizes[f] = b.rows[-1]["size_bytes"]
            for lv in ("q4_k_m", "q8_0"):  # the next factor's files are larger: these go
                if b.has(f"x{f}-{lv}"):
                    b.edgellm("rm", f"x{f}-{lv}")
    finally:
        b.save()
        if not a.keep:
            shutil.rmtree(b.work, ignore_errors=True)
    table = markdown(b.rows)
    print(table)
    if a.doc:
        doc = Path(a.doc).read_text()
        i, j = doc.find(MARK[0]), doc.find(MARK[1])
        if i < 0 or j < i:
            sys.exit(f"error: {a.doc} has no {MARK[0]} ... {MARK[1]} markers")
        Path(a.doc).write_text(doc[: i + len(MARK[0])] + "\n" + table + "\n" + doc[j:])
    return 0


def recipe_pair(b: Bench, f: int):
    recipe = b.recipes.get(f)
    if not recipe:
        raise JobError("no recipe: run the budget job first (--only budget,recipe)")
    # the recipe's rounding (quant/rounding.py) on both sides: the same work, and the same bytes
    refine = str(rounding.level(json.loads(Path(recipe).read_text())["rounding"]))
    return quantize_pair(
        b,
        f,
        "recipe",
        ["--recipe", recipe],
        ["--tensor-type-file", Path(recipe).with_suffix(".txt")],
        "Q4_K_M",
        {"GGML_QUANT_REFINE": refine},
    )


if __name__ == "__main__":
    sys.exit(main())
