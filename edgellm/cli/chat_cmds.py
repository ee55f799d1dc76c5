"""`edgellm chat`: interactive chat, one-shot `-p`, and the history (--list/--export/--delete).

Parsing and rendering only; the work is in `edgellm.chat.session`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import click

from edgellm import paths
from edgellm.chat import draft as chat_draft
from edgellm.chat import history as chat_history
from edgellm.chat import structured
from edgellm.chat.session import ChatSession, format_info, open_session, stats_line
from edgellm.cli.output import cancellable, emit_json
from edgellm.cli.worker_cmds import prepare_rpc, rpc_options
from edgellm.engine.gpu import parse_size
from edgellm.engine.memory import DEFAULT_CTX
from edgellm.engine.runtime import RuntimeOptions, SamplingParams
from edgellm.errors import Cancelled, EdgeLLMError, UsageError
from edgellm.fsutil import atomic_write_text
from edgellm.models.resolve import resolve
from edgellm.progress import CancelToken
from edgellm.units import SIZE_HELP

log = logging.getLogger(__name__)

HELP = """\
/system TEXT   set the system prompt (/system alone shows it)
/reset         forget the conversation (keeps the system prompt), start a new history file
/save [PATH]   show where this session is saved; with PATH also write a copy (.md: Markdown, else JSONL)
/load ID|PATH  continue a saved session (see `edgellm chat --list`)
/stats         tokens, tokens/s, KV cache size for the KV type, memory
/help          this list
/quit          leave (Ctrl-D also works; Ctrl-C stops the current reply)"""


def _warn(msg: str) -> None:
    click.echo(f"warning: {msg}", err=True)


def _show_plan(plan) -> None:
    """The offload plan, on stderr before loading, whenever offload was asked for."""
    if plan.n_gpu_layers or (plan.requested != "0" and not plan.notes):  # a note already said "running on the CPU"
        click.echo(plan.describe(), err=True)


# long: one click command read top to bottom: options, the load with its plans, then one-shot or the interactive loop
@click.command("chat")
@click.argument("model", required=False)
@click.option("-p", "--prompt", help="One-shot: send PROMPT, print the reply on stdout, stats on stderr.")
@click.option("--system", "system", help="System prompt.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole exchange (messages, token counts, timings) as JSON.")
@click.option("--temperature", type=float, default=0.8, show_default=True)
@click.option("--top-k", type=int, default=40, show_default=True)
@click.option("--top-p", type=float, default=0.95, show_default=True)
@click.option("--min-p", type=float, default=0.05, show_default=True)
@click.option("--repeat-penalty", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, help="Same seed and settings give the same reply.")
@click.option("--max-tokens", type=int, default=512, show_default=True, help="Most tokens per reply.")
@click.option("--stop", multiple=True, help="Stop the reply at this text (repeatable).")
@click.option("--threads", type=int, help="CPU threads (default: physical cores).")
@click.option("--ctx", "n_ctx", type=int, default=DEFAULT_CTX, show_default=True, help="Context size in tokens.")
@click.option("--gpu-layers", default="0", show_default=True, help="Layers to offload: N, all, auto (what fits) or 0.")
@click.option("--gpu-device", help="GPU device index or name (see `edgellm doctor`); needed for a software device.")
@click.option("--gpu-mem", metavar="SIZE", help=f"Most memory to use on the device, e.g. 512MB or 4GiB ({SIZE_HELP}).")
@click.option(
    "--kv-type",
    type=click.Choice(["f16", "q8_0", "q4_0"]),
    default="f16",
    show_default=True,
    help="KV cache type (q8_0/q4_0 use less memory).",
)
@click.option(
    "--draft",
    "draft",
    default="off",
    show_default=True,
    metavar="ngram|MODEL|auto|off",
    help="Speculative decoding: drafts from the conversation's n-grams, or from a smaller model of the same vocabulary (auto: the smallest in the store). Lossless; drafts only where it pays.",
)
@click.option("--draft-max", type=int, default=0, help="Most drafted tokens per step (default 48; the length adapts below it).")
@click.option(
    "--flash-attn",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="Flash attention; auto: on when every layer runs on the CPU (as llama.cpp's -fa auto there) or with --draft (its kernel rounds a batch as it rounds one token, so drafts leave the reply unchanged), else off.",
)
@click.option("--mlock", is_flag=True, help="Lock the model in RAM.")
@click.option("--no-mmap", is_flag=True, help="Read the model into memory instead of mapping it.")
@click.option("--force", is_flag=True, help="Load even if weights + KV cache exceed available RAM.")
@click.option(
    "--json-schema", "json_schema", type=click.Path(dir_okay=False), help="Constrain replies to JSON matching this schema file."
)
@click.option("--grammar", type=click.Path(dir_okay=False), help="Constrain replies with this GBNF grammar file.")
@click.option("--resume", "resume_id", metavar="ID", help="Continue a saved session.")
@click.option("--no-history", is_flag=True, help="Do not save this session.")
@click.option("--list", "list_sessions", is_flag=True, help="List saved sessions.")
@click.option("--export", "export_id", metavar="ID", help="Print a saved session as Markdown.")
@click.option("--delete", "delete_id", metavar="ID", help="Delete a saved session.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="With --export: write to this file.")
@rpc_options
def chat_cmd(
    model: Optional[str],
    prompt: Optional[str],
    system: Optional[str],
    as_json: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repeat_penalty: float,
    seed: Optional[int],
    max_tokens: int,
    stop: tuple[str, ...],
    threads: Optional[int],
    n_ctx: int,
    gpu_layers: str,
    gpu_device: Optional[str],
    gpu_mem: Optional[str],
    kv_type: str,
    draft: str,
    draft_max: int,
    flash_attn: str,
    mlock: bool,
    no_mmap: bool,
    force: bool,
    json_schema: Optional[str],
    grammar: Optional[str],
    resume_id: Optional[str],
    no_history: bool,
    list_sessions: bool,
    export_id: Optional[str],
    delete_id: Optional[str],
    output: Optional[str],
    rpc: Optional[str] = None,
    rpc_split: Optional[str] = None,
) -> None:
    """Chat with MODEL: interactive, or one-shot with -p.

    \b
    Examples:
      edgellm chat smollm2-135m-instruct -p "Hello"
      edgellm chat smollm2-135m-instruct --json-schema person.json -p "Alice is 31."
      edgellm chat --list;  edgellm chat --export ID -o chat.md
    """

    if list_sessions or export_id or delete_id:
        return _history_command(list_sessions, export_id, delete_id, output, as_json)
    if not model:
        raise UsageError("name a model: `edgellm chat MODEL` (see `edgellm models`)")
    if json_schema and grammar:
        raise UsageError("use --json-schema or --grammar, not both")

    constraint = None
    if json_schema:
        constraint = structured.load_file(json_schema, kind="json-schema")
    elif grammar:
        constraint = structured.load_file(grammar, kind="grammar")
    resolved = resolve(model)

    draft = chat_draft.parse_draft(draft)
    fa = {"on": True, "off": False}.get(flash_attn, chat_draft.flash_attn(draft))
    opts = RuntimeOptions(
        n_ctx=n_ctx,
        n_threads=threads,
        n_gpu_layers=gpu_layers,
        gpu_device=gpu_device,
        gpu_mem=parse_size(gpu_mem),
        kv_type=kv_type,
        use_mlock=mlock,
        use_mmap=not no_mmap,
        force=force,
        rpc=rpc,
        rpc_split=rpc_split,
        flash_attn=fa,
    )
    rpc_plan = prepare_rpc(resolved.path, rpc, rpc_split, n_ctx=n_ctx, kv_type=kv_type, force=force)
    sampling = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        seed=seed,
        max_tokens=max_tokens,
        stop=list(stop),
        draft_max=chat_draft.check_draft_max(draft_max),
    )
    history = False if no_history else None
    session = open_session(
        resolved,
        opts,
        sampling,
        system=system,
        resume=resume_id,
        constraint=constraint,
        history=history,
        warn=_warn,
        rpc_plan=rpc_plan,
        on_plan=_show_plan,
    )
    runtime = session.runtime
    try:
        drafting = chat_draft.attach(runtime, draft, warn=_warn)
    except BaseException:
        session.close()
        runtime.close()
        raise
    sampling.draft = drafting.mode  # the session holds this object: its replies draft as chosen
    # what /load needs to reopen a saved session on the same runtime
    kw: dict[str, Any] = dict(sampling=sampling, constraint=constraint, model_name=resolved.label, warn=_warn, history=history)
    try:
        try:
            if prompt is None:
                return _interactive(session, runtime, kw)
            with cancellable() as cancel:
                if as_json:
                    reply = session.ask(prompt, cancel=cancel)
                else:
                    _stream_reply(session, prompt, cancel)
            st = session.last_stats
            assert st is not None  # set by the turn that just ran
            if as_json:
                emit_json(
                    {
                        "model": resolved.label,
                        "path": str(resolved.path),
                        "session_id": session.session_id,
                        "system": session.conversation.system,
                        "messages": session.conversation.messages,
                        "reply": reply,
                        "json": session.last_value,
                        "stats": st,
                        "load_seconds": round(runtime.load_seconds, 4),
                        "options": opts,
                        "sampling": {k: v for k, v in sampling.__dict__.items() if k != "grammar"},
                        "constraint": constraint.kind if constraint else None,
                        "rpc_plan": rpc_plan,
                        "gpu": runtime.gpu_report(),
                        "draft": chat_draft.describe(drafting),
                        "threads": {"now": runtime.threads_now, "pinned": runtime.threads_pinned},
                    }
                )
            else:
                click.echo(stats_line(st), err=True)
            if st.stop_reason == "cancelled":
                raise Cancelled("cancelled")
        finally:
            session.close()
    finally:
        drafting.close()
        runtime.close()


def _interactive(session, runtime, kw: dict[str, Any]) -> None:
    tty = sys.stdin.isatty()
    if tty:
        _setup_readline()
    err = lambda m: click.echo(m, err=True)  # noqa: E731
    err(f"chatting with {session.model_name}; /help for commands, Ctrl-C stops a reply, Ctrl-D quits")
    while True:
        try:
            line = input(">>> ") if tty else sys.stdin.readline()
        except EOFError:
            break
        except KeyboardInterrupt:
            err("")
            continue
        if not tty:
            if line == "":
                break
            line = line.rstrip("\n")
        text = line.strip()
        if not text:
            continue
        try:
            if text.startswith("/"):
                cmd, _, arg = text.partition(" ")
                arg = arg.strip()
                if cmd in ("/quit", "/exit", "/q"):
                    break
                elif cmd == "/help":
                    err(HELP)
                elif cmd == "/system":
                    if arg:
                        session.set_system(arg)
                        err("system prompt set")
                    else:
                        err(session.conversation.system or "(no system prompt)")
                elif cmd == "/reset":
                    session.reset()
                    err("conversation reset")
                elif cmd == "/stats":
                    err(format_info(session.info()))
                elif cmd == "/save":
                    if session.history is None:
                        err("nothing to save yet" if kw.get("history") is not False else "history is off (--no-history)")
                    else:
                        err(f"saved as {session.session_id}: {session.history.path}")
                        if arg:
                            target = chat_history.write_copy(chat_history.load(session.history.path), Path(arg))
                            err(f"wrote {target}")
                elif cmd == "/load":
                    if not arg:
                        err("usage: /load ID|PATH")
                        continue
                    new = ChatSession.resume(runtime, arg, **kw)
                    session.close()
                    session = new
                    err(f"loaded {arg}: {len(session.conversation.messages)} messages")
                else:
                    err(f"unknown command {cmd}; /help lists them")
                continue
            cancel = CancelToken()
            with _sigint_cancels(cancel):
                _stream_reply(session, line, cancel)
            st = session.last_stats
            if st is not None:
                err(stats_line(st) if st.stop_reason != "cancelled" else "[reply stopped]")
        except EdgeLLMError as e:
            err(f"error: {e}")
    session.close()


@contextlib.contextmanager
def _sigint_cancels(token):
    """During a reply, Ctrl-C stops the reply instead of the program."""

    def handler(_signum, _frame):
        token.cancel("stopped")

    try:
        old = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _setup_readline() -> None:
    try:
        import atexit
        import readline
    except ImportError:  # line editing is a nicety
        return

    hist = paths.history_dir() / ".readline"
    with contextlib.suppress(OSError):
        readline.read_history_file(hist)
    readline.set_history_length(1000)

    def save() -> None:
        with contextlib.suppress(OSError):
            paths.ensure(hist.parent)
            readline.write_history_file(hist)

    atexit.register(save)


def _history_command(
    list_sessions: bool, export_id: Optional[str], delete_id: Optional[str], output: Optional[str], as_json: bool
) -> None:
    import time

    if list_sessions:
        rows = chat_history.list_sessions()
        if as_json:
            return emit_json(rows)
        if not rows:
            click.echo("no saved chat sessions")
            return
        for s in rows:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.updated))
            click.echo(f"{s.id}  {when}  {s.messages:3d} msgs  {s.model}  {s.title}")
        return
    if export_id:
        md = chat_history.to_markdown(chat_history.load(export_id))
        if output:
            atomic_write_text(Path(output), md)
            click.echo(f"wrote {output}", err=True)
        else:
            click.echo(md)
        return
    if delete_id:
        p = chat_history.delete(delete_id)
        if as_json:
            return emit_json({"deleted": delete_id, "path": str(p)})
        click.echo(f"deleted {delete_id}")


def _stream_reply(session: Any, text: str, cancel: Any) -> None:
    """Print the reply as it is generated, then end its line (also when cancelled)."""
    out = sys.stdout
    try:
        for piece in session.send(text, cancel=cancel):
            out.write(piece)
            out.flush()
    finally:
        out.write("\n")
        out.flush()
