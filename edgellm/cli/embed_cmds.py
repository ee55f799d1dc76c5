"""`edgellm embed`: pooled, L2-normalised embeddings of texts, for scripts (the work is in `edgellm.engine.embed`)."""

from __future__ import annotations

import json

import click

from edgellm.engine.embed import POOLING, embed_texts
from edgellm.errors import UsageError
from edgellm.models.resolve import resolve


@click.command("embed")
@click.argument("model")
@click.argument("texts", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print {model, pooling, prompt_tokens, embeddings: [[...], ...]} as JSON.")
@click.option("--ctx", "n_ctx", type=click.IntRange(8, 1 << 20), default=1024, show_default=True, help="Most tokens per text.")
@click.option("--threads", "n_threads", type=click.IntRange(1, 1024), help="CPU threads [default: physical cores].")
@click.option(
    "--pooling",
    type=click.Choice([p for p in POOLING.values() if p not in ("none", "rank")]),
    help="Override the pooling the model's metadata names [default: its own, else mean].",
)
def embed_cmd(model, texts, as_json, n_ctx, n_threads, pooling) -> None:
    """Embed TEXT... with MODEL: one line of floats per text, or --json.

    \b
    Examples:
      edgellm embed smollm2-135m-instruct "first text" "second text" --json
    """
    if any(not t for t in texts):
        raise UsageError("a text to embed is empty")
    res = resolve(model)
    out = embed_texts(res.path, list(texts), n_ctx=n_ctx, n_threads=n_threads, pooling=pooling)
    for w in out.warnings:
        click.echo(f"warning: {w}", err=True)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "model": res.label,
                    "pooling": out.pooling,
                    "prompt_tokens": out.prompt_tokens,
                    "dimensions": len(out.vectors[0]),
                    "embeddings": out.vectors,
                }
            )
        )
        return
    for v in out.vectors:
        click.echo(" ".join(f"{x:.6f}" for x in v))
