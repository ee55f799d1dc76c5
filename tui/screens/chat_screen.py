"""Chat: a streamed conversation with a local model, its saved sessions
(resume, delete, export) and its settings (model, threads, ctx, GPU layers,
sampling, system prompt), with tokens/s and RSS live in a status line.

The conversation itself (template, KV reuse, history files) is
edgellm.chat.session's; this screen only forwards text and renders the pieces.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import DataTable, Input, Label, Markdown, Select, Static, TabbedContent, TabPane

from edgellm.fsutil import human_size

from tui.widgets.modals import ConfirmModal
from tui.screens.base import BaseScreen, NotAvailable, selected_value

log = logging.getLogger(__name__)

SETTINGS = [
    # key, label, default (str), placeholder
    ("threads", "Threads", "", "auto (physical cores)"),
    ("ctx", "Context (tokens)", "2048", ""),
    ("gpu_layers", "GPU layers", "0", "N, auto or 0"),
    ("temperature", "Temperature", "0.8", ""),
    ("top_k", "Top-k", "40", ""),
    ("top_p", "Top-p", "0.95", ""),
    ("min_p", "Min-p", "0.05", ""),
    ("repeat_penalty", "Repeat penalty", "1.0", ""),
    ("max_tokens", "Max tokens", "512", ""),
    ("seed", "Seed", "", "random"),
]


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
        Binding("d", "delete_session", "Delete", show=False),
        Binding("e", "export_session", "Export", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.session: Any = None  # edgellm.chat.session's session object, once a model is loaded
        self.session_key: Optional[tuple] = None  # the settings it was opened with
        self.token = None
        self.generating = False
        self.stream_updates = 0  # how many times the reply grew on screen (tests read it)
        self.last_reply = ""
        self._t_start = 0.0
        self._n_pieces = 0
        self._status_timer = None
        self.last_stats: Any = None
        self._resume_id: Optional[str] = None
        self.sampler: Any = None

    # -- layout ------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield from self.compose_nav()
        with TabbedContent(id="chat-tabs", initial="chat-main-tab"):
            with TabPane("Chat", id="chat-main-tab"):
                with VerticalScroll(id="chat-log"):
                    yield Static("Type a message and press Enter. Escape stops a reply; Ctrl+T opens the settings.", classes="msg-info")
                yield Input(placeholder="Message (Enter to send)", id="chat-input")
            with TabPane("Sessions", id="chat-sessions-tab"):
                yield Label("Saved sessions  [dim](Enter resume · d delete · e export to Markdown)[/]", classes="pane-title")
                yield DataTable(id="chat-sessions", cursor_type="row")
            with TabPane("Settings", id="chat-settings-tab"):
                with VerticalScroll(id="chat-settings"):
                    with Horizontal(classes="setting"):
                        yield Label("Model")
                        yield Select([], prompt="(no models)", id="set-model", allow_blank=True)
                    for key, label, default, ph in SETTINGS:
                        with Horizontal(classes="setting"):
                            yield Label(label)
                            yield Input(default, placeholder=ph, id=f"set-{key}")
                    yield Label("System prompt")
                    yield Input("", placeholder="(none)", id="set-system")
        yield Static("no model loaded", id="chat-status")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        if self.app.stable:
            for inp in self.query(Input):
                inp.cursor_blink = False
        self.query_one("#chat-sessions", DataTable).add_columns("Session", "Model", "Turns", "First message")
        self._refresh_models()
        self.query_one("#chat-input", Input).focus()

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self._refresh_models()

    def on_unmount(self) -> None:
        self._close_session()

    def _refresh_models(self) -> None:
        from edgellm.models.store import Store

        sel = self.query_one("#set-model", Select)
        try:
            names = [m.name for m in Store().list()]
        except Exception as e:
            self.notify_error(e, "store")
            names = []
        cur = sel.value
        sel.set_options([(n, n) for n in names])
        if cur in names:
            sel.value = cur
        elif names:
            from edgellm.models.catalog import load_catalog

            default = next((n for n in names if n.startswith(load_catalog().default.name)), names[0])
            sel.value = default
        self._status_idle()

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        if tab == "chat-sessions-tab":
            self.refresh_sessions()
            self.query_one("#chat-sessions", DataTable).focus()
        elif tab == "chat-main-tab":
            self.query_one("#chat-input", Input).focus()

    # -- settings --------------------------------------------------------------

    def settings(self) -> dict:
        v = {key: self.query_one(f"#set-{key}", Input).value.strip() for key, *_ in SETTINGS}
        v["model"] = selected_value(self.query_one("#set-model", Select))
        v["system"] = self.query_one("#set-system", Input).value.strip()
        return v

    # -- sending -----------------------------------------------------------------

    @on(Input.Submitted, "#chat-input")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.generating:
            self.notify("a reply is still streaming (Escape stops it)", severity="warning")
            return
        s = self.settings()
        if not s["model"]:
            self.notify("no model: pull or import one on the Models screen (1)", severity="warning")
            return
        event.input.value = ""
        log_ = self.query_one("#chat-log", VerticalScroll)
        log_.mount(Static(f"> {text}", classes="msg-user", markup=False))
        reply = Markdown("", classes="msg-assistant")
        log_.mount(reply)
        log_.scroll_end(animate=False)
        self.generating = True
        self.token = self.app.new_token()
        self._t_start = time.monotonic()
        self._n_pieces = 0
        self.last_reply = ""
        self.sampler = _sampler()
        self._status_timer = self.set_interval(0.5, self._status_live)
        self._send(text, s, reply, self.token)

    @work(thread=True, group="chat", exclusive=False)
    def _send(self, text: str, s: dict, reply: Markdown, token) -> None:
        acc: list[str] = []
        last = [0.0]

        def on_piece(piece: str) -> None:
            acc.append(piece)
            self._n_pieces += 1
            if self.sampler is not None:
                self.sampler.tokens(1)
            now = time.monotonic()
            if now - last[0] >= 0.05:
                last[0] = now
                # post, not call_from_thread: the model never waits for the screen
                self.post_message(ReplyGrew(reply, "".join(acc)))

        def call():
            from tui.screens.chat_backend import open_session, send

            key = _session_key(s)
            if self.session is None or self.session_key != key:
                self.ui(self._status_text, f"loading {s['model']}...")
                self._close_session()
                self.session = open_session(s, resume=self._resume_id, warn=lambda m: self.ui(self.notify, m, severity="warning"))
                self.session_key = key
                self._resume_id = None
            return send(self.session, text, s, on_piece=on_piece, cancel=token)

        ok, stats = self.run_guarded("chat", call, token=token)
        self.ui(self._finished, reply, "".join(acc), stats if ok else None, ok, token.cancelled)

    def on_reply_grew(self, message: "ReplyGrew") -> None:
        if self.generating:
            self._grow(message.reply, message.text)

    def _grow(self, reply: Markdown, text: str) -> None:
        self.stream_updates += 1
        self.last_reply = text
        reply.update(text)
        self.query_one("#chat-log", VerticalScroll).scroll_end(animate=False)

    def _finished(self, reply: Markdown, text: str, stats: Any, ok: bool, cancelled: bool) -> None:
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
        if cancelled:
            self.query_one("#chat-log", VerticalScroll).mount(Static("[stopped]", classes="msg-info", markup=False))
        self.last_stats = stats
        self._status_done(stats)

    def action_stop(self) -> None:
        if self.token is not None:
            self.token.cancel("stopped by the user")

    def action_new_session(self) -> None:
        if self.generating:
            self.notify("stop the reply first (Escape)", severity="warning")
            return
        from tui.screens.chat_backend import reset

        if self.session is not None:
            try:
                reset(self.session)
            except Exception as e:
                self.notify_error(e, "new chat")
        log_ = self.query_one("#chat-log", VerticalScroll)
        log_.remove_children()
        log_.mount(Static("New conversation.", classes="msg-info"))
        self.action_tab("chat-main-tab")

    # -- status line -------------------------------------------------------------

    def _status_text(self, text: str) -> None:
        self.query_one("#chat-status", Static).update(text)

    def _status_idle(self) -> None:
        s = self.settings()
        model = s["model"] or "no model"
        self._status_text(f"{model} · ctx {s['ctx'] or '2048'} · idle")

    def _rss(self) -> int:
        try:
            import psutil

            return psutil.Process().memory_info().rss
        except Exception:
            return 0

    def _status_live(self) -> None:
        if self.sampler is not None:
            snap = self.sampler.snapshot()
            rate, rss = snap.tokens_per_second, snap.rss_bytes
        else:
            dt = time.monotonic() - self._t_start
            rate, rss = (self._n_pieces / dt if dt > 0 else 0.0), self._rss()
        self._status_text(f"{self.settings()['model']} · generating · {rate:.1f} tok/s · RSS {human_size(rss)}")

    def _status_done(self, stats: Any) -> None:
        s = self.settings()
        if stats is None:
            self._status_idle()
            return
        tps = getattr(stats, "tokens_per_second", 0.0) or 0.0
        gen = getattr(stats, "generated_tokens", 0)
        pt = getattr(stats, "evaluated_prompt_tokens", None)
        reused = getattr(stats, "reused_tokens", None)
        extra = f" · prompt {pt} new/{reused} reused" if pt is not None and reused is not None else ""
        self._status_text(f"{s['model']} · {gen} tokens at {tps:.1f} tok/s{extra} · RSS {human_size(self._rss())}")

    # -- sessions -------------------------------------------------------------------

    def refresh_sessions(self) -> None:
        from tui.screens.chat_backend import list_sessions

        t = self.query_one("#chat-sessions", DataTable)
        t.clear()
        try:
            rows = list_sessions()
        except NotAvailable as e:
            self.notify(str(e), severity="warning")
            return
        except Exception as e:
            self.notify_error(e, "sessions")
            return
        for r in rows:
            t.add_row(r["id"], r.get("model", ""), str(r.get("turns", "")), (r.get("title") or "")[:40], key=r["id"])

    def _selected_session(self) -> str:
        t = self.query_one("#chat-sessions", DataTable)
        if self.query_one(TabbedContent).active != "chat-sessions-tab" or not t.row_count:
            return ""
        return str(t.coordinate_to_cell_key((t.cursor_row, 0)).row_key.value or "")

    @on(DataTable.RowSelected, "#chat-sessions")
    def _row_selected(self, _e) -> None:
        self.action_resume()

    def action_resume(self) -> None:
        sid = self._selected_session()
        if not sid or self.generating:
            return
        from tui.screens.chat_backend import load_messages

        try:
            messages = load_messages(sid)
        except Exception as e:
            self.notify_error(e, "resume")
            return
        log_ = self.query_one("#chat-log", VerticalScroll)
        log_.remove_children()
        log_.mount(Static(f"Resumed session {sid}.", classes="msg-info"))
        for m in messages:
            if m.get("role") == "user":
                log_.mount(Static(f"> {m.get('content', '')}", classes="msg-user", markup=False))
            elif m.get("role") == "assistant":
                log_.mount(Markdown(m.get("content", ""), classes="msg-assistant"))
        # The next message continues that conversation: reopen the session from history.
        self.session_key = None
        self._resume_id = sid
        self.action_tab("chat-main-tab")

    def action_delete_session(self) -> None:
        sid = self._selected_session()
        if not sid:
            return

        def go(yes: bool | None) -> None:
            if not yes:
                return
            from tui.screens.chat_backend import delete_session

            try:
                delete_session(sid)
            except Exception as e:
                self.notify_error(e, "delete")
                return
            self.notify(f"deleted session {sid}")
            self.refresh_sessions()

        self.app.push_screen(ConfirmModal(f"Delete chat session {sid}?"), go)

    def action_export_session(self) -> None:
        sid = self._selected_session()
        if not sid:
            return
        from tui.screens.chat_backend import export_session

        try:
            path = export_session(sid)
        except Exception as e:
            self.notify_error(e, "export")
            return
        self.notify(f"exported to {path}")

    def _close_session(self) -> None:
        from tui.screens.chat_backend import close

        sess, self.session = self.session, None
        if sess is not None:
            try:
                close(sess)
            except Exception:
                log.debug("closing the chat session failed", exc_info=True)


def _sampler() -> Any:
    """edgellm.profile.bench's live sampler (tokens/s and RSS), started; None if unavailable."""
    try:
        from edgellm.profile.bench import LiveSampler

        return LiveSampler(interval=0.5).start()
    except Exception:
        return None


def _session_key(s: dict) -> tuple:
    # Changing any of these needs the model reloaded (sampling does not).
    return (s["model"], s["threads"], s["ctx"], s["gpu_layers"], s["system"])
