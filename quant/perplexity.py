"""Perplexity exactly as llama.cpp's `llama-perplexity` computes it.

The algorithm (tools/perplexity/perplexity.cpp, `perplexity()`): tokenize the
whole text once with the model's BOS rule and without parsing special tokens,
cut it into non-overlapping chunks of n_ctx tokens, replace each chunk's
first token with BOS, evaluate the chunk from an empty KV cache, and score
only the second half (positions n_ctx/2 .. n_ctx-2 predict the next token).
PPL = exp(mean NLL); the ± is llama.cpp's: PPL * sqrt(var(NLL) / (N - 1)).

Batching follows llama-perplexity too: with n_batch >= 2*n_ctx, n_batch/n_ctx
chunks go through one decode as parallel sequences, which is what makes the
wall time comparable. The model is driven through llama.cpp's C API via
llama-cpp-python's ctypes bindings; the batch arrays are numpy-owned and the
logits are read as a numpy view of llama.cpp's buffer, so no per-token Python
work happens anywhere.

Texts come from quant.corpus (`load_text`); this module owns the chunk
driver (`LogitsRunner`) that quant/kld.py and quant/evaluate.py reuse.
"""

from __future__ import annotations

import ctypes
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edgellm.engine import backends, hardware, rpc_native
from edgellm.engine.runtime import default_threads, silence_native_stderr
from edgellm.errors import EvalError, RuntimeFailure, UsageError
from edgellm.gguf.reader import check_tensor_data, read_gguf
from edgellm.models.resolve import resolve
from edgellm.progress import CancelToken, Progress, ProgressCallback, no_progress
from quant.corpus import Text, load_text

log = logging.getLogger(__name__)

DEFAULT_CTX = 512
DEFAULT_BATCH = 2048  # llama-perplexity's default: 4 chunks of 512 per decode
DEFAULT_UBATCH = 512


# -- the llama.cpp driver ---------------------------------------------------


def _quiet_llama() -> Any:
    import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs
    from llama_cpp import _logger  # llama_cpp loads libllama: only where llama.cpp runs

    _logger.set_verbose(False)
    return llama_cpp


class _Batch:
    """A llama_batch whose arrays numpy owns, so filling it is a few slice copies."""

    def __init__(self, capacity: int, *, bos: Optional[int]) -> None:
        import llama_cpp  # llama_cpp loads libllama: only where llama.cpp runs

        self.bos = bos  # the model's BOS when it adds one, else None
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        # seq_id is an array of per-token pointers; point each at its slot of `seq`.
        self._seq_ptrs = (self.seq.ctypes.data + 4 * np.arange(capacity, dtype=np.uintp)).astype(np.uintp)
        i32p = ctypes.POINTER(ctypes.c_int32)
        # By keyword: the fields are pointers (llama-cpp-python's annotations call them arrays).
        self.struct = llama_cpp.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(i32p),
            embd=None,
            pos=self.pos.ctypes.data_as(i32p),
            n_seq_id=self.n_seq_id.ctypes.data_as(i32p),
            seq_id=ctypes.cast(self._seq_ptrs.ctypes.data, ctypes.POINTER(i32p)),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def fill_chunks(self, tokens: np.ndarray, plan: ChunkPlan, *, start: int, j: int, n_seq: int, first_output: int) -> int:
        """Batch `j` of `n_seq` consecutive chunks of `plan.n_ctx` tokens from `start`,
        as llama-perplexity and llama-imatrix lay them out: each chunk its own
        sequence, BOS over the first token of a chunk when the model adds one,
        logits for positions >= `first_output`. Returns the tokens filled."""
        n_ctx, n_batch, bos = plan.n_ctx, plan.n_batch, self.bos
        size = min(n_ctx - j * n_batch, n_batch)
        pos = np.arange(j * n_batch, j * n_batch + size, dtype=np.int32)
        n = 0
        for seq in range(n_seq):
            s = start + j * n_batch + seq * n_ctx
            self.token[n : n + size] = tokens[s : s + size]
            if bos is not None and j == 0:
                self.token[n] = bos
            self.pos[n : n + size] = pos
            self.seq[n : n + size] = seq
            self.logits[n : n + size] = pos >= first_output
            n += size
        self.struct.n_tokens = n
        return n


@dataclass
class ChunkPlan:
    n_ctx: int
    n_chunk: int
    n_batch: int
    n_seq: int
    first: int

    @property
    def n_scored_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first


