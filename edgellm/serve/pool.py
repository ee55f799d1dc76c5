"""The models behind `edgellm serve`: an LRU pool with one fair queue per model.

A llama.cpp context is not thread-safe, so every model has exactly one worker
thread that runs its requests one at a time, in arrival order (a FIFO deque
with a bound: a full queue is refused at once with 429 rather than left to
pile up). At most `max_loaded` models are in memory; a model that is needed
while the pool is full evicts the least recently used idle one. Loads wait in
their own FIFO line, and a loaded model with more work yields to a waiting
one after its current request, so two models sharing one slot alternate
instead of one starving the other.

The HTTP layer (`edgellm.serve.app`) never touches llama.cpp: it hands a `Job`
to `ModelPool.submit()` and reads the job's events, which the worker posts
through a callback (`("start", info)`, `("text", piece)`, `("end", stats)` or
`("error", ApiError)`). Generation goes through `Runtime.stream` with the
job's `CancelToken`, which is how a client that goes away or a shutdown stops
a request after its current token.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Union

from edgellm.errors import EdgeLLMError
from edgellm.progress import CancelToken
from edgellm.engine.runtime import GenerationStats, Runtime, RuntimeOptions, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_CTX = 4096  # when --ctx is not given: the model's own length, capped here to keep the KV cache small


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, type: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or self.TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code="server_shutting_down")


def client_gone() -> ApiError:
    return ApiError(499, "the request was cancelled before it ran (the client went away)", type="invalid_request_error", code="request_cancelled")


@dataclass(frozen=True)
class ModelSpec:
    """A store model the server may load."""

    name: str
    path: Path
    context_length: int = 0


@dataclass
class JobRequest:
    """One completion to run: what the HTTP layer parsed and validated."""

    kind: str  # "chat" or "completion"
    messages: Optional[list[dict[str, Any]]] = None
    prompt: Union[str, list[int], None] = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: Optional[int] = None  # None: the rest of the context
    gbnf: Optional[str] = None  # a grammar from response_format


class Job:
    def __init__(self, request: JobRequest, emit: Callable[[tuple[str, Any]], None]) -> None:
        self.request = request
        self.emit = emit
        self.cancel = CancelToken()
        self.enqueued = time.perf_counter()


@dataclass
class _Slot:
    spec: ModelSpec
    jobs: collections.deque = field(default_factory=collections.deque)
    runtime: Optional[Runtime] = None
    template: Any = None  # edgellm.chat.template.ChatTemplate of the loaded runtime
    busy: bool = False
    loading: bool = False
    current: Optional[Job] = None
    thread: Optional[threading.Thread] = None
    avg_job_seconds: float = 2.0  # moving average, for Retry-After
    served: int = 0


class ModelPool:
    """Loaded runtimes (LRU, at most `max_loaded`) and one worker thread per model."""

    def __init__(self, *, max_loaded: int = 1, queue_size: int = 16, n_ctx: Optional[int] = None,
                 n_threads: Optional[int] = None, runtime_options: Optional[RuntimeOptions] = None) -> None:
        if max_loaded < 1 or queue_size < 1:
            raise ValueError("max_loaded and queue_size must be at least 1")
        self.max_loaded = max_loaded
        self.queue_size = queue_size
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.base_options = runtime_options or RuntimeOptions()
        self._cond = threading.Condition()
        self._slots: "collections.OrderedDict[str, _Slot]" = collections.OrderedDict()  # least recently used first
        self._load_line: collections.deque = collections.deque()
        self._closing = False

    # -- called from the HTTP side ---------------------------------------------

    def submit(self, spec: ModelSpec, job: Job) -> None:
        """Queue `job` for `spec`, or refuse it at once (429 when the queue is full)."""
        with self._cond:
            if self._closing:
                raise shutting_down()
            slot = self._slots.get(spec.name)
            if slot is None:
                slot = self._slots[spec.name] = _Slot(spec)
            if len(slot.jobs) >= self.queue_size:
                wait = max(1, math.ceil(slot.avg_job_seconds * (len(slot.jobs) + 1)))
                raise ApiError(
                    429, f"the queue for model '{spec.name}' is full ({len(slot.jobs)} waiting); retry after {wait} s",
                    code="rate_limit_exceeded", headers={"Retry-After": str(wait)},
                )
            slot.jobs.append(job)
            if slot.thread is None:
                slot.thread = threading.Thread(target=self._worker, args=(slot,), name=f"edgellm-serve-{spec.name}", daemon=True)
                slot.thread.start()
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {
                name: {"loaded": s.runtime is not None, "busy": s.busy, "queued": len(s.jobs), "served": s.served}
                for name, s in self._slots.items()
            }

    def loaded(self) -> list[str]:
        with self._cond:
            return [n for n, s in self._slots.items() if s.runtime is not None]

    def begin_shutdown(self) -> None:
        """Refuse new work, fail queued jobs, cancel the running ones (they stop after their current token)."""
        with self._cond:
            self._closing = True
            dropped = []
            for s in self._slots.values():
                dropped.extend(s.jobs)
                s.jobs.clear()
                if s.current is not None:
                    s.current.cancel.cancel("the server is shutting down")
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
                    s.template.close()
                    s.runtime.close()
                    s.runtime, s.template = None, None

    # -- the worker ------------------------------------------------------------

    def _full(self) -> bool:
        return sum(1 for s in self._slots.values() if s.runtime is not None or s.loading) >= self.max_loaded

    def _may_take(self, slot: _Slot) -> bool:
        if not slot.jobs:
            return False
        if slot.runtime is not None and self._load_line and self._load_line[0] is not slot and self._full():
            return False  # another model waits for memory: let it evict us before we start more work
        return True

    def _worker(self, slot: _Slot) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._may_take(slot):
                    self._cond.wait()
                if self._closing:
                    return
                job = slot.jobs.popleft()
                slot.busy, slot.current = True, job
            t0 = time.perf_counter()
            try:
                if job.cancel.cancelled:  # its client left while it waited: never run it
                    job.emit(("error", client_gone()))
                    continue
                self._run(slot, job)
            except ApiError as e:
                job.emit(("error", e))
            except EdgeLLMError as e:
                job.emit(("error", ApiError(500, str(e), type="server_error")))
            except Exception as e:  # keep serving; the client gets a 500 and the log the traceback
                log.exception("request on %s failed", slot.spec.name)
                job.emit(("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")))
            finally:
                with self._cond:
                    slot.busy, slot.current = False, None
                    slot.served += 1
                    slot.avg_job_seconds = 0.7 * slot.avg_job_seconds + 0.3 * (time.perf_counter() - t0)
                    if slot.spec.name in self._slots:
                        self._slots.move_to_end(slot.spec.name)
                    self._cond.notify_all()

    def _ensure_loaded(self, slot: _Slot) -> float:
        """Load the slot's model if needed, evicting idle LRU models; returns the seconds spent loading."""
        victims: list[tuple[Runtime, Any]] = []
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
                            victim = next((s for s in self._slots.values()
                                           if s.runtime is not None and not s.busy and s is not slot), None)
                            if victim is None:
                                break
                            log.info("unloading %s to make room for %s", victim.spec.name, slot.spec.name)
                            victims.append((victim.runtime, victim.template))
                            victim.runtime, victim.template = None, None
                        if not self._full():
                            break
                    self._cond.wait(0.5)
            finally:
                self._load_line.remove(slot)
                self._cond.notify_all()
            slot.loading = True
        t0 = time.perf_counter()
        rt = template = None
        try:
            for v, tmpl in victims:
                tmpl.close()
                v.close()
            ctx = self.n_ctx or min(DEFAULT_CTX, slot.spec.context_length or DEFAULT_CTX)
            opts = replace(self.base_options, n_ctx=ctx, n_threads=self.n_threads or self.base_options.n_threads)
            loaded = Runtime(slot.spec.path, opts)
            try:
                template = _chat_template(loaded)
            except BaseException:
                loaded.close()
                raise
            rt = loaded
            log.info("loaded %s in %.2f s (ctx %d)", slot.spec.name, rt.load_seconds, ctx)
        finally:
            with self._cond:
                slot.loading = False
                if rt is not None:
                    slot.runtime, slot.template = rt, template
                self._cond.notify_all()
        return time.perf_counter() - t0

    def _run(self, slot: _Slot, job: Job) -> None:
        req = job.request
        queue_s = time.perf_counter() - job.enqueued
        load_s = self._ensure_loaded(slot)
        rt = slot.runtime
        assert rt is not None
        tokens, param = _prompt_tokens(rt, slot.template, req)
        n_ctx, n_prompt = rt.n_ctx, len(tokens)
        if n_prompt >= n_ctx:
            raise ApiError(400, f"This model's maximum context length is {n_ctx} tokens. However, your "
                           f"{'messages' if param == 'messages' else 'prompt'} resulted in {n_prompt} tokens. "
                           "Please shorten it (or start the server with a larger --ctx).",
                           param=param, code="context_length_exceeded")
        if req.max_tokens is not None and n_prompt + req.max_tokens > n_ctx:
            raise ApiError(400, f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                           f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the {param}, {req.max_tokens} in the "
                           "completion). Please reduce the length of the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        sampling = replace(req.sampling, max_tokens=req.max_tokens or (n_ctx - n_prompt))
        if req.kind == "chat" and slot.template.stop_strings:  # the fallback template's turn marker
            sampling.stop = list(sampling.stop) + slot.template.stop_strings
        if req.gbnf:
            sampling.grammar = _compile_grammar(rt, req.gbnf)
        job.emit(("start", {"prompt_tokens": n_prompt, "queue_ms": queue_s * 1000.0, "load_ms": load_s * 1000.0}))
        stats = GenerationStats()
        for piece in rt.stream(tokens, sampling, cancel=job.cancel, stats=stats):
            job.emit(("text", piece))
        job.emit(("end", stats))


# -- prompts -------------------------------------------------------------------


def _chat_template(rt: Runtime) -> Any:
    """The GGUF's own chat template, rendered as `edgellm chat` renders it: sandboxed, in a
    time-limited worker process (the template is code from a downloaded file)."""
    from edgellm.chat.template import ChatTemplate

    return ChatTemplate.for_runtime(rt, warn=log.warning)


def _prompt_tokens(rt: Runtime, template: Any, req: JobRequest) -> tuple[list[int], str]:
    if req.kind == "chat":
        try:
            text = template.render(req.messages, add_generation_prompt=True)
        except Exception as e:  # raise_exception() in the template, a Jinja error, or a render over its time limit
            raise ApiError(400, f"the model's chat template refused these messages: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                           param="messages", code="invalid_messages") from None
        # As in edgellm.chat.session: when the vocab adds BOS and the template also wrote it, keep one BOS token.
        add_bos = rt.add_bos
        bos_text = rt.token_text(rt.token_bos()) if add_bos else ""
        if bos_text and text.startswith(bos_text):
            text = text[len(bos_text):]
        return rt.tokenize(text, add_bos=add_bos, special=True), "messages"
    if isinstance(req.prompt, list):
        n_vocab = rt.llm.n_vocab()
        if not req.prompt or any(t < 0 or t >= n_vocab for t in req.prompt):
            raise ApiError(400, f"prompt token ids must be non-empty and in [0, {n_vocab})", param="prompt")
        return list(req.prompt), "prompt"
    return rt.tokenize(req.prompt or "", add_bos=True, special=True), "prompt"


def _compile_grammar(rt: Runtime, gbnf: str) -> Any:
    """A LlamaGrammar, after proving llama.cpp parses it (a NULL sampler would crash generation)."""
    import llama_cpp
    from llama_cpp.llama_grammar import LlamaGrammar

    ptr = llama_cpp.llama_sampler_init_grammar(rt.llm._model.vocab, gbnf.encode("utf-8"), b"root")
    if not ptr:
        raise ApiError(400, "llama.cpp could not compile the grammar made from response_format",
                       param="response_format", code="invalid_schema")
    llama_cpp.llama_sampler_free(ptr)
    return LlamaGrammar.from_string(gbnf)


__all__ = ["ApiError", "Job", "JobRequest", "ModelPool", "ModelSpec", "DEFAULT_CTX"]
