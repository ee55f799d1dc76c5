#!/usr/bin/env python
"""Turn 3 of a chat with multi-turn KV reuse vs re-evaluating the whole history.

Each repetition plays the same greedy 3-turn conversation twice on one loaded
model: once normally (turn 3 evaluates only its new tokens) and once with the
KV cache cleared before turn 3 (llama.cpp re-reads the whole history). It
prints the median time of turn 3 (to the first token, and the whole turn)
for both, the prompt tokens llama.cpp evaluated (its own counters), and the
ratios.

    .venv/bin/python scripts/bench_chat_kv.py [--model smollm2-135m-instruct] [--threads N] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgellm.chat.session import ChatSession, Conversation  # noqa: E402
from edgellm.models.resolve import resolve  # noqa: E402
from edgellm.engine.runtime import Runtime, RuntimeOptions, SamplingParams  # noqa: E402

SYSTEM = "You are a patient tutor. Explain things step by step, with examples."
TURNS = [
    "Explain how a refrigerator keeps food cold. Cover the compressor, the refrigerant and the heat exchange.",
    "Now compare that with how an air conditioner cools a room, and say what the two have in common.",
    "Summarise both in two sentences.",
]


def play(rt: Runtime, *, reuse: bool, history_tokens: int, reply_tokens: int) -> dict:
    s = ChatSession(rt, Conversation(system=SYSTEM), SamplingParams(temperature=0.0, max_tokens=history_tokens), history=False)
    try:
        rt.reset()
        for q in TURNS[:2]:
            s.ask(q)
        if not reuse:
            rt.reset()  # forget the KV cache: turn 3 re-evaluates everything
        s.sampling = SamplingParams(temperature=0.0, max_tokens=reply_tokens)
        t0 = time.perf_counter()
        s.ask(TURNS[2])
        wall = time.perf_counter() - t0
        st = s.last_stats
        n_p_eval, _ = rt.perf_counters()
        return {
            "turn_seconds": wall,
            "ttft_seconds": st.ttft_seconds,
            "prompt_tokens": st.prompt_tokens,
            "evaluated_prompt_tokens": n_p_eval,
            "generated_tokens": st.generated_tokens,
        }
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--history-tokens", type=int, default=256, help="max tokens of the replies of turns 1 and 2")
    ap.add_argument("--reply-tokens", type=int, default=16, help="tokens generated in turn 3")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rt = Runtime(resolve(a.model).path, RuntimeOptions(n_ctx=a.ctx, n_threads=a.threads))
    runs: dict[str, list[dict]] = {"reuse": [], "full": []}
    try:
        play(rt, reuse=True, history_tokens=a.history_tokens, reply_tokens=a.reply_tokens)  # warm-up
        for _ in range(a.reps):  # interleaved, so background load hits both alike
            runs["reuse"].append(play(rt, reuse=True, history_tokens=a.history_tokens, reply_tokens=a.reply_tokens))
            runs["full"].append(play(rt, reuse=False, history_tokens=a.history_tokens, reply_tokens=a.reply_tokens))
    finally:
        rt.close()
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    result = {
        "model": a.model,
        "threads": rt.n_threads,
        "reps": a.reps,
        "reuse": med["reuse"],
        "full": med["full"],
        "turn_ratio": med["full"]["turn_seconds"] / med["reuse"]["turn_seconds"],
        "ttft_ratio": med["full"]["ttft_seconds"] / med["reuse"]["ttft_seconds"],
    }
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    for k, label in (("reuse", "KV reuse"), ("full", "re-evaluate history")):
        m = med[k]
        print(
            f"{label:20s} turn 3: {m['turn_seconds']:.3f} s (first token {m['ttft_seconds']:.3f} s), "
            f"{m['evaluated_prompt_tokens']:.0f} of {m['prompt_tokens']:.0f} prompt tokens evaluated, {m['generated_tokens']:.0f} generated"
        )
    print(f"ratio (re-evaluate / reuse): turn {result['turn_ratio']:.2f}x, first token {result['ttft_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
