"""tui: open the Textual app (also what `edgellm` with no arguments runs)."""

from __future__ import annotations

import sys

import click

from edgellm.errors import UsageError


@click.command("tui")
@click.option(
    "--screen",
    "initial",
    type=click.Choice(["models", "quantize", "evaluate", "chat", "bench", "system"]),
    default="models",
    show_default=True,
    help="Screen to open first.",
)
def tui_cmd(initial: str) -> None:
    """Open the terminal UI: models, quantize, evaluate, chat, bench, system.

    Keys 1-6 (or F1-F6) switch screens, Ctrl+Q quits; each screen's keys are
    in its footer."""

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("the TUI needs an interactive terminal; use the subcommands (`edgellm --help`) in scripts")
    from tui.app import run_tui  # lazy: loads rich, textual

    rc = run_tui(initial=initial)
    if rc:
        sys.exit(rc)
