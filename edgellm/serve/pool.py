"""The models behind `edgellm serve`: an LRU pool, one batching engine and one fair queue per model.

A llama.cpp context is not thread-safe, so every model has exactly one worker
thread. It owns a `BatchEngine` (`edgellm.engine.batch`) with `parallel`
sequence slots in one context: while a slot is free, the oldest queued
request joins the running batch at the next decode step (FIFO: arrival
order); a finished or cancelled request leaves it and frees its slot. The
queue has a bound: a full queue is refused at once with 429 and a
Retry-After rather than left to pile up. At most `max_loaded` models are in
memory; a model that is needed while the pool is full evicts the least
recently used idle one. Loads wait in their own FIFO line, and a loaded model
with more work yields to a waiting one once its running requests are done,
so two models sharing one slot alternate instead of one starving the other.

The HTTP layer (`edgellm.serve.app`) never touches llama.cpp: it hands a `Job`
to `ModelPool.submit()` and reads the job's events, which the worker posts
through a callback (`("start", info)`, `("text", piece)`, `("end", stats)` or
`("error", ApiError)`). A job's `CancelToken` (a client that goes away, a
shutdown) frees its sequence at the next decode step.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from edgellm.engine.memory import DEFAULT_CTX
from edgellm.engine.runtime import Runtime, RuntimeOptions, default_threads
from edgellm.errors import EdgeLLMError, UsageError
from edgellm.serve.jobs import ApiError, Job, JobRequest, ModelSpec, client_gone, shutting_down
from edgellm.serve.prompts import logprob_hook, prepare

log = logging.getLogger(__name__)


def default_parallel() -> int:
    """Sequences decoded together per model: one per physical core, at least 4, at most 8.

    On a CPU a decode step reads the weights once for the whole batch, so even
    a two-core machine serves four clients with more total tokens/s than one.
    """

    return max(4, min(8, default_threads()))


@dataclass
class _Slot:
    spec: ModelSpec
    jobs: collections.deque[Job] = field(default_factory=collections.deque)
    runtime: Optional[Runtime] = None
    template: Any = None  # edgellm.chat.template.ChatTemplate of the loaded runtime
    engine: Any = None  # edgellm.engine.batch.BatchEngine on the runtime
    embedder: Any = None  # edgellm.engine.embed.Embedder, made at the first embeddings request
    running: set[Job] = field(default_factory=set)  # jobs seated in the engine
    admitting: int = 0
    loading: bool = False
    thread: Optional[threading.Thread] = None
    avg_job_seconds: float = 2.0  # moving average, for Retry-After
    served: int = 0
    embedded_inputs: int = 0
    embedded_tokens: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.running) or self.admitting > 0


class ModelPool:
    """Loaded runtimes (LRU, at most `max_loaded`) and one batching worker thread per model."""

    def __init__(
        self,
        *,
        max_loaded: int = 1,
        queue_size: int = 16,
        n_ctx: Optional[int] = None,
        n_threads: Optional[int] = None,
        runtime_options: Optional[RuntimeOptions] = None,
        parallel: Optional[int] = None,
    ) -> None:
        if max_loaded < 1 or queue_size < 1:
            raise ValueError("max_loaded and queue_size must be at least 1")
        self.max_loaded = max_loaded
        self.queue_size = queue_size
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.parallel = parallel or default_parallel()
        if n_ctx is not None and n_ctx // self.parallel < 64:
            raise UsageError(
                f"--ctx {n_ctx} leaves {n_ctx // self.parallel} tokens per request with --parallel {self.parallel}; "
                "raise --ctx or lower --parallel"
            )
        self.base_options = runtime_options or RuntimeOptions()
        self._cond = threading.Condition()
        self._slots: collections.OrderedDict[str, _Slot] = collections.OrderedDict()  # least recently used first
        self._load_line: collections.deque = collections.deque()
        self._closing = False
        self.finished: collections.Counter = collections.Counter()  # stop reasons, for /metrics
        if self.base_options.rpc:  # a lost RPC worker fails its requests with a 503, not the server
            from edgellm.serve import rpc_guard

            rpc_guard.attach(self, ApiError)

    # -- called from the HTTP side ---------------------------------------------

    def submit(self, spec: ModelSpec, job: Job) -> None:
        """Queue `job` for `spec`, or refuse it at once (429 when the queue is full)."""
        if self.base_options.rpc:
            from edgellm.serve import rpc_guard

            rpc_guard.check(self)
        with self._cond:
            if self._closing:
                raise shutting_down()
            slot = self._slots.get(spec.name)
            if slot is None:
                slot = self._slots[spec.name] = _Slot(spec)
            if len(slot.jobs) >= self.queue_size:
                waves = math.ceil((len(slot.jobs) + 1) / self.parallel)
                wait = max(1, math.ceil(slot.avg_job_seconds * waves))
                raise ApiError(
                    429,
                    f"the queue for model '{spec.name}' is full ({len(slot.jobs)} waiting); retry after {wait} s",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(wait)},
                )
            slot.jobs.append(job)
            if slot.thread is None:
                slot.thread = threading.Thread(target=self._worker, args=(slot,), name=f"edgellm-serve-{spec.name}", daemon=True)
                slot.thread.start()
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {
                name: {
                    "loaded": s.runtime is not None,
                    "busy": s.busy,
                    "queued": len(s.jobs),
                    "active": len(s.running),
                    "served": s.served,
                }
                for name, s in self._slots.items()
            }

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per loaded model: queue depth, active sequences, token counters, KV use (for GET /metrics)."""
        with self._cond:
            out = {}
            for name, s in self._slots.items():
                e = s.engine
                out[name] = {
                    "queued": len(s.jobs),
                    "active": len(s.running),
                    "slots": self.parallel,
                    "prompt_tokens": e.prompt_tokens if e else 0,
                    "cached_tokens": e.cached_tokens if e else 0,
                    "generated_tokens": e.generated_tokens if e else 0,
                    "cache_hits": e.cache_hits if e else 0,
                    "kv_used": e.kv_tokens() if e else 0,
                    "kv_cells": e.n_ctx if e else 0,
                    "embedded_inputs": s.embedded_inputs,
                    "embedded_tokens": s.embedded_tokens,
                    "draft_tokens": e.drafts.drafted if e else 0,
                    "draft_accepted": e.drafts.accepted if e else 0,
                    "draft_steps": e.drafts.steps if e else 0,
                    "draft_per_pos": list(e.drafts.per_pos) if e else [],
                }
            return out

    def loaded(self) -> list[str]:
        with self._cond:
            return [n for n, s in self._slots.items() if s.runtime is not None]

    def begin_shutdown(self) -> None:
        """Refuse new work, fail queued jobs, cancel the running ones (they stop at the next step)."""
        with self._cond:
            self._closing = True
            dropped: list[Job] = []
            for s in self._slots.values():
                dropped.extend(s.jobs)
                s.jobs.clear()
                for job in s.running:
                    job.cancel.cancel("the server is shutting down")
            self._cond.notify_all()
        for job in dropped:
            job.cancel.cancel("the server is shutting down")
            job.emit(("error", shutting_down()))

    def close(self, timeout: float = 15.0) -> None:
        """Stop the workers and free every runtime (after `begin_shutdown`)."""
        self.begin_shutdown()
        deadline = time.monotonic() + timeout
        with self._cond:
            threads = [s.thread for s in self._slots.values() if s.thread is not None]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            for s in self._slots.values():
                # A worker that did not stop in time may still be inside llama.cpp: never free under it.
                if s.runtime is not None and not (s.thread is not None and s.thread.is_alive()):
                    self._unload(s)

    # -- the worker ------------------------------------------------------------

    def _full(self) -> bool:
        return sum(1 for s in self._slots.values() if s.runtime is not None or s.loading) >= self.max_loaded

    def _may_take(self, slot: _Slot) -> bool:
        if not slot.jobs or len(slot.running) >= self.parallel:
            return False
        if slot.runtime is not None and self._load_line and self._load_line[0] is not slot and self._full():
            return False  # another model waits for memory: let it evict us before we start more work
        return True

    def _worker(self, slot: _Slot) -> None:
        while True:
            with self._cond:
                while not self._closing and not slot.running and not self._may_take(slot):
                    self._cond.wait()
                if self._closing and not slot.running:
                    return
                take: list[Job] = []
                while not self._closing and self._may_take(slot) and len(slot.running) + len(take) < self.parallel:
                    take.append(slot.jobs.popleft())
                slot.admitting = len(take)
            for job in take:
                self._admit(slot, job)
            with self._cond:
                slot.admitting = 0
            if slot.running:
                try:
                    slot.engine.step()
                except Exception as e:  # a failed decode fails the batch, not the server
                    log.exception("decode step on %s failed", slot.spec.name)
                    err = ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
                    for job in list(slot.running):
                        job.emit(("error", err))
                        self._done(slot, job, "error")
                    slot.engine.cancel_all()

    def _done(self, slot: _Slot, job: Job, reason: str) -> None:
        with self._cond:
            slot.running.discard(job)
            slot.served += 1
            self.finished[reason] += 1
            slot.avg_job_seconds = 0.7 * slot.avg_job_seconds + 0.3 * (time.perf_counter() - job.enqueued)
            if slot.spec.name in self._slots:
                self._slots.move_to_end(slot.spec.name)
            self._cond.notify_all()

    def _admit(self, slot: _Slot, job: Job) -> None:
        """Seat a job in the engine (loading the model first if needed), or answer it with its error."""
        from edgellm.engine.batch import Sequence  # lazy: loads jinja2, llama_cpp, numpy

        try:
            if job.cancel.cancelled:  # its client left while it waited: never run it
                raise client_gone()
            queue_s = time.perf_counter() - job.enqueued
            load_s = self._ensure_loaded(slot)
            rt = slot.runtime
            assert rt is not None
            info = {"queue_ms": queue_s * 1000.0, "load_ms": load_s * 1000.0}
            if job.request.kind == "embed":
                return self._embed(slot, job, info)
            tokens, sampling, plan = prepare(rt, slot.template, job.request, slot.engine.n_ctx_seq)
            job.emit(("start", {"prompt_tokens": len(tokens), "plan": plan, **info}))

            def emit(kind: str, value: Any, job: Job = job) -> None:
                job.emit((kind, value))
                if kind == "end":
                    self._done(slot, job, value.stop_reason)

            with self._cond:
                slot.running.add(job)
                if self._closing:  # begin_shutdown ran while this job was being prepared
                    job.cancel.cancel("the server is shutting down")
            slot.engine.add(Sequence(tokens, sampling, emit, cancel=job.cancel, on_token=logprob_hook(rt, job)))
            return
        except ApiError as e:
            err = e
        except EdgeLLMError as e:
            err = ApiError(500, str(e), type="server_error")
        except Exception as e:  # keep serving; the client gets a 500 and the log the traceback
            log.exception("request on %s failed", slot.spec.name)
            err = ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
        with self._cond:
            slot.running.add(job)
        job.emit(("error", err))
        self._done(slot, job, "error")

    def _embed(self, slot: _Slot, job: Job, info: dict[str, Any]) -> None:
        """Embed a request's inputs at once, between two decode steps of the running batch."""
        from edgellm.engine.embed import Embedder, InputTooLong  # lazy: llama_cpp

        rt = slot.runtime
        assert rt is not None
        if slot.embedder is None:
            slot.embedder = Embedder(rt, n_ctx=slot.engine.n_ctx_seq)
        inputs = []
        n_vocab = rt.llm.n_vocab()
        for i, x in enumerate(job.request.inputs or []):
            toks = rt.tokenize(x, add_bos=True, special=True) if isinstance(x, str) else list(x)
            if any(t < 0 or t >= n_vocab for t in toks):
                raise ApiError(400, f"input[{i}]: token ids must be in [0, {n_vocab})", param="input", code="invalid_value")
            inputs.append(toks)
        try:
            res = slot.embedder.embed(inputs)
        except InputTooLong as e:
            raise ApiError(
                400,
                f"This model's maximum context length for embeddings is {e.limit} tokens. However, input[{e.index}] "
                f"resulted in {e.n_tokens} tokens. Please shorten it.",
                param="input",
                code="context_length_exceeded",
            ) from None
        except UsageError as e:
            raise ApiError(400, str(e), param="input", code="invalid_value") from None
        with self._cond:
            slot.embedded_inputs += len(inputs)
            slot.embedded_tokens += res.prompt_tokens
            slot.running.add(job)
        job.emit(("start", {"prompt_tokens": res.prompt_tokens, **info}))
        job.emit(("embeddings", res))
        self._done(slot, job, "embed")

    def _unload(self, s: _Slot) -> None:
        if s.embedder is not None:
            s.embedder.close()
        if s.engine is not None:
            s.engine.close()
        if s.template is not None:
            s.template.close()
        if s.runtime is not None:
            s.runtime.close()
        s.runtime, s.template, s.engine, s.embedder = None, None, None, None

    def _ensure_loaded(self, slot: _Slot) -> float:
        """Load the slot's model if needed, evicting idle LRU models; returns the seconds spent loading."""
        victims: list[_Slot] = []
        with self._cond:
            if slot.runtime is not None:
                return 0.0
            self._load_line.append(slot)
            try:
                while True:
                    if self._closing:
                        raise shutting_down()
                    if self._load_line[0] is slot:
                        while self._full():
                            victim = next(
                                (s for s in self._slots.values() if s.runtime is not None and not s.busy and s is not slot), None
                            )
                            if victim is None:
                                break
                            log.info("unloading %s to make room for %s", victim.spec.name, slot.spec.name)
                            gone = _Slot(
                                victim.spec,
                                runtime=victim.runtime,
                                template=victim.template,
                                engine=victim.engine,
                                embedder=victim.embedder,
                            )
                            victims.append(gone)
                            victim.runtime, victim.template, victim.engine, victim.embedder = None, None, None, None
                        if not self._full():
                            break
                    self._cond.wait(0.5)
            finally:
                self._load_line.remove(slot)
                self._cond.notify_all()
            slot.loading = True
        t0 = time.perf_counter()
        try:
            for v in victims:
                self._unload(v)
            ctx = self.model_ctx(slot.spec)
            opts = replace(self.base_options, n_ctx=ctx, n_threads=self.n_threads or self.base_options.n_threads)
            loaded = Runtime(slot.spec.path, opts)
            try:
                from edgellm.chat.template import ChatTemplate
                from edgellm.engine.batch import BatchEngine

                # The GGUF's own chat template, rendered as `edgellm chat` renders it: sandboxed, in a
                # time-limited worker process (the template is code from a downloaded file).
                template = ChatTemplate.for_runtime(loaded, warn=log.warning)
                engine = BatchEngine(loaded, self.parallel)
            except BaseException:
                loaded.close()
                raise
            log.info("loaded %s in %.2f s (ctx %d, %d slots)", slot.spec.name, loaded.load_seconds, ctx, self.parallel)
            with self._cond:
                slot.runtime, slot.template, slot.engine = loaded, template, engine
        finally:
            with self._cond:
                slot.loading = False
                self._cond.notify_all()
        return time.perf_counter() - t0

    def model_ctx(self, spec: ModelSpec) -> int:
        """KV cells a model gets, shared by its slots (each request gets `model_ctx // parallel`), as llama-server's -c.

        Default: 1,024 per slot and at least DEFAULT_CTX in all, never more per slot than the model was trained for.
        """
        if self.n_ctx:
            return self.n_ctx
        total = max(DEFAULT_CTX, 1024 * self.parallel)
        if spec.context_length:
            total = min(total, spec.context_length * self.parallel)
        return total


__all__ = [
    "ApiError",
    "Job",
    "JobRequest",
    "ModelPool",
    "ModelSpec",
    "DEFAULT_CTX",
    "default_parallel",
    "client_gone",
    "shutting_down",
]
