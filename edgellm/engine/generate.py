"""The single-sequence generation loop: plain steps, verify steps, thread changes.

`Runtime.stream` evaluates the prompt and hands the rest to `generate`. A
plain step decodes the last sampled token and samples the next one, as
llama.cpp's own tools do. With a `Speculator` a step may instead decode the
last token and k drafted ones in one batch and sample each output row in
turn, keeping drafted tokens while they equal the sampled ones (see
`edgellm.engine.speculative` for why that is lossless); the KV cells of the
rejected tail are removed (`llama_memory_seq_rm`) before the next step, and
in any case when the loop ends, so the KV cache always holds exactly `kv`.

Each step's time feeds the speculator's cost model (verify vs plain) and the
thread governor (plain steps: seconds per token).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import llama_cpp


# long: the per-token loop stays in one frame with its callables bound to locals, the cheapest
# Python there is per token; plain and verify steps share the sampling and stop checks
def generate(
    ctx: Any,
    vocab: Any,
    batch: Any,
    kv: list[int],
    sampler: Any,
    text: Any,
    st: Any,
    *,
    max_new: int,
    n_ctx: int,
    t0: float,
    cancel: Any = None,
    spec: Any = None,
    governor: Any = None,
) -> Iterator[str]:
    """Sample the reply after a decoded prompt; yields text pieces, fills `st` (a GenerationStats)."""
    sample, is_eog, push = sampler.sample, llama_cpp.llama_vocab_is_eog, text.push
    add, decode, clear = batch.add, batch.decode, batch.clear
    mem = llama_cpp.llama_get_memory(ctx)
    seq_rm = llama_cpp.llama_memory_seq_rm
    clock = time.perf_counter
    cap = batch.capacity
    n_gen = 0
    draft: list[int] = []
    t_step = -1.0  # start of the current step (-1: the prompt's, not timed)
    first = True
    try:
        while True:
            n_acc = 0
            nxt = -1
            stop = ""
            for j in range(len(draft) + 1):
                new = sample(ctx, j if draft else -1)
                if first:
                    first = False
                    st.ttft_seconds = st.prompt_seconds = clock() - t0
                if is_eog(vocab, new):
                    stop = "eos"
                    break
                n_gen += 1
                st.generated_tokens = n_gen
                piece = push(new)
                if piece:
                    yield piece
                if text.stopped:
                    stop = "stop"
                    break
                if cancel is not None and cancel.cancelled:
                    stop = "cancelled"
                    break
                if n_gen >= max_new:
                    stop = "length"
                    break
                if j < len(draft) and new == draft[j]:
                    kv.append(new)  # its cell was decoded in this step's batch
                    if spec is not None:
                        spec.push(new)
                    n_acc += 1
                    continue
                nxt = new
                break
            if t_step >= 0:
                dt = clock() - t_step
                if draft:
                    spec.verified(len(draft), n_acc, n_acc < len(draft) and nxt >= 0, dt)
                    if governor is not None:
                        governor.idle()
                else:
                    if spec is not None:
                        spec.plain(dt)
                    if governor is not None:
                        governor.token(dt)
            if draft and n_acc < len(draft):
                seq_rm(mem, 0, len(kv), -1)  # the rejected tail's cells
            if stop:
                st.stop_reason = stop
                return
            t_step = clock()
            if spec is not None:
                spec.push(nxt)
                draft = spec.propose(min(n_ctx - len(kv) - 2, max_new - n_gen - 1, cap - 1))
            clear()
            pos = len(kv)
            add(nxt, pos, 0, True)
            for i, d in enumerate(draft):
                add(d, pos + 1 + i, 0, True)
            if decode(ctx) != 0:
                if not draft:
                    return  # the KV cache is full: a "length" stop
                draft = []
                seq_rm(mem, 0, pos, -1)
                clear()
                add(nxt, pos, 0, True)
                if decode(ctx) != 0:
                    return
            kv.append(nxt)
    finally:
        seq_rm(mem, 0, len(kv), -1)  # cells past what the sequence holds (a cut verify step)
        if spec is not None:
            c = spec.counters
            st.draft_tokens, st.draft_accepted, st.draft_steps = c.drafted, c.accepted, c.steps
            st.draft_accepted_per_pos = list(c.per_pos)
        if governor is not None:
            st.threads = governor.threads


__all__ = ["generate"]
