"""The self-test child: `python -m edgellm.engine.selftest MODEL` loads the model,
generates a few tokens and prints one JSON line. It is run only as a
subprocess (see hardware.self_test), so that a llama.cpp crash kills this
process and not the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from edgellm.engine import backends


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)

    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

    backends.ensure()  # the portable build's CPU variant (the parent names the one to try)

    # Tests set this to prove the parent reports a crashing build by name,
    # without needing a genuinely broken build.
    crash = os.environ.get("EDGELLM_SELFTEST_CRASH")
    if crash:
        os.kill(os.getpid(), getattr(signal, crash if crash.startswith("SIG") else "SIG" + crash))

    llm = llama_cpp.Llama(model_path=args.model, n_ctx=256, n_threads=args.threads, verbose=False, seed=1)
    prompt = llm.tokenize(b"The capital of France is", add_bos=True)
    t0 = time.perf_counter()
    out: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1):
        if llm.token_eos() == tok or len(out) >= args.tokens:
            break
        out.append(tok)
    dt = time.perf_counter() - t0
    text = llm.detokenize(out).decode("utf-8", "replace")
    print(json.dumps({"tokens": len(out), "seconds": dt, "tokens_per_second": len(out) / dt if dt else 0.0, "text": text}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
