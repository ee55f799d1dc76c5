#!/usr/bin/env python
"""`edgellm chat` generation tokens/s against llama.cpp's `llama-completion`, same tree and flags.

Both get the same prompt (the model's chat template rendered for one user
message, so the same tokens), greedy decoding, the same number of tokens
(128), threads and context. edgellm's figure is the one `edgellm chat -p`
prints (generated tokens over the time from the first token to the last,
streaming to a pipe), counted as n-1 tokens since that time holds n-1
decodes; llama-completion's is its own perf print: evaluated tokens over
eval plus sampling time. Runs alternate, so background load hits
both alike; the result is the median of the per-pair ratios.

The Q8_0 of the default model is made once from its Q4_1 (requantized:
the F16 is itself dequantized from that Q4_1, so nothing is lost that F16
would have had).

    .venv/bin/python scripts/bench_chat.py [--model smollm2-135m-instruct] [--q8] [--threads 2] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from _bench_common import chat_cmd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def q8_0_of(path: Path) -> Path:
    """A Q8_0 requantized from `path`, cached beside the tools."""
    import llama_cpp

    from edgellm.paths import cache_dir

    out = cache_dir() / "bench" / f"{path.stem}.q8_0.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(path).encode(), str(tmp).encode(), params) != 0:
        sys.exit(f"error: could not make a Q8_0 of {path}")
    tmp.replace(out)
    return out


def rendered_prompt(path: Path) -> tuple[str, int]:
    """The chat template rendered as `edgellm chat` renders it, and its token count."""
    from edgellm.chat.session import Conversation
    from edgellm.chat.template import ChatTemplate
    from edgellm.engine.runtime import Runtime, RuntimeOptions

    rt = Runtime(path, RuntimeOptions(n_ctx=512, n_threads=1))
    try:
        tpl = ChatTemplate.for_runtime(rt)
        try:
            conv = Conversation()
            conv.add("user", PROMPT)
            text = tpl.render(conv.window(), add_generation_prompt=True)
            from edgellm.chat.session import template_tokens

            n = len(template_tokens(rt, tpl, conv.window()))
        finally:
            tpl.close()
    finally:
        rt.close()
    return text, n


def run_edgellm(path: Path, tokens: int, threads: int, ctx: int) -> dict:
    cmd = chat_cmd(path, PROMPT, tokens, "--threads", str(threads), "--ctx", str(ctx), "--no-history")
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    m = re.search(r"\[(\d+) tokens, ([\d.]+) tokens/s; prompt (\d+) tokens", p.stderr)
    if p.returncode != 0 or not m:
        sys.exit(f"error: edgellm chat failed: {p.stderr.strip()[-500:]}")
    n, tps = int(m.group(1)), float(m.group(2))
    # chat prints n tokens over the time from the first to the last; that time holds n-1 decodes, as
    # llama-completion's eval time does, so count n-1 here too (a 1/n handicap, not a gift).
    return {
        "generated": n,
        "chat_tokens_per_second": tps,
        "tokens_per_second": tps * (n - 1) / n if n > 1 else tps,
        "prompt_tokens": int(m.group(3)),
        "text": p.stdout.rstrip("\n"),
    }


def run_completion(exe: Path, path: Path, prompt_text: str, tokens: int, threads: int, ctx: int) -> dict:
    cmd = [
        str(exe),
        "-m",
        str(path),
        "-p",
        prompt_text,
        "-n",
        str(tokens),
        "--temp",
        "0",
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(ctx),
        "--no-display-prompt",
        "-no-cnv",
        "-fa",
        "off",
    ]  # edgellm runs without flash attention
    p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    err = p.stderr
    ev = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", err)
    sm = re.search(r"sampling time =\s*([\d.]+) ms", err)
    pr = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", err)
    if p.returncode != 0 or not ev or not sm:
        sys.exit(f"error: llama-completion failed ({p.returncode}): {err.strip()[-800:]}")
    eval_ms, n_eval, sample_ms = float(ev.group(1)), int(ev.group(2)), float(sm.group(1))
    return {
        "generated": n_eval + 1,
        "tokens_per_second": n_eval / ((eval_ms + sample_ms) / 1000.0),
        "prompt_tokens": int(pr.group(2)) if pr else None,
        "text": p.stdout.strip(),
    }


def bench(path: Path, exe: Path, a) -> dict:
    prompt_text, n_prompt = rendered_prompt(path)
    pairs = []
    for i in range(a.reps):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        got = {}
        for which in order:
            if which == 0:
                got["edgellm"] = run_edgellm(path, a.tokens, a.threads, a.ctx)
            else:
                got["llama"] = run_completion(exe, path, prompt_text, a.tokens, a.threads, a.ctx)
        pairs.append(got)
        print(
            f"  {path.name} run {i + 1}: edgellm chat {got['edgellm']['tokens_per_second']:.1f} tok/s "
            f"({got['edgellm']['generated']} tokens), llama-completion {got['llama']['tokens_per_second']:.1f} tok/s "
            f"({got['llama']['generated']} tokens)",
            file=sys.stderr,
        )
    e0, l0 = pairs[0]["edgellm"], pairs[0]["llama"]
    ratios = [p["edgellm"]["tokens_per_second"] / p["llama"]["tokens_per_second"] for p in pairs]
    return {
        "model": path.name,
        "prompt_tokens": n_prompt,
        "llama_prompt_tokens": l0["prompt_tokens"],
        "edgellm_prompt_tokens": e0["prompt_tokens"],
        "same_text": l0["text"].strip() == e0["text"].strip(),
        "edgellm_generated": e0["generated"],
        "llama_generated": l0["generated"],
        "edgellm_tokens_per_second": [p["edgellm"]["tokens_per_second"] for p in pairs],
        "llama_tokens_per_second": [round(p["llama"]["tokens_per_second"], 2) for p in pairs],
        "ratios": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="store name, catalog ref or GGUF path")
    ap.add_argument("--q8", action="store_true", help="also the model's Q8_0 (made once from it)")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from edgellm.engine.runtime import default_threads
    from edgellm.models.resolve import resolve
    from edgellm.profile.llama_bench import find_llama_tool

    a.threads = a.threads or default_threads()
    exe = find_llama_tool("llama-completion")
    path = resolve(a.model).path
    paths = [path] + ([q8_0_of(path)] if a.q8 else [])
    results = [bench(p, exe, a) for p in paths]
    if a.json:
        print(json.dumps({"threads": a.threads, "tokens": a.tokens, "reps": a.reps, "results": results}, indent=2))
        return 0
    print(f"greedy, {a.tokens} tokens, {a.threads} threads, ctx {a.ctx}, {a.reps} alternating runs")
    for r in results:
        print(
            f"{r['model']}: edgellm chat median {statistics.median(r['edgellm_tokens_per_second']):.1f} tok/s, "
            f"llama-completion median {statistics.median(r['llama_tokens_per_second']):.1f} tok/s, "
            f"median ratio {r['median_ratio']:.3f}x (runs {', '.join(f'{x:.2f}' for x in r['ratios'])}); "
            f"prompt {r['edgellm_prompt_tokens']} vs {r['llama_prompt_tokens']} tokens, same text: {r['same_text']}; "
            f"load {r['load_average_1m']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
