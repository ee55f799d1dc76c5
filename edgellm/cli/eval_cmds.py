"""ppl / eval / recommend: thin wrappers over quant.perplexity and quant.evaluate."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from edgellm.cli.output import emit_json, running_job
from edgellm.cli.worker_cmds import prepare_rpc, rpc_options
from edgellm.errors import UsageError
from edgellm.fsutil import human_size
from edgellm.models.resolve import resolve

if TYPE_CHECKING:
    from quant.perplexity import Scoring


def _text_options(f):
    for opt in reversed(
        [
            click.option("--text", "text", type=click.Path(path_type=Path), help="A UTF-8 text file to score."),
            click.option(
                "--corpus",
                help="A named corpus: python-docs (built in: Python's own doc topics) or wikitext-2 "
                "(not shipped; ../shared/data/wikitext-2-raw or $EDGELLM_CORPUS_DIR).",
            ),
            click.option("--ctx", type=int, default=512, show_default=True, help="Tokens per chunk (llama-perplexity's -c)."),
            click.option("--chunks", type=int, help="Score only the first N chunks (default: all)."),
            click.option(
                "--batch", type=int, help="Tokens per decode (default 2048: 4 chunks of 512 at once, like llama-perplexity)."
            ),
            click.option("--threads", type=int, help="Threads (default: physical cores)."),
            click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
            click.option("--no-progress", is_flag=True, help="No progress bar."),
        ]
    ):
        f = opt(f)
    return f


def _scoring(text, corpus, ctx, chunks, batch, threads) -> Scoring:
    """The text options as perplexity() and evaluate() take them, once exactly one source is given."""
    from quant.perplexity import Scoring  # lazy: loads numpy

    if text is None and corpus is None:
        raise UsageError("give --text FILE or --corpus NAME (python-docs is built in)")
    if text is not None and corpus is not None:
        raise UsageError("give only one of --text and --corpus")
    return Scoring(text=text, corpus=corpus, ctx=ctx, chunks=chunks, batch=batch, threads=threads)


@click.command("ppl")
@click.argument("model")
@_text_options
@rpc_options
def ppl_cmd(model, text, corpus, ctx, chunks, batch, threads, as_json, no_progress, rpc=None, rpc_split=None) -> None:
    """Perplexity of MODEL on a text, computed exactly as llama-perplexity does.

    \b
    Examples:
      edgellm ppl smollm2-135m-instruct --corpus python-docs --chunks 8
      edgellm ppl model.gguf --text wiki.test.raw --ctx 512 --json
    """
    from quant.perplexity import perplexity  # lazy: loads numpy

    scoring = _scoring(text, corpus, ctx, chunks, batch, threads)
    rpc_plan = None
    if rpc or rpc_split:
        n_seq = max(1, (batch or 2048) // ctx) if ctx > 0 else 1
        rpc_plan = prepare_rpc(resolve(model).path, rpc, rpc_split, n_ctx=ctx * n_seq)
    with running_job(not no_progress and not as_json) as (bar, token):
        r = perplexity(model, scoring, on_progress=bar, cancel=token, rpc_plan=rpc_plan)
    if as_json:
        emit_json({**r.to_json(), **({"rpc_plan": rpc_plan.to_json()} if rpc_plan is not None else {})})
        return
    click.echo(f"{r.model}: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}")
    click.echo(
        f"  {r.corpus}, ctx {r.ctx}, {r.n_chunks} chunks, {r.n_tokens_scored} tokens scored, "
        f"{r.tokens_per_second:.0f} tok/s ({r.threads} threads, {r.seconds:.1f} s)"
    )


@click.command("eval")
@click.argument("base")
@click.option(
    "--levels",
    "levels",
    default="q4_0,q4_k_m,q5_k_m,q8_0",
    show_default=True,
    help="Comma-separated levels (quantized from BASE when the store lacks them) or model names/paths.",
)
@_text_options
@click.option("--plot", "plot", type=click.Path(path_type=Path), help="Write a PNG of size vs mean KLD and vs ΔPPL.")
@rpc_options
def eval_cmd(
    base, levels, text, corpus, ctx, chunks, batch, threads, as_json, no_progress, plot, rpc=None, rpc_split=None
) -> None:
    """Quality loss of each level of BASE: PPL ± err, ΔPPL, KL divergence, same top token.

    The base is evaluated once (its log-probs kept compactly), then each level
    against it, as `llama-perplexity --kl-divergence` does. The report is saved
    in the store's results folder for `edgellm recommend` and the TUI.

    \b
    Example:
      edgellm eval smollm2-135m-instruct-f16 --levels q4_0,q4_k_m,q5_k_m,q8_0 --corpus python-docs --chunks 4
    """
    from quant.evaluate import evaluate, write_plot  # lazy: loads numpy

    scoring = _scoring(text, corpus, ctx, chunks, batch, threads)
    items = [s.strip() for s in levels.split(",") if s.strip()]
    if rpc_split and not rpc:
        prepare_rpc(None, rpc, rpc_split, n_ctx=ctx)  # the one-line "--split needs --rpc"
    rpc_kw = (
        {"rpc": rpc, "rpc_split": rpc_split, "on_rpc_plan": lambda p: click.echo("\n".join(p.lines()), err=True)} if rpc else {}
    )
    with running_job(not no_progress and not as_json) as (bar, token):
        report = evaluate(base, items, scoring, on_progress=bar, cancel=token, **rpc_kw)
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    if plot is not None:
        write_plot(report, plot)
    if as_json:
        d = report.to_json()
        if plot is not None:
            d["plot"] = str(plot)
        emit_json(d)
        return
    click.echo(render_table(report))
    click.echo(f"saved: {report.path}")
    if plot is not None:
        click.echo(f"plot: {plot}")


def render_table(report) -> str:
    lines = [
        f"{report.base} ({report.base_level}, {human_size(report.base_size_bytes)}): PPL {report.base_ppl:.4f} +/- {report.base_ppl_err:.4f}",
        f"{report.corpus}, ctx {report.ctx}, {report.chunks} chunks, {report.n_tokens_scored} tokens scored; {report.machine}",
        "",
        f"{'level':<8} {'size':>9} {'bpw':>5} {'PPL':>17} {'ΔPPL':>8} {'mean KLD':>17} {'median':>8} {'99%':>8} {'max':>8} "
        f"{'same top':>8} {'RMS Δp':>7} {'tok/s':>6}",
    ]
    for lv in report.levels:
        lines.append(
            f"{lv.level:<8} {human_size(lv.size_bytes):>9} {lv.bpw:5.2f} {lv.ppl:8.4f} ± {lv.ppl_err:6.4f} {lv.dppl_pct:+7.2f}% "
            f"{lv.kld_mean:8.5f} ± {lv.kld_err:6.5f} {lv.kld_median:8.5f} {lv.kld_p99:8.4f} {lv.kld_max:8.4f} "
            f"{lv.same_top_p:7.2f}% {lv.rms_dp:6.2f}% {lv.tokens_per_second:6.0f}"
        )
    return "\n".join(lines)


@click.command("recommend")
@click.option("--ram", type=float, help="RAM to fit in, GB (default: this machine's available RAM).")
@click.option("--ctx", type=int, help="Context the model must hold (default 4096).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def recommend_cmd(ram, ctx, as_json) -> None:
    """The best measured level that fits this machine, from saved `edgellm eval` results."""
    from quant.recommend import recommend  # lazy: loads numpy

    if ram is not None and ram <= 0:
        raise UsageError("--ram must be positive (GB)")
    rec = recommend(ram_bytes=int(ram * 1e9) if ram is not None else None, ctx=ctx)
    if as_json:
        emit_json(rec.to_json())
        return

    def line(tag, c):
        speed = (
            f", {c.gen_tokens_per_second:.1f} tok/s generation"
            if c.gen_tokens_per_second
            else f", {c.eval_tokens_per_second:.0f} tok/s eval"
        )
        return (
            f"{tag}: {c.name} ({c.level}) — mean KLD {c.kld_mean:.4f}, ΔPPL {c.dppl_pct:+.2f}%, same top token "
            f"{c.same_top_p:.1f}%{speed}; needs {human_size(c.need_bytes)}  [{c.corpus}]"
        )

    click.echo(f"RAM {human_size(rec.ram_bytes)}, ctx {rec.ctx}")
    click.echo(line("best", rec.best))
    if rec.runner_up:
        click.echo(line("runner-up", rec.runner_up))
    click.echo(rec.reason)
    if rec.budget_hint:
        click.echo(f"try: {rec.budget_hint['command']}  ({rec.budget_hint['reason']})")
