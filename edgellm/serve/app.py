"""`edgellm serve`: the store over an OpenAI-compatible HTTP API.

Starlette + uvicorn (+ sse-starlette for streaming), not llama-cpp-python's
own server: that one loads models from its own settings file and drives
`Llama` directly, while this one must serve the edgellm store by name, go
through `Runtime` (KV reuse, cancel tokens, stats) and queue per model.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
`POST /v1/completions` (both with `stream: true` as OpenAI SSE chunks ending
in `data: [DONE]`), and `GET /health`. Requests are parsed and validated here;
models, queues and generation live in `edgellm.serve.pool`. Every failure is
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
import re
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from edgellm import __version__
from edgellm.errors import EdgeLLMError, UsageError
from edgellm.engine.runtime import GenerationStats, SamplingParams
from edgellm.serve.pool import ApiError, Job, JobRequest, ModelPool, ModelSpec, client_gone, shutting_down

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
_SAFE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+:-]{0,160}$")  # store names and catalog refs, never paths


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


# -- the model names clients may ask for -----------------------------------------


class _Models:
    def __init__(self, default_ref: Optional[str]) -> None:
        self.default: Optional[ModelSpec] = None
        if default_ref:
            from edgellm.gguf.reader import read_gguf
            from edgellm.models.resolve import resolve

            res = resolve(default_ref)
            info = read_gguf(res.path)  # a broken file fails now, in one line, not at the first request
            name = res.record.name if res.record else res.path.stem
            self.default = ModelSpec(name, res.path, info.context_length)

    def find(self, requested: Optional[str]) -> ModelSpec:
        if not requested:
            if self.default is None:
                raise ApiError(400, "you must give a model (this server has no default model)", param="model", code="model_required")
            return self.default
        if self.default is not None and requested == self.default.name:
            return self.default
        rec = None
        if _SAFE_REF.match(requested) and ".." not in requested:
            from edgellm.models.resolve import resolve
            from edgellm.models.store import Store

            rec = Store().find(requested)
            if rec is None:
                try:
                    rec = resolve(requested).record  # catalog refs: `name`, `name:level`
                except EdgeLLMError:
                    rec = None
        if rec is None or not rec.path.is_file():
            raise ApiError(404, f"The model '{requested}' does not exist in the edgellm store (see GET /v1/models)",
                           param="model", code="model_not_found")
        return ModelSpec(rec.name, rec.path, rec.context_length)

    def listing(self, loaded: list[str]) -> list[dict[str, Any]]:
        from edgellm.models.store import Store

        out = []
        for rec in Store().list():
            out.append(_model_obj(rec.name, int(rec.added), loaded, level=rec.level, size_bytes=rec.size_bytes,
                                  context_length=rec.context_length, architecture=rec.architecture))
        if self.default is not None and all(m["id"] != self.default.name for m in out):
            out.append(_model_obj(self.default.name, int(time.time()), loaded, context_length=self.default.context_length))
        return out


def _model_obj(name: str, created: int, loaded: list[str], **extra: Any) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "edgellm", "loaded": name in loaded, **extra}


# -- request parsing -----------------------------------------------------------


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(body: dict, key: str, lo: float, hi: float, *, integer: bool = False) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _bad(f"'{key}' must be {'an integer' if integer else 'a number'}", key, "invalid_type")
    if not lo <= v <= hi:
        raise _bad(f"'{key}' must be between {lo:g} and {hi:g}, not {v}", key, "invalid_value")
    return v


def _sampling(body: dict) -> tuple[SamplingParams, Optional[int]]:
    if body.get("n") not in (None, 1):
        raise _bad("only n=1 is supported", "n", "unsupported_value")
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo"):
        key = "echo" if body.get("echo") else "logprobs"
        raise _bad(f"'{key}' is not supported by this server", key, "unsupported_parameter")
    max_tokens = _number(body, "max_completion_tokens", 1, 1 << 31, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, 1 << 31, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    # presence/frequency penalties and logit_bias are accepted for compatibility and ignored.
    sp = SamplingParams(stop=[s for s in stop if s])
    for key, attr, lo, hi in (("temperature", "temperature", 0, 2), ("top_p", "top_p", 0, 1), ("min_p", "min_p", 0, 1),
                              ("repeat_penalty", "repeat_penalty", 0, 10)):
        v = _number(body, key, lo, hi)
        if v is not None:
            setattr(sp, attr, float(v))
    top_k = _number(body, "top_k", 0, 1 << 20, integer=True)
    if top_k is not None:
        sp.top_k = top_k
    sp.seed = _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    return sp, max_tokens


def _grammar(body: dict) -> Optional[str]:
    """GBNF for response_format: json_object → llama.cpp's JSON grammar; json_schema → from the schema."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'", "response_format", "invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if kind == "json_object":
        return JSON_GBNF
    if kind != "json_schema":
        raise _bad(f"unknown response_format type '{kind}' (expected text, json_object or json_schema)", "response_format", "invalid_value")
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be a JSON Schema object", "response_format", "invalid_schema")
    try:
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for

        validator_for(schema).check_schema(schema)
    except ImportError:  # the grammar converter below still refuses what it cannot read
        pass
    except SchemaError as e:
        raise _bad(f"invalid JSON schema in response_format: {e.message}", "response_format", "invalid_schema") from None
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises bare Exceptions/KeyErrors for constructs it cannot express
        raise _bad(f"this JSON schema cannot be turned into a grammar: {type(e).__name__}: {e}", "response_format", "invalid_schema") from None


