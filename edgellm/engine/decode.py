"""edgellm's own decode loop on llama.cpp's C API (through llama_cpp's ctypes bindings).

llama-cpp-python's `Llama.generate` wraps every token in Python bookkeeping:
a batch rebuilt per call, a numpy copy of the whole logits row, its own
sampler wrapper. Here one `llama_batch` is allocated once per context and
refilled in place, sampling is a native `llama_sampler` chain per sequence
(`llama_sampler_sample` reads the logits inside llama.cpp), and text comes
from `llama_token_to_piece` into a reused buffer. What is left in Python per
token is a handful of ctypes calls and the stop-string check.

The pieces here are shared by the single-stream loop (`Runtime.stream`, which
drives `edgellm chat`, the TUI and `--parallel 1`) and the batched one
(`edgellm.engine.batch`, which drives `edgellm serve --parallel N`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any, Optional

import llama_cpp

from edgellm.engine.native_io import capture_native_stderr
from edgellm.errors import RuntimeFailure, UsageError

RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp draws a random seed


def grammar_text(grammar: Any) -> Optional[str]:
    """GBNF from a string, a `Constraint`, or a llama_cpp `LlamaGrammar` (older callers)."""
    if grammar is None:
        return None
    if isinstance(grammar, str):
        return grammar
    for attr in ("gbnf", "_grammar"):
        g = getattr(grammar, attr, None)
        if isinstance(g, str):
            return g
    raise UsageError(f"cannot use {type(grammar).__name__} as a grammar")


# A vocabulary's end-of-generation tokens: a scan of every token (~20 ms), so kept. The vocab is a bare address
# (llama.cpp's bindings return an int), which a model loaded after an eviction can reuse: the key adds the
# vocabulary's size and special tokens, which tell tokenizers apart.
_EOG: dict[tuple[int, ...], list[int]] = {}


def _no_eog_sampler(vocab: Any) -> Any:
    """A logit-bias sampler that takes every end-of-generation token out, as llama-server's `ignore_eos` does."""
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    key = (int(vocab), n, llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab), llama_cpp.llama_vocab_eot(vocab))
    eog = _EOG.get(key)
    if eog is None:
        eog = _EOG[key] = [t for t in range(n) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    bias = (llama_cpp.llama_logit_bias * len(eog))(*[llama_cpp.llama_logit_bias(t, float("-inf")) for t in eog])
    return llama_cpp.llama_sampler_init_logit_bias(n, len(eog), bias)


class Sampler:
    """A native sampler chain for one sequence: grammar, penalties, top-k/top-p/min-p, temperature, seed.

    Temperature 0 (or below) is greedy, as in llama.cpp's tools. A grammar
    goes first so that the truncation samplers only ever see allowed tokens.
    """

    __slots__ = ("ptr",)

    def __init__(self, vocab: Any, sampling: Any, *, default_seed: int = RANDOM_SEED) -> None:
        params = llama_cpp.llama_sampler_chain_default_params()
        params.no_perf = True
        self.ptr = llama_cpp.llama_sampler_chain_init(params)
        add = llama_cpp.llama_sampler_chain_add
        try:
            gbnf = grammar_text(sampling.grammar)
            if gbnf is not None:
                g = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), b"root")
                if not g:
                    raise UsageError("llama.cpp could not parse the grammar")
                add(self.ptr, g)
            if sampling.ignore_eos:
                add(self.ptr, _no_eog_sampler(vocab))
            if sampling.repeat_penalty and sampling.repeat_penalty != 1.0:
                add(self.ptr, llama_cpp.llama_sampler_init_penalties(64, float(sampling.repeat_penalty), 0.0, 0.0))
            if sampling.temperature is None or sampling.temperature <= 0:
                add(self.ptr, llama_cpp.llama_sampler_init_greedy())
                return
            if sampling.top_k and sampling.top_k > 0:
                add(self.ptr, llama_cpp.llama_sampler_init_top_k(int(sampling.top_k)))
            if sampling.top_p is not None and sampling.top_p < 1.0:
                add(self.ptr, llama_cpp.llama_sampler_init_top_p(float(sampling.top_p), 1))
            if sampling.min_p and sampling.min_p > 0:
                add(self.ptr, llama_cpp.llama_sampler_init_min_p(float(sampling.min_p), 1))
            add(self.ptr, llama_cpp.llama_sampler_init_temp(float(sampling.temperature)))
            seed = sampling.seed if sampling.seed is not None else default_seed
            add(self.ptr, llama_cpp.llama_sampler_init_dist(int(seed) & 0xFFFFFFFF))
        except BaseException:
            self.close()
            raise

    def sample(self, ctx: Any, idx: int = -1) -> int:
        """Sample from the idx-th output of the last decode, and accept the token into the chain's state."""
        return llama_cpp.llama_sampler_sample(self.ptr, ctx, idx)

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        self.close()


