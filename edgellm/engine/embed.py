"""Embeddings and log-probabilities from a loaded model.

`Embedder` is a second llama.cpp context on a runtime's weights (no second copy of the model)
with `embeddings` on and the pooling llama.cpp reads from the model's metadata
(`<arch>.pooling_type`; mean, CLS or last token). A model that names none (a chat model such
as the default one) is pooled by the mean, as `llama-embedding --pooling mean` does, and the
result says so. Many inputs go into one `llama_decode`, each its own sequence, as long as
their tokens fit the context; vectors come back L2-normalised as OpenAI returns them.

`token_logprobs` reads one output row of the last decode: the log-softmax of the raw logits,
which is what llama-server reports for `n_probs`/`logprobs` (its default, pre-sampling).

Not thread-safe: the model's worker thread (edgellm.serve.pool) is the only caller.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import llama_cpp

from edgellm.engine.decode import Batch, token_piece
from edgellm.engine.native_io import capture_native_stderr
from edgellm.errors import UsageError

POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
POOLING_IDS = {v: k for k, v in POOLING.items()}
MAX_SEQS = 64  # inputs per decode


class InputTooLong(UsageError):
    """An embedding input with more tokens than the embedding context holds."""

    def __init__(self, index: int, n_tokens: int, limit: int) -> None:
        super().__init__(f"input[{index}] has {n_tokens} tokens; this model embeds at most {limit} tokens per input")
        self.index, self.n_tokens, self.limit = index, n_tokens, limit


@dataclass
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int
    pooling: str
    warnings: list[str]


class Embedder:
    """Pooled, normalised embeddings of token lists, on the weights of `rt` (an `edgellm.engine.runtime.Runtime`)."""

    def __init__(self, rt: Any, *, n_ctx: int, pooling: Optional[str] = None) -> None:
        from llama_cpp import _internals

        self.rt = rt
        self.warnings: list[str] = []
        model = rt.llm._model
        meta = getattr(rt.llm, "metadata", None) or {}
        arch = meta.get("general.architecture", "")
        named = meta.get(f"{arch}.pooling_type")
        if pooling is None:
            pooling = POOLING.get(int(named), "mean") if named is not None else "mean"
            if pooling in ("none", "rank"):
                pooling = "mean"
            if named is None:
                self.warnings.append(
                    f"{rt.path.name} names no pooling in its metadata; mean pooling used (as llama-embedding --pooling mean)"
                )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = (
            n_ctx  # an input is decoded whole: pooling needs every token in one ubatch
        )
        params.n_seq_max = MAX_SEQS
        params.kv_unified = True
        params.embeddings = True
        params.pooling_type = POOLING_IDS[pooling]
        params.n_threads = params.n_threads_batch = rt.n_threads
        # Flash attention's tiles make a vector depend on what else is in the batch (cosine 0.9998 against the
        # same input alone on the default model); without it batched and lone inputs agree to 1e-5.
        params.flash_attn_type = 0
        with capture_native_stderr():  # llama.cpp notes the pooling override on stderr; the warning above says it once
            self.ctx_obj = _internals.LlamaContext(model=model, params=params, verbose=False)
        self.ctx = self.ctx_obj.ctx
        self.pooling = POOLING.get(int(llama_cpp.llama_pooling_type(self.ctx)), pooling)
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        self.n_embd = int(llama_cpp.llama_model_n_embd(model.model))
        self.encoder = bool(llama_cpp.llama_model_has_encoder(model.model)) and not bool(
            llama_cpp.llama_model_has_decoder(model.model)
        )
        self.batch = Batch(self.n_ctx, 1)
        self.mem = llama_cpp.llama_get_memory(self.ctx)

    def embed(self, inputs: Sequence[Sequence[int]]) -> Embeddings:
        for i, toks in enumerate(inputs):
            if not toks:
                raise UsageError(f"input[{i}] is empty")
            if len(toks) > self.n_ctx:
                raise InputTooLong(i, len(toks), self.n_ctx)
        out: list[Optional[list[float]]] = [None] * len(inputs)
        group: list[int] = []
        used = 0
        for i, toks in enumerate(inputs):
            if group and (used + len(toks) > self.n_ctx or len(group) == MAX_SEQS):
                self._decode(inputs, group, out)
                group, used = [], 0
            group.append(i)
            used += len(toks)
        if group:
            self._decode(inputs, group, out)
        return Embeddings([v for v in out if v is not None], sum(len(t) for t in inputs), self.pooling, list(self.warnings))

    def _decode(self, inputs: Sequence[Sequence[int]], group: list[int], out: list[Optional[list[float]]]) -> None:
        llama_cpp.llama_memory_clear(self.mem, True)
        b = self.batch
        b.clear()
        for seq, i in enumerate(group):
            for pos, t in enumerate(inputs[i]):
                b.add(int(t), pos, seq, True)
        b.b.n_tokens = b.n
        rc = (llama_cpp.llama_encode if self.encoder else llama_cpp.llama_decode)(self.ctx, b.b)
        if rc != 0:
            raise UsageError(f"llama.cpp could not embed these inputs ({rc})")
        for seq, i in enumerate(group):
            ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, seq)
            if not ptr:
                raise UsageError("llama.cpp returned no pooled embedding")
            vec = [float(x) for x in ptr[: self.n_embd]]
            norm = math.sqrt(sum(x * x for x in vec)) or 1.0
            out[i] = [x / norm for x in vec]

    def close(self) -> None:
        # Both free their native memory once, however often they are closed.
        self.batch.close()
        self.ctx_obj.close()


def embed_texts(
    path: Any, texts: Sequence[str], *, n_ctx: int = 1024, n_threads: Optional[int] = None, pooling: Optional[str] = None
) -> Embeddings:
    """Load the GGUF at `path` and embed `texts` (each at most `n_ctx` tokens): what `edgellm embed` runs.

    Raises `InputTooLong`, `UsageError`, or the load's own errors (`ModelNotFound`, `InsufficientResources`).
    """
    from edgellm.engine.runtime import Runtime, RuntimeOptions

    rt = Runtime(path, RuntimeOptions(n_ctx=n_ctx, n_threads=n_threads))
    try:
        emb = Embedder(rt, n_ctx=n_ctx, pooling=pooling)
        try:
            return emb.embed([rt.tokenize(t, add_bos=True, special=True) for t in texts])
        finally:
            emb.close()
    finally:
        rt.close()


@dataclass
class TokenLogprob:
    token: int
    text: bytes
    logprob: float
    top: list[tuple[int, bytes, float]]  # the `k` likeliest tokens, best first


def token_logprobs(ctx: Any, vocab: Any, n_vocab: int, row: int, token: int, k: int) -> TokenLogprob:
    """Log-probabilities at output `row` of the last decode: `token`'s and the top `k`, over the whole vocabulary."""
    import numpy as np  # lazy: numpy only for requests that ask for logprobs

    ptr = llama_cpp.llama_get_logits_ith(ctx, row)
    logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).astype(np.float64)
    m = logits.max()
    lse = m + math.log(float(np.exp(logits - m).sum()))
    top: list[tuple[int, bytes, float]] = []
    if k > 0:
        idx = np.argpartition(-logits, k - 1)[:k]
        for t in sorted(idx.tolist(), key=lambda t: -logits[t]):
            top.append((int(t), token_piece(vocab, int(t), special=False), float(logits[t] - lse)))
    return TokenLogprob(token, token_piece(vocab, token, special=False), float(logits[token] - lse), top)


__all__ = ["Embedder", "Embeddings", "embed_texts", "InputTooLong", "TokenLogprob", "token_logprobs", "POOLING"]