def _content_text(content: Any, i: int) -> Optional[str]:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content", "unsupported_content")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content", "invalid_type")


def parse_chat(body: dict) -> JobRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    if body.get("tools") or body.get("functions"):
        raise _bad("tools and functions are not supported by this server", "tools", "unsupported_parameter")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]", "invalid_type")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}].role '{m['role']}' is not one of system, developer, user, assistant, tool", f"messages[{i}].role", "invalid_value")
        messages.append({"role": role, "content": _content_text(m.get("content"), i) or ""})
    sp, max_tokens = _sampling(body)
    return JobRequest("chat", messages=messages, sampling=sp, max_tokens=max_tokens, gbnf=_grammar(body))


def parse_completion(body: dict) -> JobRequest:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, list) and p and not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        raise _bad("'prompt' must be a string, a list with one string, or a list of token ids", "prompt", "invalid_type")
    if not isinstance(p, (str, list)) or (isinstance(p, list) and not p):
        raise _bad("'prompt' must be a string, a list with one string, or a list of token ids", "prompt", "invalid_type")
    if body.get("suffix"):
        raise _bad("'suffix' is not supported by this server", "suffix", "unsupported_parameter")
    sp, max_tokens = _sampling(body)
    return JobRequest("completion", prompt=p, sampling=sp, max_tokens=16 if max_tokens is None else max_tokens,
                      gbnf=_grammar(body))


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


def create_app(config: ServerConfig, *, pool: Optional[ModelPool] = None):
    """The Starlette app; `app.state.pool` holds the models."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.routing import Route

    models = _Models(config.default_model)
    pool = pool or ModelPool(max_loaded=config.max_loaded, queue_size=config.queue_size,
                             n_ctx=config.n_ctx, n_threads=config.n_threads)
    fingerprint = f"edgellm-{__version__}"

    def check_auth(request: Request) -> None:
        if not config.api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY'.", code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
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
        ],
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
    import uvicorn

    import sse_starlette.sse  # noqa: F401  (hooks uvicorn's exit handler so open streams end on shutdown)

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


__all__ = ["ServerConfig", "create_app", "serve", "open_socket", "bind_warning", "is_loopback", "parse_chat", "parse_completion"]
