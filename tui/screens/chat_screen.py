"""Chat: a streamed conversation with a local model, its saved sessions
(resume, delete, export) and its settings (model, threads, ctx, GPU layers,
device and memory, the RPC workers, sampling, speculative decoding, system
prompt), with tokens/s and RSS live in a status line and, after a reply that
drafted, the drafted tokens accepted.

The conversation itself (template, KV reuse, history files) is
edgellm.chat.session's; this screen only forwards text and renders the pieces.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Optional

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.timer import Timer
from textual.widgets import DataTable, Input, Label, Markdown, Static, TabbedContent, TabPane

from edgellm import paths
from edgellm.chat import draft as chat_draft
from edgellm.chat import history
from edgellm.chat.session import ChatSession, open_session
from edgellm.engine.rpc_loss import LossGuard
from edgellm.engine.runtime import GenerationStats, Runtime, RuntimeOptions, SamplingParams
from edgellm.errors import UsageError
from edgellm.fsutil import human_size
from edgellm.models.catalog import load_catalog
from edgellm.models.store import Store
from edgellm.profile.live import LiveSampler
from tui.modes import SCREENS, key_label
from tui.screens.base import BaseScreen
from tui.widgets.chat_settings import ChatSettings
from tui.widgets.fields import steady_cursors
from tui.widgets.tables import cursor_key, fill

log = logging.getLogger(__name__)

MODELS_KEY = key_label(next(m.key for m in SCREENS if m.name == "models"))


class ReplyGrew(Message):
    """The streamed reply so far (posted from the worker thread)."""

    def __init__(self, reply: Markdown, text: str) -> None:
        super().__init__()
        self.reply = reply
        self.text = text


class ChatScreen(BaseScreen):
    MODE = "chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop reply"),
        Binding("ctrl+n", "new_session", "New chat", priority=True),
        Binding("ctrl+o", "tab('chat-sessions-tab')", "Sessions", priority=True),
        Binding("ctrl+t", "tab('chat-settings-tab')", "Settings", priority=True),
        Binding("ctrl+l", "tab('chat-main-tab')", "Chat", priority=True),
        # listed on the Sessions tab's title line, where they apply
        Binding("d", "delete_session", "Delete", show=False),
        Binding("e", "export_session", "Export", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.session: Optional[ChatSession] = None  # once a model is loaded
        self.session_key: Optional[tuple] = None  # the settings it was opened with
        self.drafting: Optional[chat_draft.DraftChoice] = None  # what drafts for the session (chat --draft)
        self.token = None
        self.generating = False
        self.stream_updates = 0  # how many times the reply grew on screen (tests read it)
        self.last_reply = ""
        self._status_timer: Optional[Timer] = None
        self.last_stats: Optional[GenerationStats] = None
        self._resume_id: Optional[str] = None
        self.sampler: Optional[LiveSampler] = None
        self._loss_guard: Optional[LossGuard] = None  # made at the first message over RPC

    # -- layout ------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        with TabbedContent(id="chat-tabs", initial="chat-main-tab"):
            with TabPane("Chat", id="chat-main-tab"):
                with VerticalScroll(id="chat-log"):
                    yield Static(
                        "Type a message and press Enter. Escape stops a reply; Ctrl+T opens the settings.", classes="msg-info"
                    )
                box = Input(placeholder="Enter sends", id="chat-input")
                box.border_title = "Message"
                yield box
            with TabPane("Sessions", id="chat-sessions-tab"):
                yield Label("Saved sessions  [dim](Enter resume · d delete · e export to Markdown)[/]", classes="pane-title")
                yield DataTable(id="chat-sessions", cursor_type="row")
            with TabPane("Settings", id="chat-settings-tab"):
                yield ChatSettings(id="chat-settings")
        yield Static("no model loaded", id="chat-status")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        steady_cursors(self)
        self.query_one("#chat-sessions", DataTable).add_columns("Session", "Model", "Turns", "First message")
        self.reload()
        self.query_one("#chat-input", Input).focus()

    def on_unmount(self) -> None:
        self._close_session()

    def reload(self) -> None:
        try:
            names = [m.name for m in Store().list()]
            default = load_catalog().default.name
        except Exception as e:
            self.notify_error(e, "store")
            names, default = [], ""
        self.query_one(ChatSettings).set_models(names, next((n for n in names if n.startswith(default)), ""))
        self._status_idle()

    def action_tab(self, tab: str) -> None:
        # Focus goes into the new tab: focus left in the hidden one would move
        # to a widget there and switch the tab straight back.
        self.query_one(TabbedContent).active = tab
        if tab == "chat-sessions-tab":
            self.refresh_sessions()
            self.query_one("#chat-sessions", DataTable).focus()
        elif tab == "chat-settings-tab":
            self.query_one("#set-model").focus()
        else:
            self.query_one("#chat-input", Input).focus()

    def settings(self) -> dict[str, str]:
        return self.query_one(ChatSettings).values()

    # -- sending -----------------------------------------------------------------

    @on(Input.Submitted, "#chat-input")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.generating:
            self.notify("a reply is still streaming (Escape stops it)", severity="warning")
            return
        form = self.query_one(ChatSettings)
        s = form.values()
        if not s["model"]:
            self.notify(f"no model: pull or import one on the Models screen ({MODELS_KEY})", severity="warning")
            return
        try:  # parsed here, so a typo in a setting is said before anything loads
            options, sampling = form.runtime_options(), form.sampling()
        except UsageError as e:
            self.notify(f"settings: {e}", severity="warning", timeout=8)
            return
        if options.rpc and options.n_gpu_layers not in (0, "0"):
            self.notify("GPU layers: not used with RPC workers (the split places the layers)", severity="warning")
        event.input.value = ""
        log_ = self.query_one("#chat-log", VerticalScroll)
        log_.mount(Static(f"> {text}", classes="msg-user", markup=False))
        reply = Markdown("", classes="msg-assistant")
        log_.mount(reply)
        log_.scroll_end(animate=False)
        self.generating = True
        self.token = self.app.new_token()
        self.last_reply = ""
        self.sampler = LiveSampler(interval=0.5).start()
        self._status_timer = self.set_interval(0.5, self._status_live)
        self._send(text, s, form.reload_key(), options, sampling, reply, self.token)

    @work(thread=True, group="chat", exclusive=False)
    def _send(
        self, text: str, s: dict, key: tuple, options: RuntimeOptions, sampling: SamplingParams, reply: Markdown, token
    ) -> None:
        acc: list[str] = []
        last = [0.0]

        warn = lambda m: self.ui(self.notify, m, severity="warning")  # noqa: E731

        def call() -> Optional[GenerationStats]:
            if self.session is None or self.session_key != key:
                self.ui(self._status_text, f"loading {s['model']}...")
                self._close_session()
                self.session = open_session(
                    # a resumed session keeps its own system prompt
                    s["model"],
                    options,
                    sampling,
                    system=None if self._resume_id else s["system"] or None,
                    resume=self._resume_id,
                    warn=warn,
                )
                self.ui(self._show_plans, self.session.runtime)
                try:  # a draft model that cannot draft for this one fails the message, as it fails the CLI
                    self.drafting = chat_draft.attach(self.session.runtime, s["draft"], warn=warn)
                except BaseException:
                    self._close_session()
                    raise
                self.session_key = key
                self._resume_id = None
            assert self.drafting is not None  # attached with the session
            sampling.draft = self.drafting.mode
            self.session.sampling = sampling  # sampling changes need no reload
            for piece in self.session.send(text, cancel=token):
                acc.append(piece)
                if self.sampler is not None:
                    self.sampler.tokens(1)
                now = time.monotonic()
                if now - last[0] >= 0.05:
                    last[0] = now
                    # post, not call_from_thread: the model never waits for the screen
                    self.post_message(ReplyGrew(reply, "".join(acc)))
            return self.session.last_stats

        run = call
        if options.rpc:  # a lost worker ends this reply with its line, not the app
            guard = self._rpc_guard()
            guard.reset()
            run = functools.partial(guard.call, call)
        ok, out = self.run_guarded("chat", run, token=token)
        self.ui(self._finished, reply, "".join(acc), out if ok else None, token.cancelled, "" if ok else out)

    def _rpc_guard(self) -> LossGuard:
        """A worker that dies mid-reply: llama.cpp's RPC client would abort the whole process (the CLI's
        one-line exit). The core's guard parks the thread that was generating instead and hands us the line
        that names the worker; the app stays up."""
        if self._loss_guard is None:
            self._loss_guard = LossGuard(on_lost=self._worker_lost)
        return self._loss_guard

    def _worker_lost(self, _msg: str) -> None:
        # Called on the parked thread. The session's model has layers on the dead worker: dropped,
        # not closed (freeing it would talk to that worker again); the next message loads afresh.
        self.session, self.session_key, self.drafting = None, None, None

    def _show_plans(self, runtime: Runtime) -> None:
        """Where the layers went, in the conversation, after each (re)load: the GPU plan that ran
        (a fallback to the CPU included) or the split over the RPC workers."""
        lines = list(runtime.rpc_plan.lines()) if runtime.rpc_plan is not None else []
        if runtime.gpu_plan is not None:
            lines.append(runtime.gpu_plan.describe())
        log_ = self.query_one("#chat-log", VerticalScroll)
        # before the reply being streamed: the plan came first
        log_.mount(Static("\n".join(lines), classes="msg-info plan", markup=False), before=len(log_.children) - 1)

    def on_reply_grew(self, message: ReplyGrew) -> None:
        if self.generating:
            self._grow(message.reply, message.text)

    def _grow(self, reply: Markdown, text: str) -> None:
        self.stream_updates += 1
        self.last_reply = text
        reply.update(text)
        self.query_one("#chat-log", VerticalScroll).scroll_end(animate=False)

    def _finished(self, reply: Markdown, text: str, stats: Optional[GenerationStats], cancelled: bool, reason: str) -> None:
        self.generating = False
        self.token = None
        if self._status_timer is not None:
            self._status_timer.stop()
            self._status_timer = None
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
        if text != self.last_reply:
            self._grow(reply, text)
        log_ = self.query_one("#chat-log", VerticalScroll)
        if cancelled:
            log_.mount(Static("[stopped]", classes="msg-info", markup=False))
        elif reason:  # kept in the conversation, where the reply would have been
            log_.mount(Static(f"[failed: {reason}]", classes="msg-error", markup=False))
            log_.scroll_end(animate=False)
        self.last_stats = stats
        self._status_done(stats)

    def action_stop(self) -> None:
        if self.token is not None:
            self.token.cancel("stopped by the user")

    def action_new_session(self) -> None:
        if self.generating:
            self.notify("stop the reply first (Escape)", severity="warning")
            return
        if self.session is not None:
            self.session.reset()
        log_ = self.query_one("#chat-log", VerticalScroll)
        log_.remove_children()
        log_.mount(Static("New conversation.", classes="msg-info"))
        self.action_tab("chat-main-tab")

    # -- status line -------------------------------------------------------------

    def _status_text(self, text: str) -> None:
        self.query_one("#chat-status", Static).update(text)

    def _status_idle(self) -> None:
        s = self.settings()
        self._status_text(f"{s['model'] or 'no model'} · ctx {s['ctx']} · idle")

    def _status_live(self) -> None:
        if self.sampler is None:
            return
        snap = self.sampler.snapshot()
        self._status_text(
            f"{self.settings()['model']} · generating · {snap.tokens_per_second:.1f} tok/s · RSS {human_size(snap.rss_bytes)}"
        )

    def _status_done(self, stats: Optional[GenerationStats]) -> None:
        if stats is None:
            self._status_idle()
            return
        rss = LiveSampler().snapshot().rss_bytes
        # the core's counters, as `chat --json` reports them: accepted of the drafted tokens
        drafts = f" · drafts {stats.draft_accepted}/{stats.draft_tokens} accepted" if stats.draft != "off" else ""
        self._status_text(
            f"{self.settings()['model']} · {stats.generated_tokens} tokens at {stats.tokens_per_second:.1f} tok/s{drafts}"
            f" · prompt {stats.evaluated_prompt_tokens} new/{stats.reused_tokens} reused · RSS {human_size(rss)}"
        )

    # -- sessions -------------------------------------------------------------------

    def refresh_sessions(self) -> None:
        # list_sessions() reads every history file: a worker, like every other scan
        self.in_background("sessions", history.list_sessions, self._fill_sessions, group="sessions")

    def _fill_sessions(self, rows: list[history.SessionSummary]) -> None:
        fill(
            self.query_one("#chat-sessions", DataTable),
            [((r.id, r.model, str(r.messages // 2), r.title[:40]), r.id) for r in rows],
        )

    def _selected_session(self) -> str:
        t = self.query_one("#chat-sessions", DataTable)
        if self.query_one(TabbedContent).active != "chat-sessions-tab":
            return ""
        return cursor_key(t)

    @on(DataTable.RowSelected, "#chat-sessions")
    def _row_selected(self, _e) -> None:
        self.action_resume()

    def action_resume(self) -> None:
        sid = self._selected_session()
        if not sid or self.generating:
            return
        try:
            saved = history.load(sid)
        except Exception as e:
            self.notify_error(e, "resume")
            return
        log_ = self.query_one("#chat-log", VerticalScroll)
        log_.remove_children()
        log_.mount(Static(f"Resumed session {sid}.", classes="msg-info"))
        for m in saved.messages:
            if m["role"] == "user":
                log_.mount(Static(f"> {m['content']}", classes="msg-user", markup=False))
            else:
                log_.mount(Markdown(m["content"], classes="msg-assistant"))
        # The next message continues that conversation: reopen the session from history.
        self.session_key = None
        self._resume_id = sid
        self.action_tab("chat-main-tab")

    def action_delete_session(self) -> None:
        sid = self._selected_session()
        if not sid:
            return
        self.confirm_delete(
            f"Delete chat session {sid}?", lambda: history.delete(sid), f"deleted session {sid}", self.refresh_sessions
        )

    def action_export_session(self) -> None:
        sid = self._selected_session()
        if not sid:
            return
        try:
            saved = history.load(sid)
            path = history.write_copy(saved, paths.ensure(paths.home() / "exports") / f"chat-{saved.id}.md")
        except Exception as e:
            self.notify_error(e, "export")
            return
        self.notify(f"exported to {path}")

    def _close_session(self) -> None:
        sess, self.session = self.session, None
        drafting, self.drafting = self.drafting, None
        if sess is not None:
            try:  # in the CLI's order: the session, the draft model, the model it drafts for
                sess.close()
                if drafting is not None:
                    drafting.close()
                sess.runtime.close()
            except Exception:
                log.debug("closing the chat session failed", exc_info=True)