@dataclass(frozen=True)
class Scoring:
    """The text a model is scored on and how (llama-perplexity's -c, --chunks, -b, -t), one value
    for `perplexity()` and `evaluate()` so the two read and chunk a text alike."""

    text: Optional[str | Path] = None
    corpus: Optional[str] = None
    ctx: int = DEFAULT_CTX
    chunks: Optional[int] = None
    batch: Optional[int] = None  # None: DEFAULT_BATCH
    threads: Optional[int] = None

    @property
    def n_batch(self) -> int:
        return DEFAULT_BATCH if self.batch is None else self.batch

    @property
    def n_seq(self) -> int:
        """Chunks per decode, as llama-perplexity fits them in the batch."""
        return max(1, self.n_batch // self.ctx)

    def load_text(self) -> Text:
        return load_text(self.text, self.corpus)

    def check(self) -> None:
        """Refuse bad numbers before llama.cpp sees them (it asserts rather than reports)."""
        if self.ctx < 16:
            raise UsageError(f"--ctx {self.ctx} is too small (at least 16)")
        if self.n_batch < 1:
            raise UsageError("--batch must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise UsageError("--threads must be at least 1")
        if self.chunks is not None and self.chunks < 1:
            raise UsageError("--chunks must be at least 1")

    def runner(self, path: Path | str, rpc_plan: Any = None) -> LogitsRunner:
        n_seq = self.n_seq
        n_batch = min(self.n_batch, n_seq * self.ctx)
        return LogitsRunner(path, n_ctx=self.ctx, n_seq=n_seq, n_batch=n_batch, threads=self.threads, rpc_plan=rpc_plan)

    def plan(self, n_tokens: int) -> ChunkPlan:
        return plan_chunks(n_tokens, self.ctx, self.chunks, self.n_batch)


def plan_chunks(n_tokens: int, n_ctx: int, chunks: Optional[int], batch: Optional[int]) -> ChunkPlan:
    """llama-perplexity's chunk and batch arithmetic, with its refusals as one-line errors."""
    if n_ctx < 16:
        raise UsageError(f"--ctx {n_ctx} is too small (at least 16)")
    if chunks is not None and chunks < 1:
        raise UsageError("--chunks must be at least 1")
    batch = DEFAULT_BATCH if batch is None else batch
    if batch < 1:
        raise UsageError("--batch must be at least 1")
    if n_tokens < 2 * n_ctx:
        raise EvalError(f"the text tokenizes to only {n_tokens} tokens; perplexity with --ctx {n_ctx} needs at least {2 * n_ctx}")
    n_chunk_max = n_tokens // n_ctx
    n_chunk = n_chunk_max if chunks is None else min(chunks, n_chunk_max)
    n_seq = max(1, batch // n_ctx)
    n_batch = min(batch, n_seq * n_ctx)
    return ChunkPlan(n_ctx=n_ctx, n_chunk=n_chunk, n_batch=n_batch, n_seq=n_seq, first=n_ctx // 2)


class LogitsRunner:
    """One model and one llama.cpp context sized for a chunk plan.

    `chunks(tokens, plan)` yields, per chunk, the logits of the scored
    positions (a float32 (n_ctx-1-first, n_vocab) view, valid until the next
    iteration) and the token each row predicts.
    """

    # what a failed load or context says; a subclass that loads the model for another purpose names it
    LOAD_FAILED = "llama.cpp could not load {name}"
    CONTEXT_FAILED = "llama.cpp could not create a context of {tokens} tokens for {name}"

    def __init__(
        self, path: Path | str, *, n_ctx: int, n_seq: int, n_batch: int, threads: Optional[int] = None, rpc_plan: Any = None
    ) -> None:
        self.path = Path(path)
        self.info = read_gguf(self.path)  # validate before llama.cpp sees the file
        check_tensor_data(self.path)  # NaN/Inf weights would only yield "PPL nan"
        self._open(n_ctx=n_ctx, n_seq=n_seq, n_batch=n_batch, threads=threads or default_threads(), rpc_plan=rpc_plan)

    def _tune(self, mp: Any, cp: Any) -> None:
        """A subclass's additions to llama.cpp's model and context parameters (an eval callback, a load mode)."""

    def _open(self, *, n_ctx: int, n_seq: int, n_batch: int, threads: int, rpc_plan: Any = None) -> None:
        """The model on the CPU (or `rpc_plan`'s workers) and one context for `n_seq` chunks of `n_ctx` tokens,
        decoded `n_batch` at a time, as llama-perplexity and llama-imatrix set them up."""
        llama_cpp = _quiet_llama()
        self._ll = llama_cpp
        self.threads = threads

        backends.ensure(self.path, tester=hardware.self_test)  # the portable build's CPU variant, before the load
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx * n_seq
        cp.n_batch = n_batch
        cp.n_ubatch = min(DEFAULT_UBATCH, n_batch)
        cp.n_seq_max = n_seq
        cp.n_threads = self.threads
        cp.n_threads_batch = self.threads
        cp.no_perf = True
        self._tune(mp, cp)
        if rpc_plan is not None:  # layers on llama.cpp RPC workers (edgellm.engine.rpc); the plan was printed
            _keep = rpc_native.apply_to_params(mp, rpc_plan)  # noqa: F841  (alive until the load returns)
        with silence_native_stderr():
            self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mp)
        if rpc_plan is not None and self.model:
            rpc_native.harden_sockets([w.endpoint for w in rpc_plan.workers])
        if not self.model:
            raise RuntimeFailure(self.LOAD_FAILED.format(name=self.path.name))
        with silence_native_stderr():
            self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            self.model = None
            raise RuntimeFailure(self.CONTEXT_FAILED.format(tokens=n_ctx * n_seq, name=self.path.name))
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.n_ctx, self.n_seq, self.n_batch = n_ctx, n_seq, n_batch
        self._batch = _Batch(n_batch, bos=self.bos if self.add_bos else None)
        self.eval_seconds = 0.0

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._ll.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self._ll.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> LogitsRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - safety net
        try:
            self.close()
        except Exception:
            pass

    def tokenize(self, data: bytes) -> np.ndarray:
        """common_tokenize(ctx, text, add_special=true, parse_special=false)."""
        return tokenize(self._ll, self.vocab, data)

    def chunks(
        self, tokens: np.ndarray, plan: ChunkPlan, *, cancel: Optional[CancelToken] = None
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        ll, b = self._ll, self._batch
        n_ctx, first, n_vocab = plan.n_ctx, plan.first, self.n_vocab
        n_out = n_ctx - first  # outputs requested per chunk (the last one predicts nothing)
        n_score = n_ctx - 1 - first
        num_batches = (n_ctx + plan.n_batch - 1) // plan.n_batch
        joined = np.empty((n_out, n_vocab), np.float32) if num_batches > 1 else None
        mem = ll.llama_get_memory(self.ctx)
        for i in range(0, plan.n_chunk, plan.n_seq):
            if cancel is not None:
                cancel.check()
            start = i * n_ctx
            n_seq_batch = min(plan.n_seq, plan.n_chunk - i)
            t0 = time.perf_counter()
            ll.llama_memory_clear(mem, True)
            got = 0
            for j in range(num_batches):
                n = b.fill_chunks(tokens, plan, start=start, j=j, n_seq=n_seq_batch, first_output=first)
                rc = ll.llama_decode(self.ctx, b.struct)
                if rc != 0:
                    raise RuntimeFailure(f"llama.cpp failed to decode chunk {i + 1} of {self.path.name} (code {rc})")
                n_outputs = int(np.count_nonzero(b.logits[:n]))
                if n_outputs and joined is not None:
                    view = np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), shape=(n_outputs, n_vocab))
                    joined[got : got + n_outputs] = view
                    got += n_outputs
            if joined is not None:
                all_logits = joined[None]
            else:
                ptr = ll.llama_get_logits(self.ctx)
                all_logits = np.ctypeslib.as_array(ptr, shape=(n_seq_batch, n_out, n_vocab))
            self.eval_seconds += time.perf_counter() - t0
            for seq in range(n_seq_batch):
                s = start + seq * n_ctx
                yield i + seq, all_logits[seq, :n_score], tokens[s + first + 1 : s + n_ctx]


def tokenize(llama_cpp: Any, vocab: Any, data: bytes) -> np.ndarray:
    n_max = len(data) + 2
    buf = np.empty(n_max, np.int32)
    ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    n = llama_cpp.llama_tokenize(vocab, data, len(data), ptr, n_max, True, False)
    if n < 0:
        buf = np.empty(-n, np.int32)
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        n = llama_cpp.llama_tokenize(vocab, data, len(data), ptr, -n, True, False)
    if n < 0:
        raise EvalError("tokenization failed")
    return buf[:n].copy()


# -- log-softmax, as process_logits does it ---------------------------------


class LogSoftmax:
    """Row-wise log-sum-exp of float32 logits: max in float32, exp in float32,
    the sum in float64 (llama.cpp: expf, summed into a double). Reuses one
    scratch buffer so a chunk costs no allocation."""

    def __init__(self) -> None:
        self._buf: Optional[np.ndarray] = None
        # After lse(): exp(logit - row max) per entry, and its float64 row sums;
        # quant/kld.py sums subsets of it to get exact tail masses.
        self.exp: Optional[np.ndarray] = None
        self.sums: Optional[np.ndarray] = None

    def lse(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(max per row, log-sum-exp per row) in float64."""
        if self._buf is None or self._buf.shape[1] != logits.shape[1] or self._buf.shape[0] < logits.shape[0]:
            self._buf = np.empty(logits.shape, np.float32)
        buf = self._buf[: logits.shape[0]]
        m = logits.max(axis=1)
        np.subtract(logits, m[:, None], out=buf)
        np.exp(buf, out=buf)
        s = buf.sum(axis=1, dtype=np.float64)
        m64 = m.astype(np.float64)
        self.exp, self.sums, self.lse_rows = buf, s, m64 + np.log(s)
        return m64, self.lse_rows

    def nll(self, logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(NLL of each target, log-sum-exp per row)."""
        _, lse = self.lse(logits)
        picked = logits[np.arange(len(targets)), targets].astype(np.float64)
        return lse - picked, lse


def ppl_with_error(sum_nll: float, sum_nll2: float, count: int) -> tuple[float, float]:
    """llama-perplexity's final estimate: PPL and its ± (0 when the variance is not positive)."""
    if count == 0:
        return float("nan"), float("nan")
    nll = sum_nll / count
    var = sum_nll2 / count - nll * nll
    ppl = math.exp(nll)
    if var > 0 and count > 1:
        return ppl, math.sqrt(var / (count - 1)) * ppl
    return ppl, 0.0


# -- the public job ----------------------------------------------------------


@dataclass
class PerplexityResult:
    model: str
    path: str
    ppl: float
    ppl_err: float
    n_chunks: int
    n_tokens_scored: int
    n_tokens_evaluated: int
    tokens_per_second: float  # tokens evaluated (all chunk positions) per second of decode + scoring
    seconds: float
    corpus: str
    corpus_sha256: str
    ctx: int
    batch: int
    threads: int

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ppl"] = round(self.ppl, 6)
        d["ppl_err"] = round(self.ppl_err, 6)
        d["tokens_per_second"] = round(self.tokens_per_second, 2)
        d["seconds"] = round(self.seconds, 3)
        return d


# (chunk index, scored logits, targets, NLL per row, the LogSoftmax holding exp/sums/lse_rows)
ChunkHook = Callable[[int, np.ndarray, np.ndarray, np.ndarray, "LogSoftmax"], None]


def score(
    runner: LogitsRunner,
    tokens: np.ndarray,
    plan: ChunkPlan,
    *,
    task: str = "perplexity",
    on_chunk: Optional[ChunkHook] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> tuple[float, float, int, float]:
    """Run every chunk; return (sum NLL, sum NLL², count, seconds).

    `on_chunk(index, logits, targets, nll, softmax)` sees each chunk's scored
    logits while they are still llama.cpp's buffer (KLD hooks in here).
    """
    sm = LogSoftmax()
    sum_nll = sum_nll2 = 0.0
    count = 0
    t0 = time.perf_counter()
    on_progress(Progress(task, 0, plan.n_chunk, "chunk"))
    for idx, logits, targets in runner.chunks(tokens, plan, cancel=cancel):
        nll, _ = sm.nll(logits, targets)
        sum_nll += float(nll.sum())
        sum_nll2 += float(np.dot(nll, nll))
        count += len(nll)
        if on_chunk is not None:
            on_chunk(idx, logits, targets, nll, sm)
        done = idx + 1
        elapsed = time.perf_counter() - t0
        if done % plan.n_seq == 0 or done == plan.n_chunk:
            on_progress(
                Progress(
                    task,
                    done,
                    plan.n_chunk,
                    "chunk",
                    message=f"PPL {math.exp(sum_nll / count):.4f}  {done * plan.n_ctx / elapsed:.0f} tok/s",
                    rate=done / elapsed if elapsed > 0 else None,
                )
            )
    return sum_nll, sum_nll2, count, time.perf_counter() - t0


def perplexity(
    model: str | Path,
    scoring: Scoring,
    *,
    store: Any = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
    rpc_plan: Any = None,
) -> PerplexityResult:
    """PPL ± err of `model` (store name, catalog ref or path) on a text, as llama-perplexity reports it."""

    src = scoring.load_text()
    resolved = resolve(str(model), store=store)
    scoring.check()
    with scoring.runner(resolved.path, rpc_plan) as runner:
        tokens = runner.tokenize(src.data)
        plan = scoring.plan(len(tokens))
        s, s2, count, secs = score(runner, tokens, plan, on_progress=on_progress, cancel=cancel)
        ppl, err = ppl_with_error(s, s2, count)
        evaluated = plan.n_chunk * plan.n_ctx
        return PerplexityResult(
            model=resolved.label,
            path=str(resolved.path),
            ppl=ppl,
            ppl_err=err,
            n_chunks=plan.n_chunk,
            n_tokens_scored=count,
            n_tokens_evaluated=evaluated,
            tokens_per_second=evaluated / secs if secs > 0 else 0.0,
            seconds=secs,
            corpus=src.label,
            corpus_sha256=src.sha256,
            ctx=scoring.ctx,
            batch=plan.n_batch,
            threads=runner.threads,
        )


__all__ = [
    "Scoring",
    "PerplexityResult",
    "perplexity",
    "LogitsRunner",
    "ChunkPlan",
    "plan_chunks",
    "score",
    "LogSoftmax",
    "ppl_with_error",
]
