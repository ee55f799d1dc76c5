"""The `edgellm` command group.

Thin by design: each command parses its options, calls one core function and
renders the result (text, or JSON with --json). Commands live in
`edgellm/cli/*_cmds.py` and are imported only when invoked, so `edgellm --help`
never pays for llama.cpp, numpy or Textual.

Every expected failure is an `EdgeLLMError` and becomes one line on stderr
with a non-zero exit; an unexpected one also becomes one line (set
EDGELLM_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any, NoReturn, Optional

import click

from edgellm import __version__
from edgellm.errors import EdgeLLMError, one_line

# name -> (module edgellm.cli.<module>_cmds, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "models": ("model", "models_group", "List and manage the catalog and the local store."),
    "pull": ("model", "pull_cmd", "Download a model (catalog NAME[:LEVEL] or a Hub repo)."),
    "import": ("model", "import_cmd", "Import a GGUF file, or an export bundle folder."),
    "export": ("model", "export_cmd", "Write models and a manifest to a folder for an air gap."),
    "rm": ("model", "rm_cmd", "Remove a model from the store."),
    "inspect": ("model", "inspect_cmd", "Show a GGUF's architecture, size, level and tensors."),
    "doctor": ("doctor", "doctor_cmd", "Check the install: CPU features, build, RAM, self-test."),
    "chat": ("chat", "chat_cmd", "Chat with a model (interactive, or one-shot with -p)."),
    "quantize": ("quant", "quantize_cmd", "Quantize a GGUF to one or more levels."),
    "convert": ("quant", "convert_cmd", "Dequantize a GGUF to f16/bf16/f32."),
    "imatrix": ("quant", "imatrix_cmd", "Importance matrix of a model (llama-imatrix's algorithm), for better quants."),
    "ppl": ("eval", "ppl_cmd", "Perplexity of a model on a text (llama-perplexity's algorithm)."),
    "eval": ("eval", "eval_cmd", "Quality loss of quant levels vs their base: PPL, KLD, top-token."),
    "recommend": ("eval", "recommend_cmd", "The best measured level that fits this machine."),
    "bench": ("bench", "bench_cmd", "Tokens/s and memory, beside llama-bench."),
    "serve": ("serve", "serve_cmd", "Serve the store over OpenAI's and Ollama's APIs."),
    "embed": ("embed", "embed_cmd", "Embeddings of texts (pooled, L2-normalised), for scripts."),
    "worker": ("worker", "worker_cmd", "Run a llama.cpp RPC worker that hosts split models onto (--rpc)."),
    "tui": ("tui", "tui_cmd", "Open the terminal UI (also: `edgellm` with no arguments)."),
}


def fail(message: str, exit_code: int = 1) -> NoReturn:
    """How every failure reaches the terminal: `error: <message>` on stderr, exit code kept.
    (click's ClickException takes its exit code from the class; ours come from each error.)"""
    click.echo(f"error: {message}", err=True)
    raise click.exceptions.Exit(exit_code) from None


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        spec = COMMANDS.get(name)
        if spec is None:
            return None
        mod = importlib.import_module(f"edgellm.cli.{spec[0]}_cmds")
        return getattr(mod, spec[1], None)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except EdgeLLMError as e:
            fail(str(e), e.exit_code)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            fail("cancelled", 130)
        except BrokenPipeError:
            raise click.exceptions.Exit(1) from None
        except Exception as e:  # never a traceback for the user; one line and a way to get more
            if os.environ.get("EDGELLM_DEBUG"):
                raise
            fail(f"internal error: {one_line(e, typed=True)} (set EDGELLM_DEBUG=1 for details)")

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help from the table: listing commands must not import them.
        rows = [(n, COMMANDS[n][2]) for n in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


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
    logging.basicConfig(level=logging.WARNING - 10 * verbose, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if ctx.invoked_subcommand == "quantize":
        # its llama.cpp worker needs ~0.1 s to start: begun here, that overlaps
        # the cleanup, the command's imports and its input checks
        from quant._workers import close_spares, prestart

        prestart()
        ctx.call_on_close(close_spares)  # one command's spare is never another's (their env may differ)
    _startup_cleanup()
    if ctx.invoked_subcommand is None:
        from edgellm.cli.tui_cmds import tui_cmd  # as every command: imported only when it runs

        ctx.invoke(tui_cmd)


def _startup_cleanup() -> None:
    """Remove temp files of killed jobs, as promised: at the next start."""
    try:
        from edgellm.models.store import (
            Store,
        )  # the store (filelock, the index) only when a command runs: `edgellm --help` < 0.3 s

        Store().cleanup()
    except Exception as e:  # housekeeping must never block a command
        logging.getLogger(__name__).debug("cleanup skipped: %s", e)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        cli.main(args=argv, prog_name="edgellm")
    except SystemExit as e:  # click's standalone mode always exits
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
