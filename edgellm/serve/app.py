"""`edgellm serve`: the store over an OpenAI-compatible HTTP API.

Starlette + uvicorn (+ sse-starlette for streaming), not llama-cpp-python's
own server: that one loads models from its own settings file and drives
`Llama` directly, while this one serves the edgellm store by name and
decodes concurrent requests together in one batch per model.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
`POST /v1/completions` (both with `stream: true` as OpenAI SSE chunks ending
in `data: [DONE]`), `GET /health` and `GET /metrics` (Prometheus). Requests
are parsed and validated in `edgellm.serve.requests`; models, queues and
batched generation live in `edgellm.serve.pool`. Every failure is
an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with a
4xx/5xx status, and the server keeps serving.

Starlette, uvicorn and sse-starlette are imported only when a server is made,
so the CLI stays fast.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from edgellm import __version__
from edgellm.engine.runtime import KV_BYTES_PER_ELEMENT, GenerationStats, RuntimeOptions
from edgellm.errors import UsageError
from edgellm.fsutil import human_size
from edgellm.serve.metrics import CountStatus, Metrics
from edgellm.serve.pool import ApiError, Job, ModelPool, client_gone, shutting_down
from edgellm.serve.requests import _bad, _Models, parse_chat, parse_completion

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass
class ServerConfig:
    default_model: Optional[str] = None  # a store name, catalog ref or GGUF path (the operator's choice)
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None
    max_loaded: int = 1
    queue_size: int = 16  # waiting requests per model, besides the one running
    n_ctx: Optional[int] = None
    n_threads: Optional[int] = None
    access_log: bool = False
    parallel: Optional[int] = None  # sequences decoded together per model (None: pool.default_parallel())
    rpc: Optional[str] = None  # llama.cpp RPC workers HOST:PORT[,...] every model is split across (edgellm.serve.rpc_guard)
    rpc_split: Optional[str] = None


def _rpc_options(config: ServerConfig) -> Any:
    if not config.rpc:
        return None

    return RuntimeOptions(rpc=config.rpc, rpc_split=config.rpc_split)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_warning(host: str, api_key: Optional[str]) -> Optional[str]:
    """The warning printed when the server is reachable from other machines without a key."""
    if is_loopback(host) or api_key:
        return None
    return (f"serving on {host} without --api-key: anyone who can reach this port can use your models; "
            "pass --api-key KEY (or bind 127.0.0.1)")


# -- responses -----------------------------------------------------------------

_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def usage_and_timings(start: dict[str, Any], st: GenerationStats) -> tuple[dict[str, Any], dict[str, Any]]:
    usage = {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.generated_tokens,
             "total_tokens": st.prompt_tokens + st.generated_tokens,
             "prompt_tokens_details": {"cached_tokens": st.reused_tokens}}
    timings = {  # llama.cpp server's names, plus the time queued and loading
        "queue_ms": round(start["queue_ms"], 3), "load_ms": round(start["load_ms"], 3),
        "cache_n": st.reused_tokens, "prompt_n": st.evaluated_prompt_tokens,
        "prompt_ms": round(st.prompt_seconds * 1000, 3), "prompt_per_second": round(st.prompt_tokens_per_second, 3),
        "predicted_n": st.generated_tokens, "predicted_ms": round(st.generation_seconds * 1000, 3),
        "predicted_per_second": round(st.tokens_per_second, 3),
    }
    return usage, timings


class _Reply:
    """The events of one job, read on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop

    def emit(self, event: tuple[str, Any]) -> None:  # called from a worker thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass


async def _cancel_on_disconnect(request: Any, job: Job, reply: _Reply) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel.cancel("the client went away")
            reply.queue.put_nowait(("error", client_gone()))  # stop waiting for a job that may never report
            return


def _json_response(obj: Any, status: int = 200, headers: Optional[dict[str, str]] = None):
    from starlette.responses import JSONResponse

    return JSONResponse(obj, status_code=status, headers=headers)


