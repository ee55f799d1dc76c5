"""What every route of `edgellm serve` shares: the body reader (size and nesting limits), the
key check, a job's events read on the event loop, and the usage and timings of a reply.

The OpenAI routes (`openai_routes`) and Ollama's (`ollama_routes`) are two doors onto the
same pool; they differ only in the shapes they read and write.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from edgellm.engine.runtime import GenerationStats
from edgellm.errors import one_line
from edgellm.serve import tools
from edgellm.serve.jobs import ApiError, Job, JobRequest, ModelSpec, client_gone, shutting_down
from edgellm.serve.requests import _bad

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 128  # JSON nesting a body may have: deeper bodies would recurse in the checks after parsing

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass
class ServeContext:
    """The state the routes share: the config, the pool, the model names and the metrics."""

    config: Any
    pool: Any
    models: Any
    metrics: Any
    fingerprint: str

    def check_auth(self, request: Any) -> None:
        key = self.config.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY'.", code="invalid_api_key")


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a parsed JSON value, walked without recursion, stopping past `limit`."""
    depth, stack = 0, [(value, 1)]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        if depth > limit:
            return depth
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node if isinstance(v, (dict, list)))
    return depth


async def read_json(request: Any) -> dict:
    """The body as a JSON object, or a 4xx: too large (413), not JSON, not an object, nested too deeply (400)."""
    # Read at most MAX_BODY_BYTES; past that, read on without keeping it (up to 8x) so that the
    # client, still sending, gets the 413 instead of a reset connection.
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            parts.append(chunk)
        elif size > 8 * MAX_BODY_BYTES:
            break
    if size > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
    raw = b"".join(parts)
    try:
        body = json.loads(raw)
    except RecursionError:  # Python's parser recurses per level: 200,000 '[' exhaust the stack
        raise _bad(f"the JSON body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)", None, "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"We could not parse the JSON body of your request: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_json")
    if json_depth(body) > MAX_JSON_DEPTH:
        raise _bad(f"the JSON body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)", None, "invalid_json")
    if body.get("model") is not None and not isinstance(body.get("model"), str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    return body


def json_response(obj: Any, status: int = 200, headers: Optional[dict[str, str]] = None):
    from starlette.responses import JSONResponse  # lazy: the server extra

    return JSONResponse(obj, status_code=status, headers=headers)


def usage_and_timings(start: dict[str, Any], st: GenerationStats) -> tuple[dict[str, Any], dict[str, Any]]:
    usage = {
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.generated_tokens,
        "total_tokens": st.prompt_tokens + st.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": st.reused_tokens},
    }
    timings = {  # llama.cpp server's names, plus the time queued and loading
        "queue_ms": round(start["queue_ms"], 3),
        "load_ms": round(start["load_ms"], 3),
        "cache_n": st.reused_tokens,
        "prompt_n": st.evaluated_prompt_tokens,
        "prompt_ms": round(st.prompt_seconds * 1000, 3),
        "prompt_per_second": round(st.prompt_tokens_per_second, 3),
        "predicted_n": st.generated_tokens,
        "predicted_ms": round(st.generation_seconds * 1000, 3),
        "predicted_per_second": round(st.tokens_per_second, 3),
    }
    if st.draft != "off":  # llama-server adds these when it speculates
        timings["draft_n"] = st.draft_tokens
        timings["draft_n_accepted"] = st.draft_accepted
    return usage, timings


class Reply:
    """The events of one job, posted by the model's worker thread and read on the event loop.

    Waking the event loop is a context switch onto a core that llama.cpp's
    threads are decoding on, and its SSE frame and socket write stall both
    of them at their next barrier (a busy core costs more than its share).
    So an event posted while a wake-up is still pending rides along with it;
    a streamed reply's text wakes the loop at once for its first piece and
    then at most every FLUSH_S (the pieces between ride on the next wake-up,
    merged into one chunk: a few tokens per frame, as a reader at 20 Hz
    cannot tell apart); and a reply that is not streamed is woken only by the
    events its reader waits for (start, end, error, embeddings).
    """

    WAKE = frozenset({"start", "end", "error", "embeddings"})
    FLUSH_S = 0.05

    def __init__(self, loop: asyncio.AbstractEventLoop, *, stream: bool = True) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.stream = stream
        self._lock = threading.Lock()
        self._buffer: list[tuple[str, Any]] = []
        self._pending = False
        self._text_woke = 0.0  # when text last woke the loop; 0: never

    def emit(self, event: tuple[str, Any]) -> None:  # called from a worker thread
        with self._lock:
            self._buffer.append(event)
            if self._pending:
                return
            if event[0] not in self.WAKE:
                if not self.stream:
                    return
                now = time.perf_counter()
                if now - self._text_woke < self.FLUSH_S:
                    return
                self._text_woke = now
            self._pending = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    def _drain(self) -> None:
        with self._lock:
            events, self._buffer, self._pending = self._buffer, [], False
        for event in merge_text(events):
            self.queue.put_nowait(event)


def merge_text(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Each run of consecutive text pieces as one piece, the run's logprobs before it: the routes attach
    the logprobs they hold to the next text they send, so the chunk carries every token it spells."""
    out: list[tuple[str, Any]] = []
    text: list[str] = []
    lps: list[tuple[str, Any]] = []

    def close() -> None:
        out.extend(lps)
        if text:
            out.append(("text", "".join(text)))
        text.clear()
        lps.clear()

    for ev in events:
        if ev[0] == "text":
            text.append(ev[1])
        elif ev[0] == "logprob":
            lps.append(ev)
        else:
            close()
            out.append(ev)
    close()
    return out


async def _cancel_on_disconnect(request: Any, job: Job, reply: Reply) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel.cancel("the client went away")
            reply.queue.put_nowait(("error", client_gone()))  # stop waiting for a job that may never report
            return


@dataclass
class Running:
    """A submitted job whose "start" event has come: read the rest with `events()` or `collect()`."""

    job: Job
    reply: Reply
    start: dict[str, Any]
    watcher: Any

    async def events(self):
        """("text", str), ("logprob", TokenLogprob), ("embeddings", Embeddings) ..., then ("end", GenerationStats) last."""
        try:
            while True:
                ev, val = await self.reply.queue.get()
                if ev == "error":
                    raise val
                yield ev, val
                if ev in ("end", "embeddings"):
                    return
        finally:
            self.job.cancel.cancel("the client went away")  # a no-op once generation is over
            self.watcher.cancel()

    async def collect(self) -> Collected:
        out = Collected()
        async for ev, val in self.events():
            if ev == "text":
                out.text.append(val)
            elif ev == "logprob":
                out.logprobs.append(val)
            elif ev == "embeddings":
                out.embeddings = val
            else:
                out.stats = val
        if out.stats is not None and out.stats.stop_reason == "cancelled":
            raise shutting_down()
        return out


@dataclass
class Collected:
    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    stats: Optional[GenerationStats] = None
    embeddings: Any = None


async def submit(ctx: ServeContext, request: Any, spec: ModelSpec, req: JobRequest, *, stream: bool = False) -> Running:
    """Queue `req` for `spec` and wait for its start; a client that hangs up before then cancels it."""
    if req.tools is not None:
        # The grammar of big schemas takes a while to build: off the event loop, so other streams keep flowing.
        try:
            req.tool_plan = await asyncio.to_thread(tools.plan, req.tools, req.messages or [], ctx.models.template_source(spec))
        except Exception as e:  # the schema converter raises assorted types for features it lacks
            raise _bad(f"cannot turn the tools' schemas into a grammar: {one_line(e)}"[:300], "tools", "invalid_schema") from None
    reply = Reply(asyncio.get_running_loop(), stream=stream)
    job = Job(req, reply.emit)
    ctx.pool.submit(spec, job)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job, reply))
    try:
        kind, start = await reply.queue.get()
        if kind == "error":
            raise start
    except BaseException:
        job.cancel.cancel("the client went away")
        watcher.cancel()
        raise
    if stream:
        watcher.cancel()  # the streaming response watches the connection from here on
    return Running(job, reply, start, watcher)


__all__ = [
    "ServeContext",
    "read_json",
    "json_response",
    "usage_and_timings",
    "Reply",
    "Running",
    "Collected",
    "submit",
    "FINISH",
    "MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "json_depth",
]
