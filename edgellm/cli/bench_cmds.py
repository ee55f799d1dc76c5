"""bench: tokens/s and memory per model, beside llama-bench (rendering only; the work is edgellm.profile.bench)."""

from __future__ import annotations

import csv
import io

import click

from edgellm.chat import draft as chat_draft
from edgellm.cli.output import cancellable, emit_json, progress_bar
from edgellm.cli.worker_cmds import rpc_options
from edgellm.engine.gpu import parse_size
from edgellm.errors import UsageError
from edgellm.fsutil import human_size
from edgellm.profile.bench import bench
from edgellm.profile.bench_rpc import bench_rpc, render
from edgellm.profile.results import write_plot
from edgellm.profile.settings import BenchSettings
from edgellm.units import SIZE_HELP

CSV_FIELDS = [
    "model",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "test",
    "n_prompt",
    "n_gen",
    "n_threads",
    "n_ctx",
    "use_mmap",
    "mlock",
    "avg_ts",
    "stddev_ts",
    "ttft_seconds",
    "load_seconds",
    "rss_bytes",
    "file_backed_bytes",
    "anon_bytes",
    "kv_bytes",
    "compute_buffer_bytes",
    "file_bytes",
    "bandwidth_bytes_per_s",
    "read_bytes_per_token",
    "roofline_ts",
    "roofline_fraction",
    "llama_bench_ts",
    "ratio",
    "n_gpu_layers",
    "gpu_device",
    "device_bytes",
    "host_bytes",
]


# long: the click options are the command's interface, one decorator each; the body is under 60 lines
@click.command("bench")
@click.argument("models", nargs=-1, required=True, metavar="MODEL...")
@click.option("--pp", type=int, default=512, show_default=True, help="Prompt tokens for the prompt-processing test.")
@click.option("--tg", type=int, default=128, show_default=True, help="Tokens for the generation test (0: skip it).")
@click.option("-r", "--repetitions", type=int, default=5, show_default=True, help="Repetitions per test.")
@click.option("--threads", type=int, help="CPU threads (default: physical cores).")
@click.option("--ctx", "n_ctx", type=int, help="Context size (default: each test its own token count, as llama-bench).")
@click.option("--no-mmap", is_flag=True, help="Read the weights into private memory instead of mapping the file.")
@click.option("--gpu-layers", default="0", show_default=True, help="Layers to offload: N, all, auto (what fits) or 0.")
@click.option("--gpu-device", help="GPU device index or name (see `edgellm doctor`); needed for a software device.")
@click.option("--gpu-mem", metavar="SIZE", help=f"Most memory to use on the device, e.g. 512MB or 4GiB ({SIZE_HELP}).")
@click.option("--mlock", is_flag=True, help="Lock the weights in RAM.")
@click.option("--json", "fmt", flag_value="json", help="JSON rows (llama-bench's field names).")
@click.option("--csv", "fmt", flag_value="csv", help="CSV rows.")
@click.option("--md", "fmt", flag_value="md", help="A Markdown table.")
@click.option("--compare-llama-bench", is_flag=True, help="Also run llama-bench on the same files and print the ratio.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG of tokens/s per level.")
@click.option(
    "--draft",
    metavar="ngram|MODEL|auto",
    help="Also time --tg tokens of a built-in code rewrite with and without speculative decoding (rows tgN@rewrite and tgN@rewrite+MODE: effective t/s, drafted, accepted).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
@rpc_options
def bench_cmd(
    models,
    pp,
    tg,
    repetitions,
    threads,
    n_ctx,
    no_mmap,
    gpu_layers,
    gpu_device,
    gpu_mem,
    mlock,
    fmt,
    compare_llama_bench,
    plot_path,
    no_progress,
    draft=None,
    rpc=None,
    rpc_split=None,
) -> None:
    """Prompt (pp) and generation (tg) tokens/s as llama-bench measures them (mean ± sd over
    repetitions), time to first token, load time, and memory: peak RSS, the resident pages of the
    mapped weights (file-backed) vs private anonymous pages (KV cache, compute buffers), and the KV
    size for the context. Also the memory bandwidth and the generation roofline it implies.
    Results are kept per model and machine for `recommend` and the TUI.

    With --rpc: each test runs here and split across the workers, and the network's share of
    the time is reported (with --compare-llama-bench, llama-bench --rpc on the same split)."""
    settings = BenchSettings(pp=pp, tg=tg, repetitions=repetitions, threads=threads, n_ctx=n_ctx)
    if draft is not None and chat_draft.parse_draft(draft) in ("off", "none"):
        draft = None
    if draft is not None and (rpc or rpc_split):
        raise UsageError("--draft runs on this machine: leave out --rpc")
    if rpc or rpc_split:
        return _bench_rpc(
            models, rpc, rpc_split, settings, compare_llama_bench=compare_llama_bench, fmt=fmt, no_progress=no_progress
        )

    with cancellable() as cancel:
        rows = bench(
            list(models),
            settings,
            compare_llama_bench=compare_llama_bench,
            use_mmap=not no_mmap,
            mlock=mlock,
            n_gpu_layers=gpu_layers,
            gpu_device=gpu_device,
            gpu_mem=parse_size(gpu_mem),
            warn=lambda m: click.echo(m, err=True),
            on_progress=progress_bar(not no_progress and fmt is None),
            cancel=cancel,
        )
        if draft is not None:
            rows += _draft_rows(models, settings, draft, progress_bar(not no_progress and fmt is None), cancel)
    if plot_path:
        write_plot([r for r in rows if "draft" not in r.extra], plot_path)
    if fmt == "json":
        emit_json([r.to_json() for r in rows])
    elif fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow(r.to_json())
        click.echo(buf.getvalue(), nl=False)
    elif fmt == "md":
        click.echo(_markdown(rows))
    else:
        click.echo(_text(rows))
    if plot_path and fmt is None:
        click.echo(f"plot written to {plot_path}")


def _draft_rows(models, settings: BenchSettings, draft: str, on_progress, cancel) -> list:
    """bench --draft: the chat layer renders the request and attaches the draft; profile times it."""
    from edgellm.chat.session import template_tokens
    from edgellm.chat.template import ChatTemplate
    from edgellm.gguf.reader import read_gguf
    from edgellm.models.resolve import resolve
    from edgellm.profile.bench_draft import draft_rows

    def prompt(rt, text: str) -> list[int]:
        return template_tokens(rt, ChatTemplate.for_runtime(rt), [{"role": "user", "content": text}])

    def attach(rt, value: str):
        return chat_draft.attach(rt, value, warn=lambda m: click.echo(m, err=True))

    out: list = []
    for ref in models:
        res = resolve(str(ref))
        label = res.record.name if res.record else res.path.name
        out += draft_rows(
            res.path,
            label,
            read_gguf(res.path),
            settings,
            draft=draft,
            prompt_tokens=prompt,
            attach=attach,
            on_progress=on_progress,
            cancel=cancel,
        )
    return out


def _bench_rpc(models, rpc, rpc_split, settings: BenchSettings, *, compare_llama_bench: bool, fmt, no_progress) -> None:
    if not rpc:
        raise UsageError("--split needs --rpc")
    if len(models) != 1:
        raise UsageError("bench --rpc takes one model")

    def show(plan) -> None:
        for line in plan.lines():
            click.echo(line, err=True)

    with cancellable() as cancel:
        plan, rows = bench_rpc(
            models[0],
            rpc,
            settings,
            rpc_split=rpc_split,
            compare_llama_bench=compare_llama_bench,
            on_plan=show,
            cancel=cancel,
            on_progress=progress_bar(not no_progress and fmt is None),
        )
    if fmt == "json":
        emit_json({"rpc_plan": plan, "rows": [r.to_json() for r in rows]})
    else:
        click.echo(render(rows))


def _mb(n) -> str:
    return "-" if n is None else human_size(n)


def _secs(x) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _cells(r, compare: bool) -> list[str]:
    cells = [
        r.model,
        r.model_type,
        r.test,
        f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}",
        _secs(r.ttft_seconds),
        _secs(r.load_seconds),
        _mb(r.rss_bytes),
        _mb(r.file_backed_bytes),
        _mb(r.anon_bytes),
        _mb(r.kv_bytes),
    ]
    if compare:
        cells += [
            "-" if r.llama_bench_ts is None else f"{r.llama_bench_ts:.2f} ± {r.llama_bench_stddev_ts or 0:.2f}",
            "-" if r.ratio is None else f"{r.ratio:.3f}x",
        ]
    return cells