def _error_response(e: ApiError):
    return _json_response(e.body(), e.status, e.headers)


# long: the routes are closures sharing the config, the pool, the model names and the metrics.
def create_app(config: ServerConfig, *, pool: Optional[ModelPool] = None):
    """The Starlette app; `app.state.pool` holds the models."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.routing import Route

    models = _Models(config.default_model)
    from starlette.middleware import Middleware
    from starlette.responses import PlainTextResponse

    pool = pool or ModelPool(max_loaded=config.max_loaded, queue_size=config.queue_size,
                             n_ctx=config.n_ctx, n_threads=config.n_threads, parallel=config.parallel,
                             runtime_options=_rpc_options(config))
    metrics = Metrics()
    fingerprint = f"edgellm-{__version__}"

    def check_auth(request: Request) -> None:
        if not config.api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY'.", code="invalid_api_key")

    async def read_json(request: Request) -> dict:
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
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"We could not parse the JSON body of your request: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_json")
        if body.get("model") is not None and not isinstance(body.get("model"), str):
            raise _bad("'model' must be a string", "model", "invalid_type")
        return body

    async def list_models(request: Request):
        check_auth(request)
        return _json_response({"object": "list", "data": models.listing(pool.loaded())})

    async def get_model(request: Request):
        check_auth(request)
        mid = request.path_params["model"]
        for m in models.listing(pool.loaded()):
            if m["id"] == mid:
                return _json_response(m)
        raise ApiError(404, f"The model '{mid}' does not exist in the edgellm store", param="model", code="model_not_found")

    async def get_metrics(request: Request):
        check_auth(request)
        return PlainTextResponse(metrics.render(pool), media_type="text/plain; version=0.0.4")

    async def health(request: Request):
        return _json_response({"status": "ok", "models": pool.status()})

    async def completions(request: Request, kind: str):
        check_auth(request)
        body = await read_json(request)
        req = parse_chat(body) if kind == "chat" else parse_completion(body)
        spec = models.find(body.get("model"))
        stream = bool(body.get("stream"))
        opts = body.get("stream_options")
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        reply = _Reply(asyncio.get_running_loop())
        job = Job(req, reply.emit)
        pool.submit(spec, job)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        # Until a response is under way, a client that hangs up cancels its job (queued or running).
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job, reply))
        try:
            kind0, start = await reply.queue.get()
            if kind0 == "error":
                raise start
            if stream:
                watcher.cancel()  # sse-starlette watches the connection from here on
                return _sse(reply, job, start, kind, rid, created, spec.name, fingerprint, include_usage)
            text = []
            while True:
                ev, val = await reply.queue.get()
                if ev == "text":
                    text.append(val)
                elif ev == "error":
                    raise val
                else:
                    stats = val
                    break
        except BaseException:
            job.cancel.cancel("the client went away")
            raise
        finally:
            watcher.cancel()
        if stats.stop_reason == "cancelled":
            raise shutting_down()
        usage, timings = usage_and_timings(start, stats)
        content = "".join(text)
        finish = _FINISH.get(stats.stop_reason, "stop")
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": finish}
                  if kind == "chat" else {"index": 0, "text": content, "logprobs": None, "finish_reason": finish})
        return _json_response({"id": rid, "object": obj, "created": created, "model": spec.name,
                               "system_fingerprint": fingerprint, "choices": [choice], "usage": usage, "timings": timings})

    async def chat_route(request: Request):
        return await completions(request, "chat")

    async def completion_route(request: Request):
        return await completions(request, "completion")

    async def on_api_error(request: Request, exc: Exception):
        return _error_response(exc)  # type: ignore[arg-type]

    async def on_http_error(request: Request, exc: Exception):
        status = getattr(exc, "status_code", 500)
        msg = "Not found: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions" if status == 404 else str(getattr(exc, "detail", exc))
        return _error_response(ApiError(status, msg, code="not_found" if status == 404 else None))

    async def on_crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, pool.close)

    app = Starlette(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/v1/chat/completions", chat_route, methods=["POST"]),
            Route("/v1/completions", completion_route, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", get_metrics, methods=["GET"]),
        ],
        middleware=[Middleware(CountStatus, metrics=metrics)],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash},
        lifespan=lifespan,
    )
    app.state.pool = pool
    app.state.models = models
    return app


def _sse(reply: _Reply, job: Job, start: dict, kind: str, rid: str, created: int, model: str, fingerprint: str, include_usage: bool):
    from sse_starlette.sse import EventSourceResponse

    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(piece: Optional[str], finish: Optional[str] = None, *, first: bool = False, **extra: Any) -> dict:
        if kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else ({} if piece is None else {"content": piece})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                    "system_fingerprint": fingerprint, "choices": [choice], **extra})}

    async def events():
        try:
            if kind == "chat":
                yield chunk(None, first=True)
            while True:
                ev, val = await reply.queue.get()
                if ev == "text":
                    yield chunk(val)
                    continue
                if ev == "error":
                    yield {"data": json.dumps(val.body())}
                    return
                if val.stop_reason == "cancelled":
                    yield {"data": json.dumps(shutting_down().body())}
                    return
                usage, timings = usage_and_timings(start, val)
                # usage and timings ride on the last chunk always; the separate usage chunk is OpenAI's opt-in.
                yield chunk(None, _FINISH.get(val.stop_reason, "stop"), usage=usage, timings=timings)
                if include_usage:
                    yield {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                               "system_fingerprint": fingerprint, "choices": [], "usage": usage})}
                yield {"data": "[DONE]"}
                return
        finally:
            job.cancel.cancel("the client went away")  # a no-op once generation is over

    return EventSourceResponse(events(), sep="\n", ping=15, shutdown_grace_period=2.0)


# -- running -----------------------------------------------------------------


def open_socket(host: str, port: int) -> socket.socket:
    """Bind before starting uvicorn, so a busy port is a one-line error and `--port 0` can report its port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"cannot resolve --host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(config: ServerConfig, *, on_ready: Callable[[str, Any], None] = lambda url, app: None) -> None:
    """Run until SIGINT/SIGTERM, then refuse new work, cancel in-flight generation and free the models."""
    import sse_starlette.sse  # noqa: F401  (hooks uvicorn's exit handler so open streams end on shutdown)
    import uvicorn

    app = create_app(config)
    sock = open_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Runs in a signal handler: never take the pool's lock here, hand the work to a thread.
            threading.Thread(target=app.state.pool.begin_shutdown, name="edgellm-serve-stop", daemon=True).start()
            super().handle_exit(sig, frame)

    uconfig = uvicorn.Config(app, log_level="info" if config.access_log else "warning", access_log=config.access_log,
                             lifespan="on", timeout_graceful_shutdown=10, log_config=None)
    server = _Server(uconfig)
    on_ready(url, app)
    # uvicorn re-raises the signal it caught once it has stopped; no-op handlers make that a clean exit.
    main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        sock.close()
        app.state.pool.close(timeout=5)




def describe(app: Any) -> str:
    """The start banner's second line: what is served, the parallel slots and the KV memory they share."""

    pool, default = app.state.pool, app.state.models.default
    line = f"{pool.parallel} parallel slots per model"
    if default is not None:
        from edgellm.gguf.reader import read_gguf

        ctx = pool.model_ctx(default)
        kv = read_gguf(default.path).kv_cache_bytes(ctx, bytes_per_elem=KV_BYTES_PER_ELEMENT[pool.base_options.kv_type])
        line += (f"; {default.name}: {ctx} KV cells, {human_size(kv)} of KV cache ({pool.base_options.kv_type}), "
                 f"up to {ctx // pool.parallel} tokens per request")
    return "edgellm serve: " + line


__all__ = ["ServerConfig", "create_app", "serve", "open_socket", "bind_warning", "is_loopback", "parse_chat", "parse_completion", "describe"]
