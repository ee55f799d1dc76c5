"""serve: the store over an OpenAI-compatible HTTP API (see edgellm/server.py)."""

from __future__ import annotations

import click

from edgellm.cli.worker_cmds import prepare_rpc, rpc_options
from edgellm.engine.rpc import parse_endpoints
from edgellm.errors import UsageError
from edgellm.models.resolve import resolve
from edgellm.serve.app import ServerConfig, bind_warning, describe, serve


# long: the click options are the server's whole configuration, one decorator each; the body is ~50 lines
@click.command("serve", context_settings={"show_default": True})  # every default the server has is worth seeing
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", help="Address to bind; anything but loopback is reachable from other machines.")
@click.option("--port", default=8080, type=click.IntRange(0, 65535), help="Port (0: any free port, printed at start).")
@click.option("--api-key", envvar="EDGELLM_API_KEY", help="Require 'Authorization: Bearer KEY' (env: EDGELLM_API_KEY).")
@click.option(
    "--max-loaded", default=1, type=click.IntRange(1, 64), help="Models kept in memory at once (least recently used is unloaded)."
)
@click.option(
    "--queue",
    "queue_size",
    default=16,
    type=click.IntRange(1, 100000),
    help="Requests waiting per model; more get 429 with Retry-After.",
)
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(64, 1 << 20),
    help="KV cells per model, split between the --parallel slots (each request gets CTX/parallel) [default: 1024 per slot, at least 4096].",
)
@click.option(
    "--parallel",
    type=click.IntRange(1, 64),
    help="Requests decoded together per model (continuous batching) [default: physical cores, 4 to 8].",
)
@click.option("--threads", "n_threads", type=click.IntRange(1, 1024), help="CPU threads per model [default: physical cores].")
@click.option("--access-log", is_flag=True, help="Log every request on stderr.")
@click.option(
    "--draft",
    type=click.Choice(["off", "ngram"]),
    default="off",
    help='Speculative decoding for requests without a "draft" field (n-gram drafts; lossless, drafts only where it pays).',
)
@rpc_options
def serve_cmd(
    model,
    host,
    port,
    api_key,
    max_loaded,
    queue_size,
    n_ctx,
    parallel,
    n_threads,
    access_log,
    draft="off",
    rpc=None,
    rpc_split=None,
) -> None:
    """Serve the store over an OpenAI-compatible API.

    \b
    Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions
    (stream: true for SSE), GET /health, GET /metrics (Prometheus). Up to
    --parallel requests per model are decoded together in one batch; a
    prompt that starts like an earlier one reuses its KV cache (prefix
    cache). Models load on demand by store name;
    MODEL is used when a request names none. Ctrl-C stops cleanly.
    """
    try:
        import sse_starlette  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"edgellm serve needs the server extra ({e.name} is missing): pip install 'edgellm[serve]'") from None

    if rpc and model:  # reach the workers and show the plan now: a bad --rpc is a one-line error before binding
        prepare_rpc(resolve(model).path, rpc, rpc_split, n_ctx=n_ctx or 4096)
    elif rpc:
        parse_endpoints(rpc)

    cfg = ServerConfig(
        default_model=model,
        host=host,
        port=port,
        api_key=api_key or None,
        max_loaded=max_loaded,
        queue_size=queue_size,
        n_ctx=n_ctx,
        n_threads=n_threads,
        access_log=access_log,
        rpc=rpc,
        rpc_split=rpc_split,
        parallel=parallel,
        draft=draft,
    )
    warning = bind_warning(host, cfg.api_key)
    if warning:
        click.echo(f"warning: {warning}", err=True)

    def ready(url: str, app) -> None:
        default = app.state.models.default
        click.echo(
            f"edgellm serve: listening on {url}/v1 (default model: {default.name if default else 'none'}; "
            f"max loaded {max_loaded}, queue {queue_size}{', API key required' if cfg.api_key else ''})"
        )
        click.echo(describe(app), err=True)
        click.echo("Ctrl-C to stop", err=True)

    serve(cfg, on_ready=ready)
    click.echo("edgellm serve: stopped", err=True)
