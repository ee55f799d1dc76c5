"""`bench --draft`: what speculative decoding gives this model on this machine, beside plain decoding.

llama-bench's tg row decodes token after token from nothing, so there is no text
to draft from. A draft row needs a reply that repeats its prompt, as the
rewrites and quotes users ask for do: it generates `tg` tokens at temperature
0 after a built-in request (rewrite a given function with one name changed),
once without drafts and once with, per repetition, in one loaded runtime.
Each repetition starts from an empty KV cache and without the drafter's memory
of earlier replies (a warm n-gram table would hold the previous repetition's
reply word for word); the verify-cost model the runtime has learned is kept,
as in a chat that has run for a while.

Tokens/s are effective: generated tokens over the generation's wall time (the
prompt apart), so a draft row's ratio to its plain row is what `--draft`
buys. drafted, accepted and steps are llama-server's counters (`draft_n`,
`draft_n_accepted`), per repetition and summed, and the two rows' replies are
compared: drafting is lossless, so they must be the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgellm.engine.runtime import GenerationStats, Runtime, RuntimeOptions, SamplingParams
from edgellm.errors import UsageError
from edgellm.profile._worker import stats_ts
from edgellm.profile.results import machine_id
from edgellm.profile.rows import BenchRow
from edgellm.profile.settings import BenchSettings
from edgellm.progress import CancelToken, Progress, ProgressCallback, no_progress

PROMPT_NAME = "rewrite"
CODE = """def total_price(order, tax_rate):
    subtotal = 0.0
    for line in order.lines:
        subtotal += line.price * line.quantity
    discount = order.discount if order.discount else 0.0
    taxed = (subtotal - discount) * (1.0 + tax_rate)
    return round(taxed, 2)


def cheapest_line(order):
    best = None
    for line in order.lines:
        if best is None or line.price < best.price:
            best = line
    return best


def summary(order, tax_rate):
    total = total_price(order, tax_rate)
    best = cheapest_line(order)
    name = best.name if best else "nothing"
    return f"{len(order.lines)} lines, total {total}, cheapest {name}"
"""
REQUEST = "Rewrite this Python code with the variable `order` renamed to `basket` everywhere. Output only the code.\n\n" + CODE


def draft_rows(
    path: Path,
    label: str,
    info: Any,
    settings: BenchSettings,
    *,
    draft: str,
    prompt_tokens: Callable[[Runtime, str], list[int]],
    attach: Callable[[Runtime, str], Any],
    on_progress: ProgressCallback = no_progress,
    cancel: CancelToken | None = None,
) -> list[BenchRow]:
    """Two rows, `tg{N}@rewrite` and `tg{N}@rewrite+{mode}`. `prompt_tokens(runtime, text)` renders the request
    with the model's chat template; `attach(runtime, draft)` resolves `--draft` and returns the choice
    (`.mode`, `.model`, `.close()`: edgellm.chat.draft.attach), so that this layer needs neither."""
    n_threads, reps, tg = settings.n_threads, settings.repetitions, settings.tg or 128
    opts = RuntimeOptions(n_ctx=settings.n_ctx or 2048, n_threads=n_threads, flash_attn=True)
    rt = Runtime(path, opts)
    choice = None
    try:
        choice = attach(rt, draft)
        prompt = prompt_tokens(rt, REQUEST)
        if len(prompt) + tg > rt.n_ctx:
            raise UsageError(f"--ctx {rt.n_ctx} is too small for the draft row ({len(prompt)} prompt tokens + --tg {tg})")
        arms = [("off", "off"), (choice.mode, choice.mode)]
        runs: dict[str, list[GenerationStats]] = {name: [] for name, _ in arms}
        replies: dict[str, list[list[int]]] = {name: [] for name, _ in arms}
        total = reps * len(arms)
        for i in range(reps):
            for j, (name, mode) in enumerate(arms):  # interleaved: drift on a shared machine hits both arms alike
                if cancel is not None:
                    cancel.check()
                rt.reset()
                rt.forget_drafts()
                st = GenerationStats()
                for _ in rt.stream(prompt, SamplingParams(temperature=0, max_tokens=tg, draft=mode), cancel=cancel, stats=st):
                    pass
                if st.stop_reason == "cancelled" and cancel is not None:
                    cancel.check()
                runs[name].append(st)
                replies[name].append(list(rt.cached_tokens()[len(prompt) :]))
                on_progress(Progress("bench", i * len(arms) + j + 1, total, "run", f"{label} draft {name} {i + 1}/{reps}"))
        same = all(r == replies["off"][0] for rs in replies.values() for r in rs)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        return [
            _row(path, label, info, settings, runs[name], name, choice if name != "off" else None, same, len(prompt), stamp)
            for name, _ in arms
        ]
    finally:
        if choice is not None:
            choice.close()
        rt.close()


def _row(path, label, info, settings, runs, name, choice, same, n_prompt, stamp) -> BenchRow:
    n_gen = max(st.generated_tokens for st in runs)
    samples = [int(st.generation_seconds * 1e9) for st in runs]
    ts = [st.tokens_per_second for st in runs]
    avg, sd = stats_ts(samples, n_gen) if all(st.generated_tokens == n_gen for st in runs) else (sum(ts) / len(ts), 0.0)
    drafted = sum(st.draft_tokens for st in runs)
    accepted = sum(st.draft_accepted for st in runs)
    extra: dict[str, Any] = {
        "prompt": PROMPT_NAME,
        "draft": name,
        "draft_model": getattr(choice, "model", None),
        "drafted": drafted,
        "accepted": accepted,
        "draft_steps": sum(st.draft_steps for st in runs),
        "accept_rate": accepted / drafted if drafted else None,
        "same_reply_as_plain": same,
        "reps": [
            {
                "generated": st.generated_tokens,
                "seconds": st.generation_seconds,
                "tokens_per_s": st.tokens_per_second,
                "drafted": st.draft_tokens,
                "accepted": st.draft_accepted,
                "steps": st.draft_steps,
            }
            for st in runs
        ],
    }
    return BenchRow(
        model=label,
        model_filename=str(path),
        model_type=info.level,
        model_size=int(info.tensor_bytes),
        model_n_params=int(info.parameters),
        test=f"tg{n_gen}@{PROMPT_NAME}" + ("" if name == "off" else f"+{name}"),
        n_prompt=0,
        n_gen=n_gen,
        n_threads=settings.n_threads,
        n_ctx=settings.n_ctx or 2048,
        n_batch=0,
        n_ubatch=0,
        n_gpu_layers=0,
        use_mmap=True,
        mlock=False,
        samples_ns=samples,
        avg_ts=avg,
        stddev_ts=sd,
        rss_bytes=None,
        file_backed_bytes=None,
        anon_bytes=None,
        kv_bytes=0,
        kv_buffer_bytes=0,
        compute_buffer_bytes=0,
        output_buffer_bytes=0,
        load_seconds=0.0,
        ttft_seconds=sum(st.ttft_seconds for st in runs) / len(runs),
        machine_id=machine_id(),
        timestamp=stamp,
        extra=extra,
    )
