"""The `edgellm` command group.

Thin by design: each command parses its options, calls one core function and
renders the result (text, or JSON with --json). Commands live in
`edgellm/commands/` and are imported only when invoked, so `edgellm --help`
never pays for llama.cpp, numpy or Textual.

Every expected failure is an `EdgeLLMError` and becomes one line on stderr
with a non-zero exit; an unexpected one also becomes one line (set
EDGELLM_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import sys
from typing import Any, Iterator, Optional

import click

from . import __version__

# name -> (module in edgellm.commands, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "models": ("models", "models_group", "List and manage the catalog and the local store."),
    "pull": ("models", "pull_cmd", "Download a model (catalog NAME[:LEVEL] or a Hub repo)."),
    "import": ("models", "import_cmd", "Import a GGUF file, or an export bundle folder."),
    "export": ("models", "export_cmd", "Write models and a manifest to a folder for an air gap."),
    "rm": ("models", "rm_cmd", "Remove a model from the store."),
    "inspect": ("models", "inspect_cmd", "Show a GGUF's architecture, size, level and tensors."),
    "doctor": ("doctor", "doctor_cmd", "Check the install: CPU features, build, RAM, self-test."),
    "chat": ("chat", "chat_cmd", "Chat with a model (interactive, or one-shot with -p)."),
    "quantize": ("quant", "quantize_cmd", "Quantize a GGUF to one or more levels."),
    "convert": ("quant", "convert_cmd", "Dequantize a GGUF to f16/bf16/f32."),
    "ppl": ("evaluate", "ppl_cmd", "Perplexity of a model on a text (llama-perplexity's algorithm)."),
    "eval": ("evaluate", "eval_cmd", "Quality loss of quant levels vs their base: PPL, KLD, top-token."),
    "recommend": ("evaluate", "recommend_cmd", "The best measured level that fits this machine."),
    "bench": ("bench", "bench_cmd", "Tokens/s and memory, beside llama-bench."),
    "serve": ("serve", "serve_cmd", "Serve the store over an OpenAI-compatible API."),
    "tui": ("tui", "tui_cmd", "Open the terminal UI (also: `edgellm` with no arguments)."),
}


class OneLineError(click.ClickException):
    """How every failure reaches the terminal: `error: <message>`, exit code kept."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(n for n in COMMANDS if _available(n))

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        spec = COMMANDS.get(name)
        if spec is None or not _available(name):
            return None
        mod = importlib.import_module(f"edgellm.commands.{spec[0]}")
        return getattr(mod, spec[1], None)

    def invoke(self, ctx: click.Context) -> Any:
        from .errors import EdgeLLMError

        try:
            return super().invoke(ctx)
        except EdgeLLMError as e:
            raise OneLineError(str(e), e.exit_code) from None
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            raise OneLineError("cancelled", 130) from None
        except BrokenPipeError:
            raise click.exceptions.Exit(1) from None
        except Exception as e:  # never a traceback for the user; one line and a way to get more
            if os.environ.get("EDGELLM_DEBUG"):
                raise
            msg = str(e).splitlines()[0] if str(e) else ""
            raise OneLineError(f"internal error: {type(e).__name__}: {msg} (set EDGELLM_DEBUG=1 for details)", 1) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help from the table: listing commands must not import them.
        rows = [(n, COMMANDS[n][2]) for n in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _available(name: str) -> bool:
    from importlib.util import find_spec

    return find_spec(f"edgellm.commands.{COMMANDS[name][0]}") is not None


@click.group(cls=LazyGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edgellm")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """edgellm: local, CPU-first LLMs around GGUF quantization.

    Run with no arguments to open the terminal UI.

    \b
    Quick start:
      edgellm pull smollm2-135m-instruct
      edgellm chat smollm2-135m-instruct -p "Hello"
      edgellm quantize smollm2-135m-instruct-f16 --level q4_k_m
    """
    logging.basicConfig(
        level=logging.WARNING - 10 * verbose, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    _startup_cleanup()
    if ctx.invoked_subcommand is None:
        if not _available("tui"):
            click.echo(ctx.get_help())
            return
        ctx.invoke(cli.get_command(ctx, "tui"))


def _startup_cleanup() -> None:
    """Remove temp files of killed jobs, as promised: at the next start."""
    try:
        from .store import Store

        Store().cleanup()
    except Exception as e:  # housekeeping must never block a command
        logging.getLogger(__name__).debug("cleanup skipped: %s", e)


# -- helpers shared by the command modules ----------------------------------


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=_json_default))


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_json"):
        return o.to_json()
    if hasattr(o, "__fspath__"):
        return os.fspath(o)
    if hasattr(o, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


@contextlib.contextmanager
def cancellable() -> Iterator[Any]:
    """A CancelToken that SIGINT/SIGTERM set, so jobs stop cleanly (no partial files).

    A second Ctrl-C falls back to the default handler and interrupts at once.
    """
    from .progress import CancelToken

    token = CancelToken()
    old: dict[int, Any] = {}

    def handler(signum, _frame):
        if token.cancelled:
            signal.signal(signum, old.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        token.cancel("cancelled by " + signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread
            old[sig] = signal.signal(sig, handler)
    try:
        yield token
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def progress_bar(enabled: bool = True):
    from .progress import TerminalBar, no_progress

    return TerminalBar() if enabled else no_progress


@contextlib.contextmanager
def running_job(show_progress: bool = True) -> Iterator[tuple[Any, Any]]:
    """(on_progress, cancel token) for one long job: a bar on stderr that is
    always closed, and a token that Ctrl-C/SIGTERM set."""
    bar = progress_bar(show_progress)
    try:
        with cancellable() as token:
            yield bar, token
    finally:
        if hasattr(bar, "close"):
            bar.close()


def main(argv: Optional[list[str]] = None) -> int:
    try:
        cli.main(args=argv, prog_name="edgellm")
    except SystemExit as e:  # click's standalone mode always exits
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