class Batch:
    """One `llama_batch`, allocated once and refilled in place for every decode."""

    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        self.capacity = capacity
        self.b = llama_cpp.llama_batch_init(capacity, 0, n_seq_max)
        b = self.b
        self.token, self.pos, self.n_seq_id, self.seq_id, self.logits = b.token, b.pos, b.n_seq_id, b.seq_id, b.logits
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int, want_logits: bool) -> int:
        """Append one token; returns its index (the output index when `want_logits`)."""
        i = self.n
        self.token[i] = token
        self.pos[i] = pos
        self.n_seq_id[i] = 1
        self.seq_id[i][0] = seq
        self.logits[i] = want_logits
        self.n = i + 1
        return i

    def decode(self, ctx: Any) -> int:
        """llama_decode; 0 on success, 1 when the KV cache has no room, raises on anything else."""
        self.b.n_tokens = self.n
        rc = llama_cpp.llama_decode(ctx, self.b)
        if rc not in (0, 1):
            raise RuntimeFailure(f"llama_decode failed ({rc})")
        return rc

    def close(self) -> None:
        if self.b is not None:
            llama_cpp.llama_batch_free(self.b)
            self.b = None

    def __del__(self) -> None:
        self.close()


def decode_prompt(ctx: Any, batch: Batch, tokens: Sequence[int], start_pos: int, seq: int = 0, *, cancel: Any = None) -> bool:
    """Evaluate `tokens` from `start_pos` in batch-sized chunks, logits for the last one only.

    Returns False when cancelled between chunks (the KV then holds the chunks done).
    """
    n = len(tokens)
    cap = batch.capacity
    for c in range(0, n, cap):
        if cancel is not None and cancel.cancelled:
            return False
        batch.clear()
        end = min(n, c + cap)
        for i in range(c, end):
            batch.add(tokens[i], start_pos + i, seq, i == n - 1)
        if batch.decode(ctx) != 0:
            raise UsageError("the KV cache is full; raise --ctx")
    return True


def token_piece(vocab: Any, token: int, *, special: bool) -> bytes:
    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, special)
        if n >= 0:
            return buf.raw[:n]
        size = -n + 1


class TextStream:
    """Generated tokens → text: whole UTF-8 characters only, cut at the first stop string.

    Text that may be the start of a stop string is held back until it is
    clear that it is not, so a stop string never reaches the client.
    """

    __slots__ = ("vocab", "stops", "buf", "size", "pending", "held", "stopped")

    def __init__(self, vocab: Any, stops: Sequence[str] = ()) -> None:
        self.vocab = vocab
        self.stops = [s for s in stops if s]
        self.size = 128
        self.buf = ctypes.create_string_buffer(self.size)
        self.pending = b""  # bytes of an incomplete UTF-8 character
        self.held = ""  # text that may be the start of a stop string
        self.stopped = False

    def push(self, token: int) -> str:
        """The text that is safe to show after `token`; sets `stopped` when a stop string appeared."""
        n = llama_cpp.llama_token_to_piece(self.vocab, token, self.buf, self.size, 0, False)
        data = self.buf.raw[:n] if n >= 0 else token_piece(self.vocab, token, special=False)
        if self.pending:
            data = self.pending + data
            self.pending = b""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            if len(data) - e.start < 4 and e.end == len(data):  # an incomplete trailing character: wait
                self.pending = data[e.start :]
                text = data[: e.start].decode("utf-8", "replace")
            else:
                text = data.decode("utf-8", "replace")
        if not self.stops:
            return text
        held = self.held + text
        cut = _find_stop(held, self.stops)
        if cut is not None:
            self.stopped = True
            self.held = ""
            return held[:cut]
        keep = _stop_prefix_len(held, self.stops)
        self.held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep]

    def flush(self) -> str:
        """What was held back, at the end of a reply that did not stop on a stop string."""
        if self.stopped:
            return ""
        out = self.held + (self.pending.decode("utf-8", "replace") if self.pending else "")
        self.held, self.pending = "", b""
        return out


def _find_stop(text: str, stops: list[str]) -> Optional[int]:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def ends_reply(vocab: Any) -> Callable[[int], bool]:
    """Whether a token ends a reply (the vocab's end-of-generation tokens), for an n-gram draft to stop
    after it (engine.ngram). The decode loops apply the same rule inline, without this extra call per token."""
    return lambda token: bool(llama_cpp.llama_vocab_is_eog(vocab, token))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_grammar(vocab: Any, gbnf: str) -> None:
    """Parse a GBNF grammar with llama.cpp's parser; a bad one → one-line UsageError.

    llama.cpp prints parse errors to stderr (or its log) and returns NULL,
    which a sampler chain must never be handed, so check it up front with
    the output captured for the message.
    """
    from llama_cpp import _logger

    if not gbnf.strip():
        raise UsageError("the grammar is empty")
    logged: list[str] = []

    @llama_cpp.llama_log_callback
    def on_log(level, text, _user):  # some parse errors go to the log, not stderr
        logged.append(text.decode("utf-8", "replace") if text else "")

    llama_cpp.llama_log_set(on_log, None)
    try:
        with capture_native_stderr() as captured:
            smpl = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), b"root")
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, None)
    if not smpl:
        raise UsageError("invalid grammar: " + _grammar_error(captured.text + "\n" + "".join(logged)))
    llama_cpp.llama_sampler_free(smpl)


def _grammar_error(text: str) -> str:
    """The first useful line of llama.cpp's grammar parser output."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "error parsing grammar" in ln or "parse:" in ln or "Undefined rule" in ln or "root" in ln:
            msg = ln.split("error parsing grammar:", 1)[-1].strip()
            return msg.rstrip(".")[:200]
    return lines[0][:200] if lines else "llama.cpp could not parse it"


__all__ = [
    "Sampler",
    "Batch",
    "TextStream",
    "decode_prompt",
    "token_piece",
    "grammar_text",
    "common_prefix",
    "check_grammar",
    "RANDOM_SEED",
]
