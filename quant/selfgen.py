"""Text the model writes itself: more inputs for error feedback's covariances (quant/feedback.py).

Why: error feedback needs H = X^T X of each matmul's inputs, and the shipped calibration text is ~5k tokens,
so H's off-diagonal is noisy and fitted to that text: on the gridless 135M model, Q5_1 feedback cut a matrix's
proxy error to 0.70x on the calibration text and only to 0.80-0.88x on held-out text. More of a narrow text
did not help (the calibration text plus 15k tokens of Python's docs: WikiText-2 KLD 0.808x -> 0.815x of
llama-quantize --imatrix at the Q5_K_M size). Text the model samples from itself at temperature 1 is its own
distribution of inputs, needs no data beside the package, and is as long as one asks: with 10k such tokens
beside the calibration text (and half the shrinkage) the same file reached 0.766x (docs/quantize.md, "Why the
model's own tokens").

Sequences are sampled in parallel, one token per sequence per decode, from a seeded numpy generator (the
Gumbel-max trick over the whole vocabulary), so a machine writes the same tokens every time; each sequence is
one chunk of `GEN_CTX` tokens starting with BOS, the layout the covariance pass reads chunks in.

Their cost grows with the model, their gain does not: `sequences_for` gives each model the forward work the
default model's 20 sequences take, so from ~1.4B weights on H comes from the calibration text alone. A user who
makes a model's files at two or three sizes would write the same tokens each time: `written_tokens` keeps them under `<home>/selfgen/`,
keyed by the model's sha256, the sampling setup, llama.cpp's version and the CPU's flags (another kernel can
round a logit differently and so sample another token).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np

from edgellm import paths
from edgellm.errors import RuntimeFailure
from edgellm.fsutil import atomic_open
from edgellm.progress import CancelToken, Progress, ProgressCallback, RateMeter, no_progress
from quant.imatrix import DEFAULT_CTX as GEN_CTX  # a written sequence is one chunk of the covariance pass
from quant.perplexity import LogitsRunner

GEN_SEQS = 20  # at most: 10,240 tokens, twice the calibration text: the count measured (19 chunks) rounded up
# The forward work the written tokens may cost, in weight x token products (they are decoded once and read once
# by the pass): what the default model's 20 sequences take (135M x 10,240 = 1.4e12). A larger model writes
# fewer, in steps of GEN_STEP (a decode step of 4 sequences costs nearly what one of 20 does on a CPU, so fewer
# buy little): 1.93B writes none. Measured there, the 20 sequences cost 259 s to write and 180 s more of the
# pass for 0.773x -> 0.751x at the Q5_K_M size, and with them a cold --budget --error-feedback job was 12.5x
# one llama-quantize run against --budget's 10x; the calibration text alone keeps 0.773x (docs/quantize.md).
GEN_WORK = 1.5e12
GEN_STEP = 4
GEN_SEED = 20261206
VERSION = 1  # of what is sampled and how; a change leaves older cached tokens unread


class _Sampler(LogitsRunner):
    LOAD_FAILED = "llama.cpp could not load {name} to write error feedback's calibration tokens"

    def sample(self, rng: np.random.Generator, on_progress: ProgressCallback, cancel: Optional[CancelToken]) -> np.ndarray:
        ll, b, n_seq, n_ctx = self._ll, self._batch, self.n_seq, self.n_ctx
        start = self.bos if self.bos >= 0 else int(ll.llama_vocab_eos(self.vocab))
        out = np.empty((n_seq, n_ctx), np.int32)
        out[:, 0] = start
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        meter = RateMeter()
        task = "error feedback: writing tokens"
        on_progress(Progress(task, 0, n_seq * n_ctx, "token", message=f"{n_seq} sequences"))
        for pos in range(n_ctx - 1):
            if cancel is not None:
                cancel.check()
            b.token[:n_seq] = out[:, pos]
            b.pos[:n_seq] = pos
            b.seq[:n_seq] = np.arange(n_seq)
            b.logits[:n_seq] = 1
            b.struct.n_tokens = n_seq
            rc = ll.llama_decode(self.ctx, b.struct)
            if rc != 0:
                raise RuntimeFailure(f"llama.cpp failed to decode while sampling from {self.path.name} (code {rc})")
            logits = np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), shape=(n_seq, self.n_vocab))
            # Gumbel-max: argmax(logits + G) is a sample from softmax(logits), one vectorized step for every sequence
            out[:, pos + 1] = np.argmax(logits - np.log(-np.log(rng.random(logits.shape))), axis=1)
            done = n_seq * (pos + 2)
            on_progress(Progress(task, done, n_seq * n_ctx, "token", rate=meter.update(done)))
        return out.reshape(-1)


def generate(
    model_path: Path,
    *,
    n_seq: int = GEN_SEQS,
    n_ctx: int = GEN_CTX,
    threads: Optional[int] = None,
    seed: int = GEN_SEED,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> np.ndarray:
    """`n_seq` sequences of `n_ctx` tokens the model at `model_path` samples from BOS at temperature 1, one after
    another (int32, n_seq * n_ctx)."""
    rng = np.random.default_rng(seed)
    runner = _Sampler(model_path, n_ctx=n_ctx, n_seq=n_seq, n_batch=n_seq, threads=threads)
    try:
        return runner.sample(rng, on_progress, cancel)
    finally:
        runner.close()


def sequences_for(model_path: Path) -> int:
    """How many sequences of GEN_CTX tokens error feedback has a model write (GEN_WORK over its weights)."""
    from edgellm.gguf.layout import read_tensors

    weights = sum(int(np.prod(t.shape)) for t in read_tensors(model_path).tensors)
    return min(GEN_SEQS, int(GEN_WORK // (max(1, weights) * GEN_CTX)) // GEN_STEP * GEN_STEP)


def _cache_file(model_sha256: str, n_seq: int) -> Path:
    import llama_cpp

    from edgellm.engine.backends import cpu_flags

    key = {
        "model": model_sha256,
        "n_seq": n_seq,
        "n_ctx": GEN_CTX,
        "seed": GEN_SEED,
        "version": VERSION,
        "llama_cpp": getattr(llama_cpp, "__version__", "?"),
        "cpu": sorted(cpu_flags()),
    }
    return paths.home() / "selfgen" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".npy")


def tokens_kept(model_sha256: str, n_seq: int) -> bool:
    """Whether an earlier job on this machine kept this model's `n_seq` sequences (the next job reads them back)."""
    return _cache_file(model_sha256, n_seq).is_file()


def written_tokens(
    model_path: Path,
    model_sha256: str,
    n_seq: int,
    *,
    threads: Optional[int] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> tuple[np.ndarray, bool]:
    """`generate`'s `n_seq` sequences for this model (none for 0), from the cache when an earlier job on this
    machine wrote them (then True), else written now and kept (a killed job leaves no partial file: written by rename)."""
    if n_seq <= 0:
        return np.empty(0, np.int32), False
    cache = _cache_file(model_sha256, n_seq)
    try:
        tokens = np.load(cache, allow_pickle=False)
        if tokens.dtype == np.int32 and tokens.shape == (n_seq * GEN_CTX,):
            return tokens, True
    except (OSError, ValueError, EOFError):  # absent, or not a whole array: written again
        pass
    tokens = generate(model_path, n_seq=n_seq, threads=threads, on_progress=on_progress, cancel=cancel)
    try:
        with atomic_open(cache, "wb") as fh:
            np.save(fh, tokens, allow_pickle=False)
    except OSError:
        pass  # a read-only home costs the next job the same minutes, nothing else
    return tokens, False
