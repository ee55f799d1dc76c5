"""Continuous batching: up to N sequences decoded together in one llama.cpp context.

On a CPU each decode step reads every weight once, whether the batch holds
one token or eight, so decoding the running sequences together raises the
total tokens/s with the number of clients. `BatchEngine.step()` decodes the
last sampled token of every generating sequence in one `llama_batch`, with
the last prompt token of each newcomer whose prompt is otherwise cached, then
each other newcomer's next prompt chunk in a decode of its own (at most
`prompt_chunk` tokens per step while others run, so a long prompt does not
stall their generation for more than one chunk; see `step` for why a chunk
is not merged). After each decode the sequences sample from their own output
rows with their own sampler chains.

Each sequence slot has its own stream of the KV cache (`n_ctx / n_parallel`
cells, as llama-server's `--parallel`): a sequence's cells then lie in the
same order as when it runs alone, so a batched reply at temperature 0 is
the one-at-a-time reply (a unified cache interleaves the sequences' cells,
which changes the order of the attention sums and, on a small model, about
one greedy reply in three). A slot keeps its cells after its request is
done: the prefix cache. A newcomer takes the free slot whose cached tokens
share the longest prefix with its prompt (ties: the least recently used,
whose cache is the one evicted); when another slot, running or not, holds a
longer prefix, its stream is copied over (`llama_memory_seq_cp`) and cut
back to the shared prefix, which costs a memory copy instead of recomputing
the tokens. Requests that arrive together with one long system prompt (what
RAG front ends and agents send) would each compute it: so a newcomer whose
prompt shares at least `GROUP_MIN` more tokens with a prompt still being
computed than any cache holds waits, seated but idle, until that prompt's
computed part covers the shared prefix, and then copies it. The prefix is
computed once per group, as `--parallel 1` computes it once per run.

Not thread-safe: one thread (the model's worker in `edgellm.serve.pool`)
calls `add`, `step` and `cancel_all`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import llama_cpp

from edgellm.engine import backends
from edgellm.engine.decode import Batch, Sampler, TextStream, common_prefix, ends_reply
from edgellm.engine.ngram import NgramDrafter
from edgellm.engine.runtime import GenerationStats, SamplingParams
from edgellm.engine.speculative import DEFAULT_DRAFT_MAX, FA_TILE, DraftCounters, Speculator, VerifyCost

# Waiting for another prompt pays when it saves at least this many tokens of prefill:
# below it, the wait (a chunk of the leader's prompt) costs about what it saves.
GROUP_MIN = 64
# A fresh prompt of at least FA_TILE tokens (ggml's tiled attention, engine.speculative) is
# computed in chunks of at least FA_TILE, so every cell of it is tiled; a shorter one row by row,
# as replies are. Reused prompt cells must have been computed the way a fresh prompt's would be,
# or the reply depends on what the cache held (`_reuse`). A long prompt's last turn is the
# exception: from the first turn boundary (a control token, `row_tail_start`) in its last
# MAX_ROW_TAIL tokens it is computed row by row, fresh or not, so a cached prefix up to that
# boundary (a shared system prompt, an earlier turn) is reused as it is and only the last turn is
# decoded, where keeping it tiled re-decoded FA_TILE tokens (4x the turn, on RAG's shape).
MAX_ROW_TAIL = 48


@dataclass
class Sequence:
    """One request inside the engine; `emit(kind, value)` gets ("text", str) and finally ("end", GenerationStats)."""

    prompt: list[int]
    sampling: SamplingParams
    emit: Callable[[str, Any], None]
    cancel: Any = None  # a CancelToken
    on_token: Optional[Callable[[Any, int, int], None]] = (
        None  # (ctx, output row, token) for each sampled non-EOG token: logprobs
    )
    stats: GenerationStats = field(default_factory=GenerationStats)
    # engine state
    slot: int = -1
    n_done: int = 0  # prompt tokens in the KV cache
    out: int = -1  # this step's output row, or -1
    last: int = -1  # the token sampled last, not yet decoded
    sampler: Optional[Sampler] = None
    text: Optional[TextStream] = None
    t0: float = 0.0
    t_first: float = 0.0
    spec: Any = None  # an engine.speculative.Speculator when the request drafts
    draft: list[int] = field(default_factory=list)  # drafted tokens decoded after `last` this step
    rows: list[int] = field(default_factory=list)  # their output rows, `last`'s first
    # a verify step being sampled: (drafted tokens accepted so far, its seconds); None otherwise
    verifying: Optional[tuple[int, float]] = None
    tail: int = 0  # prompt cells from here on are computed row by row (row_tail_start)
    leader: Optional[Sequence] = None  # a sequence computing a prefix this one waits to copy
    wait_for: int = 0  # the leader's prompt tokens that must be in its cache first


def open_parallel_context(rt: Any, n_seq: int) -> None:
    """Give the runtime a context with `n_seq` sequences, each with its own KV stream.

    llama-cpp-python creates its context with one sequence and no option for
    more, so the engine replaces it (the old one is freed first: the KV
    memory is never held twice). The context keeps its size: the streams
    share its cells.
    """
    from llama_cpp import _internals

    llm = rt.llm
    params = llm.context_params
    if params.n_seq_max == n_seq:
        return
    llm._ctx.close()
    params.n_seq_max = n_seq
    params.kv_unified = False
    llm._ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
    rt._kv = []


def row_tail_start(vocab: Any, prompt: list[int]) -> int:
    """Where the row-by-row part of a prompt starts: 0 for a short prompt (all of it), else just after
    the earliest control token (a chat template's turn marker) in its last MAX_ROW_TAIL tokens, with
    at least FA_TILE tiled cells before it and two after it; the prompt's length when there is none
    (all of it tiled). A function of the prompt alone: a fresh prompt and a reused one agree."""
    n = len(prompt)
    if n < FA_TILE:
        return 0
    for p in range(max(FA_TILE, n - MAX_ROW_TAIL), n - 1):
        if llama_cpp.llama_vocab_is_control(vocab, prompt[p - 1]):
            return p
    return n


class BatchEngine:
    def __init__(self, rt: Any, n_parallel: int, *, prompt_chunk: int = 256) -> None:
        if n_parallel > 1:
            open_parallel_context(rt, n_parallel)
        self.rt = rt
        self.n_parallel = n_parallel
        self.ctx = rt.llm.ctx
        self.vocab = rt.llm._model.vocab
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_ctx = rt.n_ctx  # KV cells in all
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(self.ctx))  # a sequence's own stream: its longest prompt + reply
        self.batch = Batch(max(n_parallel, min(rt.options.n_batch, self.n_ctx)), 1)
        self.prompt_chunk = max(FA_TILE, prompt_chunk)  # a long prompt's chunks stay tiled
        self.slots: list[Optional[Sequence]] = [None] * n_parallel
        self.cached: list[list[int]] = [[] for _ in range(n_parallel)]  # tokens each seq_id holds in the KV cache
        # where each slot's row-by-row cells begin: the tail start (`row_tail_start`, FA_TILE or more) of the
        # long prompt that filled it, its cells before that tiled; 0 for a short prompt, computed row by row whole
        self.rows_from = [0] * n_parallel
        self.used_at = [0.0] * n_parallel
        self.default_seed = rt.options.seed
        # counters for /metrics
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = self.cache_hits = 0
        self.drafts = DraftCounters()  # llama-server's spec_decode_* counters
        self.verify_cost = VerifyCost()
        # rows decode as they would alone (the edgellm ggml patches): pieces of one token are safe
        self.invariant = backends.keep_batch_invariant(FA_TILE)

    # -- admission -------------------------------------------------------------

    def free(self) -> int:
        return sum(1 for s in self.slots if s is None)

    def active(self) -> int:
        return self.n_parallel - self.free()

    def kv_tokens(self) -> int:
        """KV cells in use: the tokens every slot holds, running or cached."""
        return sum(len(c) for c in self.cached)

    def add(self, seq: Sequence) -> None:
        """Seat `seq` in a free slot, reusing the longest cached prefix of its prompt."""
        prompt = seq.prompt
        free = [i for i, s in enumerate(self.slots) if s is None]
        if not free:
            raise RuntimeError("no free sequence slot")
        # The free slot with the longest common prefix; ties go to the least recently used.
        dst = max(free, key=lambda i: (common_prefix(self.cached[i], prompt), -self.used_at[i]))
        seq.slot = dst
        self.slots[dst] = seq
        cached = self._reuse(seq)
        # (shared prefix, sequence) of each prompt still being computed; the longest leads
        computing = [
            (min(common_prefix(s.prompt, prompt), len(prompt) - 2), s)
            for s in self.slots
            if s is not None and s is not seq and s.leader is None and s.n_done < len(s.prompt)
        ]
        shared, lead = max(computing, key=lambda c: c[0], default=(0, None))
        if lead is not None and shared - cached >= GROUP_MIN:
            seq.leader, seq.wait_for = lead, shared
        keep = seq.n_done
        seq.sampler = Sampler(self.vocab, seq.sampling, default_seed=self.default_seed)
        seq.text = TextStream(self.vocab, seq.sampling.stop)
        mode = (seq.sampling.draft or self.rt.options.draft or "off").lower()
        if mode != "off":  # one context holds every sequence: drafts come from n-grams (a draft model is chat's)
            d = NgramDrafter(is_end=ends_reply(self.vocab))
            d.reset(prompt)
            seq.spec = Speculator(d, draft_max=seq.sampling.draft_max or DEFAULT_DRAFT_MAX, cost=self.verify_cost)
            seq.stats.draft = "ngram"
        st = seq.stats
        st.prompt_tokens, st.reused_tokens, st.evaluated_prompt_tokens = len(prompt), keep, len(prompt) - keep
        st.stop_reason = "length"
        seq.t0 = time.perf_counter()
        self.prompt_tokens += len(prompt)
        if seq.leader is None:
            self.cached_tokens += keep
            self.cache_hits += keep > 0

    def _reuse(self, seq: Sequence) -> int:
        """Set up `seq`'s slot with the longest cached prefix of its prompt (its own slot's, or a copy); returns it."""
        prompt, dst = seq.prompt, seq.slot
        tiled = len(prompt) >= FA_TILE

        def usable(i: int) -> int:
            # prompt cells computed on the path this prompt's take: tiled for a long one, row by row for a short
            # one. A conversation's earlier reply (row by row, drafts or not) is reused as llama-server does: a
            # next turn does not recompute it, and with or without drafts its cells are the same
            return common_prefix(self.cached[i], prompt) if (self.rows_from[i] > 0) == tiled else 0

        src, best = dst, usable(dst)
        for i in range(self.n_parallel):
            if i != dst and len(self.cached[i]) > best:
                n = usable(i)
                if n > best:
                    src, best = i, n
        # The last prompt token is decoded again for its logits: a short prompt's alone (beside the running
        # tokens, see `step`; with one more where rows are not invariant, so that the piece is never a
        # single token); a long one's row-by-row last turn whole, or,
        # where the cache stops short of it (or there is none), a tiled tail of at least FA_TILE tokens.
        seq.tail = row_tail_start(self.vocab, prompt)
        if not tiled:
            keep = min(best, len(prompt) - (1 if self.invariant else 2))
        elif seq.tail <= best and seq.tail < len(prompt):
            # A prompt whose last turn started where this one's does (another question on the same system
            # prompt) computed its cells from there row by row too: the ones this prompt shares are the cells
            # it would compute, so only the rest of its turn is decoded.
            same_rows = self.invariant and self.rows_from[src] == seq.tail
            keep = min(best, len(prompt) - 1) if same_rows else seq.tail
        else:
            keep = min(best, seq.tail - FA_TILE)
        keep = max(0, keep)
        if src == dst:
            llama_cpp.llama_memory_seq_rm(self.mem, dst, keep, -1)
        else:
            llama_cpp.llama_memory_seq_rm(self.mem, dst, -1, -1)
            if keep > 0:
                # Across streams llama.cpp copies only whole streams; the tail is cut right after.
                llama_cpp.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
                llama_cpp.llama_memory_seq_rm(self.mem, dst, keep, -1)
        self.cached[dst] = list(prompt[:keep])
        self.rows_from[dst] = seq.tail if tiled else 0
        seq.n_done = keep
        return keep

    def _follow(self, seq: Sequence) -> bool:
        """A waiting sequence copies its leader's prefix once it is computed (or the leader left); False: still waiting."""
        lead = seq.leader
        assert lead is not None
        if self.slots[lead.slot] is lead and lead.n_done < seq.wait_for:
            return False
        seq.leader = None
        keep = self._reuse(seq)
        seq.stats.reused_tokens, seq.stats.evaluated_prompt_tokens = keep, len(seq.prompt) - keep
        self.cached_tokens += keep
        self.cache_hits += keep > 0
        return True

    # -- one decode step ---------------------------------------------------------

    def step(self) -> int:
        """One decode of the generating sequences (and of newcomers' last prompt tokens), then one per newcomer's
        longer prompt chunk; returns the tokens decoded."""
        for s in self.slots:
            if s is not None and s.cancel is not None and s.cancel.cancelled:
                self._finish(s, "cancelled")
        seqs = [s for s in self.slots if s is not None]
        if not seqs:
            return 0
        # Batch invariance: llama.cpp's CPU kernels pick their path by how many
        # tokens of one sequence a ubatch holds, and stock ggml rounds the paths
        # differently; edgellm's ggml patches compute every row of a ubatch under
        # FA_TILE rows as it is computed alone (`self.invariant`). llama.cpp still
        # splits a decode whose sequences bring unequal numbers of tokens into
        # several ubatches (several passes over the weights), so a newcomer's
        # prompt chunk of two or more tokens gets a decode of its own, while one
        # whose prompt is cached but for its last token decodes that token as one
        # more row of this step (a separate decode would pass over the weights
        # for one row). Without the patches every piece stays apart and is never
        # a single token unless the whole prompt is one.
        n = 0
        gen = [s for s in seqs if s.last >= 0]
        join = [s for s in seqs if s.last < 0 and s.leader is None and len(s.prompt) - s.n_done == 1] if self.invariant else []
        if gen or join:
            n += self._step_running(gen, join)
        for s in seqs:
            left = len(s.prompt) - s.n_done
            if left <= 0 or self.slots[s.slot] is not s or (s.leader is not None and not self._follow(s)):
                continue
            left = len(s.prompt) - s.n_done
            # Chunks only matter while others generate; alone, a prompt takes the whole batch. No tiled
            # chunk is left shorter than FA_TILE (nor a short prompt's piece a single token), and the
            # row-by-row last turn is one piece, so every cell takes its path (`_reuse`).
            if s.n_done >= s.tail > 0:
                k = left
            else:
                upto = (s.tail or len(s.prompt)) - s.n_done
                k = min(upto, self.prompt_chunk if self.active() > 1 else self.batch.capacity)
                if 0 < upto - k < FA_TILE:
                    k = upto if upto <= self.batch.capacity else k - FA_TILE
            start = s.n_done

            def fill(b: Batch, live: list[Sequence], s: Sequence = s, start: int = start, k: int = k) -> None:
                for j in range(start, start + k):
                    i = b.add(s.prompt[j], j, s.slot, j == len(s.prompt) - 1)
                s.out = i if start + k == len(s.prompt) else -1

            n += self._decode([s], fill)
            if self.slots[s.slot] is not s:
                continue
            self.cached[s.slot].extend(s.prompt[start : start + k])
            s.n_done += k
            if s.out >= 0:
                self._sample(s, time.perf_counter())
        return n

    def _step_running(self, gen: list[Sequence], join: list[Sequence]) -> int:
        """Decode the generating sequences' tokens (and their drafts) with the joining newcomers' last prompt tokens."""
        # drafted tokens each may add: the step stays under FA_TILE rows in all, where every row is
        # computed as it would be alone (engine.speculative), whoever else is generating
        share = max(0, (min(self.batch.capacity, FA_TILE - 1) - len(gen) - len(join)) // max(1, len(gen)))
        for s in gen:
            if s.spec is not None:
                room = min(
                    share, self.n_ctx_seq - len(self.cached[s.slot]) - 2, s.sampling.max_tokens - s.stats.generated_tokens - 1
                )
                s.draft = s.spec.propose(room)

        fillers: list[tuple[int, int]] = []  # (slot, position) of this step's throw-away rows

        def fill_gen(b: Batch, live: list[Sequence]) -> None:
            # llama.cpp puts sequences of their own KV streams in one ubatch only while their ids run
            # on without a gap (split_equal, sequential): an idle slot between two running ones would
            # cost a second pass over the weights, so it gets a throw-away row past its cells, removed
            # after the decode. Every row is computed as alone, so no reply depends on it.
            by_slot = {s.slot: s for s in live}
            lo, hi = min(by_slot), max(by_slot)
            fillers[:] = [
                (i, len(self.cached[i]))
                for i in range(lo, hi)
                if self.invariant and i not in by_slot and len(self.cached[i]) + 1 < self.n_ctx_seq
            ]
            pad = dict(fillers)
            for i in range(lo, hi + 1):
                s = by_slot.get(i)
                if s is None:
                    if i in pad:
                        b.add(0, pad[i], i, False)
                elif s.last < 0:  # a joining newcomer's last prompt token
                    s.out = b.add(s.prompt[-1], len(s.prompt) - 1, i, True)
                else:
                    pos = len(self.cached[i])
                    s.out = b.add(s.last, pos, i, True)
                    s.rows = [s.out] + [b.add(d, pos + 1 + k, i, True) for k, d in enumerate(s.draft)]

        t = time.perf_counter()
        n = self._decode(gen + join, fill_gen)
        now = time.perf_counter()
        for i, pos in fillers:
            llama_cpp.llama_memory_seq_rm(self.mem, i, pos, -1)
        for s in join:
            if self.slots[s.slot] is s:
                self.cached[s.slot].append(s.prompt[-1])
                s.n_done += 1
                self._sample(s, now)
        for s in gen:
            if self.slots[s.slot] is s:
                self.cached[s.slot].append(s.last)
                if s.draft:
                    self._verify(s, now, now - t)
                else:
                    if s.spec is not None:
                        s.spec.plain(now - t)
                    self._sample(s, now)
        return n

    def _decode(self, seqs: list[Sequence], fill: Callable[[Batch, list[Sequence]], None]) -> int:
        """Fill and decode the batch for those of `seqs` still running, making room in the KV cache when it is full."""
        b = self.batch
        while True:
            live = [s for s in seqs if self.slots[s.slot] is s]
            if not live:
                return 0
            b.clear()
            fill(b, live)
            if b.decode(self.ctx) == 0:
                return b.n
            # Requests are checked against a stream's size, so this is a safety net only.
            if not self._evict_one():  # no idle cache left to drop: the youngest sequence gives way
                self._finish(max((s for s in self.slots if s is not None), key=lambda s: s.t0), "length")

    def _verify(self, s: Sequence, now: float, seconds: float) -> None:
        """Sample the rows of `last` and its drafted tokens in order, keeping drafted tokens while they are the ones sampled."""
        cached = self.cached[s.slot]
        acc = 0
        for j, row in enumerate(s.rows):
            s.out = row
            s.verifying = (acc, seconds)  # a row that ends the reply counts this step in _finish, before the reply is sent
            self._sample(s, now)
            if self.slots[s.slot] is not s or j >= len(s.draft) or s.last != s.draft[j]:
                break
            cached.append(s.last)  # its cell was decoded in this step
            acc += 1
        if s.verifying is not None:  # still running: the step ends here
            s.verifying = None
            s.spec.verified(len(s.draft), acc, acc < len(s.draft), seconds)
            self.drafts.add(len(s.draft), acc)
        llama_cpp.llama_memory_seq_rm(self.mem, s.slot, len(cached), -1)  # the rejected tail, or what a stop cut off
        s.draft = []

    def _sample(self, s: Sequence, now: float) -> None:
        assert s.sampler is not None and s.text is not None  # a seated sequence has both (add)
        tok = s.sampler.sample(self.ctx, s.out)
        st = s.stats
        if not s.t_first:
            s.t_first = now
            st.ttft_seconds = st.prompt_seconds = now - s.t0
        if llama_cpp.llama_vocab_is_eog(self.vocab, tok):
            return self._finish(s, "eos")
        if s.on_token is not None:  # before the text: the row's logits are still this token's
            s.on_token(self.ctx, s.out, tok)
        st.generated_tokens += 1
        self.generated_tokens += 1
        piece = s.text.push(tok)
        if piece:
            s.emit("text", piece)
        if s.text.stopped:
            return self._finish(s, "stop")
        if st.generated_tokens >= s.sampling.max_tokens or len(self.cached[s.slot]) + 1 >= self.n_ctx_seq:
            return self._finish(s, "length")
        s.last = tok
        if s.spec is not None:
            s.spec.push(tok)

    def _finish(self, s: Sequence, reason: str) -> None:
        assert s.sampler is not None and s.text is not None  # only seated sequences finish (add)
        st = s.stats
        st.stop_reason = reason
        if s.spec is not None:
            if s.verifying is not None:  # ended inside a verify step: count it now, the reply carries it
                acc, seconds = s.verifying
                s.verifying = None
                s.spec.verified(len(s.draft), acc, False, seconds)
                self.drafts.add(len(s.draft), acc)
            c = s.spec.counters
            st.draft_tokens, st.draft_accepted, st.draft_steps, st.draft_accepted_per_pos = (
                c.drafted,
                c.accepted,
                c.steps,
                list(c.per_pos),
            )
        now = time.perf_counter()
        if s.t_first:
            st.generation_seconds = now - s.t_first
        else:
            st.prompt_seconds = now - s.t0
        if reason != "stop":
            tail = s.text.flush()
            if tail:
                s.emit("text", tail)
        s.sampler.close()
        self.slots[s.slot] = None
        self.used_at[s.slot] = now
        s.emit("end", st)

    def _evict_one(self) -> bool:
        """Drop the least recently used finished sequence's cells; False when there is none."""
        idle = [i for i, s in enumerate(self.slots) if s is None and self.cached[i]]
        if not idle:
            return False
        i = min(idle, key=lambda i: self.used_at[i])
        llama_cpp.llama_memory_seq_rm(self.mem, i, -1, -1)
        self.cached[i] = []
        return True

    def cancel_all(self, reason: str = "cancelled") -> None:
        for s in list(self.slots):
            if s is not None:
                self._finish(s, reason)

    def close(self) -> None:
        self.cancel_all()
        self.batch.close()


__all__ = ["BatchEngine", "Sequence", "open_parallel_context"]