_HEAD = ["model", "level", "test", "t/s", "ttft", "load", "peak rss", "file-backed", "anon", "kv"]


def _text(rows) -> str:
    compare = any(r.llama_bench_ts is not None for r in rows)
    head = _HEAD + (["llama-bench t/s", "ratio"] if compare else [])
    table = [head] + [_cells(r, compare) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in table]
    t = rows[0] if rows else None
    if t is not None:
        lines.append(
            f"threads {t.n_threads}, ctx {'pp+tg' if len({r.n_ctx for r in rows}) > 1 else t.n_ctx}, "
            f"{'mmap' if t.use_mmap else 'no mmap'}{', mlock' if t.mlock else ''}, {len(t.samples_ns)} repetitions"
        )
    for r in rows:
        if r.n_gpu_layers:
            lines.append(
                f"{r.model} {r.test}: {r.n_gpu_layers} layers on {r.gpu_device or 'the GPU'}; llama.cpp allocated "
                f"{_mb(r.device_bytes)} on the device, {_mb(r.host_bytes)} on the host"
            )
        if r.extra.get("draft") not in (None, "off"):
            plain = next((p for p in rows if p.model == r.model and p.extra.get("draft") == "off"), None)
            gain = f", {r.avg_ts / plain.avg_ts:.2f}x the plain row" if plain is not None and plain.avg_ts else ""
            rate = r.extra["accept_rate"]
            lines.append(
                f"{r.model} {r.test}: drafted {r.extra['drafted']}, accepted {r.extra['accepted']}"
                f" ({'-' if rate is None else f'{100 * rate:.0f}%'}) in {r.extra['draft_steps']} steps{gain};"
                f" reply {'the same as' if r.extra['same_reply_as_plain'] else 'DIFFERENT from'} the plain one"
            )
        if r.roofline_ts:
            lines.append(
                f"{r.model}: memory bandwidth {r.bandwidth_bytes_per_s / 1e9:.1f} GB/s / {_mb(r.read_bytes_per_token or r.model_size)} read a token "
                f"-> generation roofline {r.roofline_ts:.1f} tok/s; {r.test} reached {100 * (r.roofline_fraction or 0):.0f}%"
            )
    return "\n".join(lines)


def _markdown(rows) -> str:
    compare = any(r.llama_bench_ts is not None for r in rows)
    head = _HEAD + (["llama-bench t/s", "ratio"] if compare else [])
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(_cells(r, compare)) + " |" for r in rows]
    return "\n".join(out)
