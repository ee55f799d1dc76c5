#!/usr/bin/env python3
"""Speculative decoding's correctness checks (issue 26), beside scripts/bench_speculative.py's speed.

    .venv/bin/python scripts/check_speculative.py [--model smollm2-135m-instruct] [--runs 400] [--json out.json]

1. Sampling (--runs seeded runs per arm, temperature 0.8): the first --positions
   tokens after a prompt whose drafts are accepted (repeat a given line), with
   and without `draft="ngram"`, in one runtime through the Python API. Per
   position, a two-sample chi-square test of the token counts (p > 0.01 passes).
   Position 0 comes from the prompt's logits, never from a draft, and is
   reported but not tested. The verify cost is pinned low so that every draft
   the n-grams offer is verified: what is tested is the accept/reject rule,
   not whether the policy chose to draft.
2. Serving (temperature 0): `edgellm serve --parallel 4` without drafts and
   with `--draft ngram`, 4 concurrent clients each sending the six prompts of
   bench_speculative.py (rotated, so different prompts share each batch). Every
   reply to a prompt must be the same, across clients and both servers, and
   the drafting server's /metrics counters (llama-server's names) must equal
   the sums of its replies' `timings.draft_n` and `draft_n_accepted`.
3. `edgellm bench --draft ngram --json`: the draft row's counters add up over
   its repetitions and its reply is the plain row's.
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from bench_speculative import PROMPTS  # noqa: E402  (the six prompts of the speed script)

from support.serve_proc import start_serve, stop_process  # noqa: E402
from support.stats import chi_square_p  # noqa: E402

REPEAT = "Repeat this line exactly:\nThe quick brown fox jumps over the lazy dog and runs into the forest.\n"


def model_path(ref: str) -> tuple[Path, str]:
    from edgellm.models.resolve import resolve

    res = resolve(ref)
    return res.path, res.label


def part_sampling(path: Path, runs: int, positions: int, threads: int) -> dict:
    from edgellm.chat.session import ChatTemplate, template_tokens
    from edgellm.engine.runtime import GenerationStats, Runtime, RuntimeOptions, SamplingParams
    from edgellm.engine.speculative import VerifyCost

    rt = Runtime(path, RuntimeOptions(n_ctx=2048, n_threads=threads, flash_attn=True))
    try:
        rt.verify_cost = VerifyCost(t1=1.0, tn={2: 1.0}, frozen=True)  # every offered draft is verified
        prompt = template_tokens(rt, ChatTemplate.for_runtime(rt), [{"role": "user", "content": REPEAT}])
        arms = {"plain": [Counter() for _ in range(positions)], "ngram": [Counter() for _ in range(positions)]}
        drafted = accepted = 0
        t0 = time.time()
        for seed in range(runs):
            for arm, mode in (("plain", "off"), ("ngram", "ngram")):
                st = GenerationStats()
                sp = SamplingParams(
                    temperature=0.8, seed=seed if mode == "off" else seed + 1_000_000, max_tokens=positions, draft=mode
                )
                for _ in rt.stream(prompt, sp, stats=st):
                    pass
                toks = rt.cached_tokens()[len(prompt) :]
                for i, t in enumerate(list(toks[:positions]) + [-1] * (positions - len(toks))):
                    arms[arm][i][t] += 1
                if mode != "off":
                    drafted += st.draft_tokens
                    accepted += st.draft_accepted
        ps = [chi_square_p(arms["plain"][i], arms["ngram"][i]) for i in range(positions)]
        ok = all(p > 0.01 for p in ps[1:]) and accepted > 0
        return {
            "runs": runs,
            "positions": positions,
            "p_values": ps,
            "drafted": drafted,
            "accepted": accepted,
            "distinct_tokens": [len(set(arms["plain"][i]) | set(arms["ngram"][i])) for i in range(positions)],
            "seconds": round(time.time() - t0, 1),
            "ok": ok,
        }
    finally:
        rt.close()


def _ask(url: str, prompt: str, tokens: int) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": tokens}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1200) as r:
        j = json.load(r)
    return {"text": j["choices"][0]["message"]["content"], "timings": j.get("timings", {})}


def _metric(text: str, name: str) -> int:
    m = re.search(rf"^llamacpp:{name} (\d+)", text, re.M)
    return int(m.group(1)) if m else -1


def part_serve(label: str, home: str, tokens: int, threads: int) -> dict:
    names = list(PROMPTS)
    out: dict = {"servers": {}}
    replies: dict[str, list[str]] = {n: [] for n in names}
    per_server: dict[str, dict[str, list[str]]] = {}
    for server, extra in (("plain", []), ("ngram", ["--draft", "ngram"])):
        args = [label, "--parallel", "4", "--ctx", "8192", "--threads", str(threads), *extra]
        proc, url = start_serve(*args, env=dict(os.environ, EDGELLM_HOME=home) if home else None)
        try:

            def client(c: int, url: str = url) -> list[tuple[str, dict]]:
                order = names[c:] + names[:c]  # rotated: each batch holds different prompts
                return [(n, _ask(url, PROMPTS[n][1], tokens)) for n in order]

            t0 = time.time()
            with ThreadPoolExecutor(4) as pool:
                got = [r for rs in pool.map(client, range(4)) for r in rs]
            wall = time.time() - t0
            with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                metrics = r.read().decode()
        finally:
            stop_process(proc)
        per_server[server] = {n: [r["text"] for m, r in got if m == n] for n in names}
        for n, r in got:
            replies[n].append(r["text"])
        drafted = sum(r["timings"].get("draft_n", 0) for _, r in got)
        accepted = sum(r["timings"].get("draft_n_accepted", 0) for _, r in got)
        m_drafted, m_accepted = (
            _metric(metrics, "spec_decode_num_draft_tokens_total"),
            _metric(metrics, "spec_decode_num_accepted_tokens_total"),
        )
        out["servers"][server] = {
            "requests": len(got),
            "wall_s": round(wall, 1),
            "drafted_replies": drafted,
            "accepted_replies": accepted,
            "drafted_metrics": m_drafted,
            "accepted_metrics": m_accepted,
            "counters_agree": drafted == m_drafted and accepted == m_accepted,
        }
    out["identical"] = {n: len(set(rs)) == 1 for n, rs in replies.items()}
    # where a prompt's replies differ: between the clients of one server (the batch) or only across servers
    out["distinct_replies"] = {n: {sv: len(set(rs[n])) for sv, rs in per_server.items()} for n in names}
    out["replies"] = per_server
    ng = out["servers"]["ngram"]
    out["ok"] = all(out["identical"].values()) and ng["counters_agree"] and ng["accepted_replies"] > 0
    return out


def part_bench(label: str, tokens: int, threads: int, reps: int) -> dict:
    cmd = [sys.executable, "-m", "edgellm.cli", "bench", label, "--pp", "16", "--tg", str(tokens), "-r", str(reps)]
    cmd += ["--threads", str(threads), "--draft", "ngram", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        return {"ok": False, "error": p.stderr.strip()[-400:]}
    rows = {r["test"]: r for r in json.loads(p.stdout)}
    plain = next(r for t, r in rows.items() if t.endswith("@rewrite"))
    spec = next(r for t, r in rows.items() if t.endswith("@rewrite+ngram"))
    x = spec["extra"]
    adds_up = all(
        x[k] == sum(r[rk] for r in x["reps"])
        for k, rk in (("drafted", "drafted"), ("accepted", "accepted"), ("draft_steps", "steps"))
    )
    return {
        "plain_ts": round(plain["avg_ts"], 2),
        "draft_ts": round(spec["avg_ts"], 2),
        "ratio": round(spec["avg_ts"] / plain["avg_ts"], 3) if plain["avg_ts"] else None,
        "drafted": x["drafted"],
        "accepted": x["accepted"],
        "steps": x["draft_steps"],
        "reps": x["reps"],
        "same_reply": x["same_reply_as_plain"],
        "counters_add_up": adds_up,
        "ok": adds_up and x["same_reply_as_plain"] and 0 < x["accepted"] <= x["drafted"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--runs", type=int, default=400, help="seeded runs per arm of the sampling check")
    ap.add_argument("--positions", type=int, default=8, help="first sampled tokens compared")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per reply in the serve and bench checks")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench-reps", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: sampling,serve,bench")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    path, label = model_path(a.model)
    res: dict = {"model": label, "threads": a.threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if "sampling" not in skip:
        res["sampling"] = s = part_sampling(path, a.runs, a.positions, a.threads)
        print(f"sampling: {s['runs']} runs per arm, p-values per position {[round(p, 3) for p in s['p_values']]}")
        print(f"  drafted {s['drafted']}, accepted {s['accepted']} ({s['seconds']} s): {'ok' if s['ok'] else 'FAILED'}")
    if "serve" not in skip:
        res["serve"] = v = part_serve(label, os.environ.get("EDGELLM_HOME", ""), a.tokens, a.threads)
        for name, sv in v["servers"].items():
            print(
                f"serve {name}: {sv['requests']} requests in {sv['wall_s']} s; drafted {sv['drafted_replies']}/{sv['drafted_metrics']} "
                f"accepted {sv['accepted_replies']}/{sv['accepted_metrics']} (replies/metrics)"
            )
        print(f"  identical per prompt: {v['identical']}: {'ok' if v['ok'] else 'FAILED'}")
    if "bench" not in skip:
        res["bench"] = b = part_bench(label, a.tokens, a.threads, a.bench_reps)
        print(f"bench --draft ngram: {b}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1) + "\n")
    failed = [k for k in ("sampling", "serve", "bench") if k in res and not res[k]["ok"]]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
