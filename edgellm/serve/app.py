"""`edgellm serve`: the store over an OpenAI-compatible HTTP API.

Starlette + uvicorn (+ sse-starlette for streaming), not llama-cpp-python's
own server: that one loads models from its own settings file and drives
`Llama` directly, while this one serves the edgellm store by name and
decodes concurrent requests together in one batch per model.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`, `GET /metrics`
(Prometheus) here; OpenAI's completion and embedding routes in `openai_routes`,
Ollama's `/api/*` in `ollama_routes`, what they share in `common`. Requests
are parsed and validated in `edgellm.serve.requests` (tools in `tools`); models,
queues and batched generation live in `edgellm.serve.pool`. Every failure is
an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with a
4xx/5xx status, and the server keeps serving.

Starlette, uvicorn and sse-starlette are imported only when a server is made,
so the CLI stays fast.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from edgellm import __version__
from edgellm.engine.runtime import KV_BYTES_PER_ELEMENT, RuntimeOptions
from edgellm.errors import UsageError
from edgellm.fsutil import human_size
from edgellm.serve import ollama_routes, openai_routes
from edgellm.serve.common import ServeContext, json_response
from edgellm.serve.metrics import CountStatus, Metrics
from edgellm.serve.pool import ApiError, ModelPool
from edgellm.serve.requests import _Models, parse_chat, parse_completion
from edgellm.units import is_loopback

log = logging.getLogger(__name__)


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
    draft: str = "off"  # speculative decoding for requests without a "draft" field (issue 26)


def _rpc_options(config: ServerConfig) -> Any:
    drafting = config.draft not in ("", "off")
    if not config.rpc and not drafting:
        return None
    # drafts need flash attention to leave replies unchanged (engine.speculative)
    return RuntimeOptions(rpc=config.rpc, rpc_split=config.rpc_split, draft=config.draft, flash_attn=True if drafting else None)


def bind_warning(host: str, api_key: Optional[str]) -> Optional[str]:
    """The warning printed when the server is reachable from other machines without a key."""
    if is_loopback(host) or api_key:
        return None
    return (
        f"serving on {host} without --api-key: anyone who can reach this port can use your models; "
        "pass --api-key KEY (or bind 127.0.0.1)"
    )


def _error_response(e: ApiError):
    return json_response(e.body(), e.status, e.headers)


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

    pool = pool or ModelPool(
        max_loaded=config.max_loaded,
        queue_size=config.queue_size,
        n_ctx=config.n_ctx,
        n_threads=config.n_threads,
        parallel=config.parallel,
        runtime_options=_rpc_options(config),
    )
    metrics = Metrics()
    fingerprint = f"edgellm-{__version__}"

    ctx = ServeContext(config, pool, models, metrics, fingerprint)

    async def list_models(request: Request):
        ctx.check_auth(request)
        return json_response({"object": "list", "data": models.listing(pool.loaded())})

    async def get_model(request: Request):
        ctx.check_auth(request)
        mid = request.path_params["model"]
        for m in models.listing(pool.loaded()):
            if m["id"] == mid:
                return json_response(m)
        raise ApiError(404, f"The model '{mid}' does not exist in the edgellm store", param="model", code="model_not_found")

    async def get_metrics(request: Request):
        ctx.check_auth(request)
        return PlainTextResponse(metrics.render(pool), media_type="text/plain; version=0.0.4")

    async def health(request: Request):
        return json_response({"status": "ok", "models": pool.status()})

    async def on_api_error(request: Request, exc: Exception):
        return _error_response(exc)  # type: ignore[arg-type]

    async def on_http_error(request: Request, exc: Exception):
        status = getattr(exc, "status_code", 500)
        msg = (
            "Not found: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions"
            if status == 404
            else str(getattr(exc, "detail", exc))
        )
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
            *openai_routes.routes(ctx),
            *ollama_routes.routes(ctx),
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


# -- running -----------------------------------------------------------------


def open_socket(host: str, port: int) -> socket.socket:
    """Bind before starting uvicorn, so a busy port is a one-line error and `--port 0` can report its port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"cannot resolve --host {host}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    # With the protocol named, asyncio turns Nagle off on every accepted connection (it checks
    # sock.proto == IPPROTO_TCP); with proto 0 a keep-alive client, as the openai and ollama clients
    # are, waited ~40 ms per response for a delayed ACK before the body's segment went out.
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
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

    uconfig = uvicorn.Config(
        app,
        log_level="info" if config.access_log else "warning",
        access_log=config.access_log,
        lifespan="on",
        timeout_graceful_shutdown=10,
        log_config=None,
    )
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
        line += (
            f"; {default.name}: {ctx} KV cells, {human_size(kv)} of KV cache ({pool.base_options.kv_type}), "
            f"up to {ctx // pool.parallel} tokens per request"
        )
    return "edgellm serve: " + line


__all__ = [
    "ServerConfig",
    "create_app",
    "serve",
    "open_socket",
    "bind_warning",
    "is_loopback",
    "parse_chat",
    "parse_completion",
    "describe",
]
