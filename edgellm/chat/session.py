"""Chat sessions: a conversation rendered with the model's template, streamed, with
multi-turn KV reuse, a context window that drops the oldest turns, structured
output, and history on disk.

KV reuse. Each turn renders the whole conversation and hands the tokens to
`Runtime.stream`, which evaluates only what is past the longest prefix
already in the KV cache. Tokenizing the re-rendered text from scratch would
not always give the same tokens the model generated (BPE merges across the
old reply differently), so the session remembers what the KV cache holds as
segments of (bytes, tokens): the previous prompt and each generated token.
Turn N's prompt reuses every leading segment whose bytes the new render
starts with and tokenizes only the rest (the previous reply's end-of-turn
marker and the new user message). The KV cache therefore holds exactly the
tokens the next render produces, and a template that re-renders an old reply
differently (stripped, thinking removed) costs only the part after the first
difference.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm.chat import history as chat_history
from edgellm.chat.structured import Constraint
from edgellm.chat.template import ChatTemplate, TemplateError
from edgellm.engine.runtime import GenerationStats, Runtime, RuntimeOptions, SamplingParams
from edgellm.errors import UsageError
from edgellm.fsutil import human_size
from edgellm.models.resolve import Resolved, resolve
from edgellm.progress import CancelToken

log = logging.getLogger(__name__)


@dataclass
class Conversation:
    """A system prompt and the user/assistant messages, oldest first."""

    system: Optional[str] = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def add(self, role: str, content: str) -> None:
        if role not in ("user", "assistant"):
            raise UsageError(f"unknown chat role {role!r}")
        self.messages.append({"role": role, "content": content})

    def window(self, start: int = 0) -> list[dict[str, str]]:
        """What the template sees: the system prompt and the messages from `start` on."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages[start:]

    def user_indices(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "user"]

    def to_json(self) -> dict[str, Any]:
        return {"system": self.system, "messages": list(self.messages)}


@dataclass
class _Segment:
    data: bytes
    tokens: list[int]


@dataclass
class ChatTotals:
    turns: int = 0
    prompt_tokens_evaluated: int = 0
    prompt_tokens_reused: int = 0
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    dropped_turns: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ChatSession:
    """One conversation driven through a `Runtime`.

    `history`: None writes a new JSONL file under the history folder at the
    first message; a `HistoryWriter` continues one; False keeps nothing.
    """

    def __init__(
        self,
        runtime: Runtime,
        conversation: Optional[Conversation] = None,
        sampling: Optional[SamplingParams] = None,
        *,
        template: Optional[ChatTemplate] = None,
        constraint: Optional[Constraint] = None,
        history: Any = None,
        model_name: Optional[str] = None,
        warn: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.runtime = runtime
        self.conversation = conversation or Conversation()
        self.sampling = sampling or SamplingParams()
        self.warn = warn or log.warning
        self._own_template = template is None
        self.template = template or ChatTemplate.for_runtime(runtime, warn=self.warn)
        self.constraint = constraint.check(runtime) if constraint is not None else None
        self.model_name = model_name or Path(runtime.path).name
        self._history_mode = history
        self.history: Optional[chat_history.HistoryWriter] = history if isinstance(history, chat_history.HistoryWriter) else None
        self._window_start = 0
        self._segments: list[_Segment] = []
        self.last_stats: Optional[GenerationStats] = None
        self.last_value: Any = None  # the parsed JSON of the last reply under a schema
        self.last_matched_tokens = 0  # prompt tokens of the last turn taken from the previous turn's KV
        self.totals = ChatTotals()

    # -- resume --------------------------------------------------------------

    @classmethod
    def resume(cls, runtime: Runtime, ref: str, **kw: Any) -> ChatSession:
        """Continue a saved session (an id or a .jsonl path); new turns append to its file."""
        saved = chat_history.load(ref)
        if saved.torn_tail:
            (kw.get("warn") or log.warning)(f"session {saved.id}: ignored an incomplete last line")
        conv = Conversation(system=saved.system, messages=list(saved.messages))
        in_folder = saved.path.parent.resolve() == chat_history.paths.history_dir().resolve()
        if kw.get("history") is not False:
            kw["history"] = chat_history.HistoryWriter.reopen(saved) if in_folder else None
        session = cls(runtime, conv, **kw)
        if not in_folder and session._history_mode is None:
            session._start_history()
            for m in conv.messages:
                session.history.message(m["role"], m["content"])  # type: ignore[union-attr]
        return session

    # -- commands ------------------------------------------------------------

    def set_system(self, text: Optional[str]) -> None:
        self.conversation.system = text or None
        if self.history is not None:
            self.history.system(self.conversation.system)

    def reset(self) -> None:
        """Forget the messages (keep the system prompt); later turns go to a new history file."""
        self.conversation.messages.clear()
        self._window_start = 0
        self.totals = ChatTotals()
        if self._history_mode is not False:
            self.history = None
            self._history_mode = None

    @property
    def session_id(self) -> Optional[str]:
        return self.history.id if self.history else None

    def _start_history(self) -> None:
        if self.history is None and self._history_mode is not False:
            self.history = chat_history.HistoryWriter.create(model=self.model_name, system=self.conversation.system)

    # -- a turn --------------------------------------------------------------

    def send(self, user_text: str, *, cancel: Optional[CancelToken] = None) -> Iterator[str]:
        """Stream the reply to `user_text`; `last_stats` holds the turn's figures afterwards."""
        if not user_text or not user_text.strip():
            raise UsageError("empty message")
        conv = self.conversation
        conv.add("user", user_text)
        try:
            prompt, segments, dropped = self._build_prompt()
        except BaseException:
            conv.messages.pop()
            raise
        self._start_history()
        if self.history is not None:
            self.history.message("user", user_text)
        st = GenerationStats(dropped_turns=dropped, context_size=self.runtime.n_ctx)
        self.last_stats = st
        sampling = dataclasses.replace(self.sampling, stop=list(self.sampling.stop) + self.template.stop_strings)
        if self.constraint is not None:
            sampling.grammar = self.constraint.gbnf
        pieces: list[str] = []
        inner = self.runtime.stream(prompt, sampling, cancel=cancel, stats=st)
        finished = False
        try:
            for piece in inner:
                pieces.append(piece)
                yield piece
            finished = True
        finally:
            inner.close()
            if not finished:  # the consumer stopped reading, or an error: treat as cancelled
                st.stop_reason = "cancelled"
            self._finish_turn(prompt, segments, "".join(pieces), st)
        self.last_value = None
        if self.constraint is not None and st.stop_reason != "cancelled":
            self.last_value = self.constraint.validate("".join(pieces), stop_reason=st.stop_reason)

    def ask(self, user_text: str, *, cancel: Optional[CancelToken] = None) -> str:
        """`send` collected into one string."""
        return "".join(self.send(user_text, cancel=cancel))

    def _finish_turn(self, prompt: list[int], segments: list[_Segment], reply: str, st: GenerationStats) -> None:
        conv = self.conversation
        if st.stop_reason == "cancelled" and not reply:
            conv.messages.pop()  # nothing to keep; the user message goes too
            if self.history is not None:
                self.history.append({"type": "retract", "time": time.time()})
        else:
            conv.add("assistant", reply)
            if self.history is not None:
                extra = {"cancelled": True} if st.stop_reason == "cancelled" else {}
                self.history.message("assistant", reply, stats=st.to_json(), **extra)
        # What the KV cache holds now: this prompt, then the generated tokens it evaluated.
        kv = self.runtime.cached_tokens()
        if kv[: len(prompt)] == prompt:
            self._segments = segments + [_Segment(self.runtime.token_piece(t), [t]) for t in kv[len(prompt) :]]
        else:
            self._segments = []
        st.kv_tokens = len(kv)
        t = self.totals
        t.turns += 1
        t.prompt_tokens_evaluated += st.evaluated_prompt_tokens
        t.prompt_tokens_reused += st.reused_tokens
        t.generated_tokens += st.generated_tokens
        t.generation_seconds += st.generation_seconds
        t.dropped_turns += st.dropped_turns

    # -- prompt building -----------------------------------------------------

    def _reserve(self) -> int:
        n_ctx = self.runtime.n_ctx
        mt = self.sampling.max_tokens
        return min(mt if mt and mt > 0 else n_ctx // 4, n_ctx // 2)

    def _build_prompt(self) -> tuple[list[int], list[_Segment], int]:
        """Tokens for the current window; drops the oldest turns when the context is full."""
        n_ctx = self.runtime.n_ctx
        reserve = self._reserve()
        conv = self.conversation
        start = self._window_start
        if start > len(conv.messages) - 1 or conv.messages[start]["role"] != "user":
            start = 0
        dropped = 0
        budget = n_ctx
        while True:
            text = self._render(conv.window(start))
            tokens, segments = self._tokenize_reusing(text)
            if len(tokens) + reserve <= budget:
                break
            later = [i for i in conv.user_indices() if i > start]
            if not later:  # only the current message is left
                if len(tokens) >= n_ctx:
                    raise UsageError(
                        f"the prompt is {len(tokens)} tokens but the context holds {n_ctx}; raise --ctx or shorten it"
                    )
                break
            start = later[0]
            dropped += 1
            # Drop a quarter of the context's worth at once, not one turn per turn:
            # each drop re-evaluates the history.
            budget = n_ctx - n_ctx // 4
        if dropped:
            self.warn(
                f"context full ({n_ctx} tokens): dropped the {dropped} oldest turn{'s' if dropped > 1 else ''}, kept the system prompt"
            )
        self._window_start = start
        return tokens, segments, dropped

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.template.render(messages, add_generation_prompt=True)
        except TemplateError:
            raise
        except Exception as e:  # never a traceback for a template problem
            raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from None

    def _tokenize_reusing(self, text: str) -> tuple[list[int], list[_Segment]]:
        rt = self.runtime
        data = text.encode("utf-8")
        taken: list[_Segment] = []
        pos = 0
        data, bos = strip_bos(rt, data)
        if bos:
            taken.append(_Segment(b"", bos))
        old = self._segments[1:] if rt.add_bos and self._segments else self._segments
        for seg in old:
            if not data.startswith(seg.data, pos):
                break
            taken.append(seg)
            pos += len(seg.data)
        n_old = len(old)
        n_kept = len(taken) - (1 if rt.add_bos else 0)
        if n_kept < n_old:  # e.g. a stop string cut the reply, or the template re-renders it differently
            log.debug("prompt diverges from the KV cache after %d of %d segments; re-evaluating from there", n_kept, n_old)
        # A token may end inside a UTF-8 character; back off to a character boundary.
        while pos < len(data) and (data[pos] & 0xC0) == 0x80 and len(taken) > (1 if rt.add_bos else 0):
            pos -= len(taken.pop().data)
        rest = data[pos:]
        rest_tokens = rt.tokenize(rest.decode("utf-8"), add_bos=False, special=True) if rest else []
        segments = taken + ([_Segment(rest, rest_tokens)] if rest else [])
        tokens = [t for s in segments for t in s.tokens]
        self.last_matched_tokens = sum(len(s.tokens) for s in taken)
        return tokens, segments

    # -- /stats --------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        rt = self.runtime
        st = self.last_stats
        kv_type = rt.options.kv_type
        out: dict[str, Any] = {
            "model": self.model_name,
            "session_id": self.session_id,
            "context_size": rt.n_ctx,
            "kv_type": kv_type,
            "kv_cache_bytes": rt.kv_cache_bytes(),
            "kv_cache_bytes_f16": rt.kv_cache_bytes(kv_type="f16"),
            "kv_bytes_per_token": rt.kv_cache_bytes(1),
            "kv_tokens": rt.n_cached,
            "kv_used_bytes": rt.kv_cache_bytes(rt.n_cached),
            "threads": rt.n_threads,
            "gpu_layers": getattr(rt, "n_gpu_layers", 0),
            "messages": len(self.conversation.messages),
            "window_start": self._window_start,
            "template": "fallback" if self.template.is_fallback else "model",
            "totals": self.totals.to_json(),
            "last_turn": st.to_json() if st else None,
            "rss_bytes": _rss(),
        }
        return out

    def close(self) -> None:
        if self._own_template:
            self.template.close()

    def __enter__(self) -> ChatSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_session(
    model: str | Resolved,
    options: Optional[RuntimeOptions] = None,
    sampling: Optional[SamplingParams] = None,
    *,
    system: Optional[str] = None,
    resume: Optional[str] = None,
    constraint: Optional[Constraint] = None,
    history: Any = None,
    warn: Optional[Callable[[str], None]] = None,
    rpc_plan: Any = None,
    on_plan: Optional[Callable[[Any], None]] = None,
) -> ChatSession:
    """Load `model` (a reference, or one already resolved) and start a conversation, or continue
    the saved session `resume` (then `system`, when given, replaces its system prompt).

    The caller owns the result: `session.close()` then `session.runtime.close()`. On any failure
    after the load (a bad template, a constraint the model cannot take, an unreadable history)
    the runtime is closed here, so nothing stays mapped.

    Raises `ModelNotFound`, `RuntimeFailure`, `InsufficientResources` or `UsageError`.
    """
    resolved = resolve(model) if isinstance(model, str) else model
    runtime = Runtime(resolved.path, options, warn=warn, rpc_plan=rpc_plan, on_plan=on_plan)
    kw: dict[str, Any] = dict(sampling=sampling, constraint=constraint, history=history, model_name=resolved.label, warn=warn)
    try:
        if resume:
            session = ChatSession.resume(runtime, resume, **kw)
            if system is not None:
                session.set_system(system)
            return session
        return ChatSession(runtime, Conversation(system=system or None), **kw)
    except BaseException:
        runtime.close()
        raise


def format_info(info: dict[str, Any]) -> str:
    """/stats as text."""

    lines = [f"model        {info['model']}   session {info['session_id'] or '-'}"]
    kv_line = f"KV cache     {info['kv_type']}: {human_size(info['kv_cache_bytes'])} for {info['context_size']} tokens"
    if info["kv_type"] != "f16":
        kv_line += f" (f16 would be {human_size(info['kv_cache_bytes_f16'])})"
    lines.append(kv_line)
    lines.append(f"KV in use    {info['kv_tokens']} tokens, {human_size(info['kv_used_bytes'])}")
    t = info["totals"]
    lines.append(
        f"this chat    {t['turns']} turns, {t['prompt_tokens_evaluated']} prompt tokens evaluated, "
        f"{t['prompt_tokens_reused']} reused from the KV cache, {t['generated_tokens']} generated"
        + (f", {t['dropped_turns']} old turns dropped" if t["dropped_turns"] else "")
    )
    st = info["last_turn"]
    if st:
        lines.append(
            f"last reply   {st['generated_tokens']} tokens at {st['tokens_per_second']:.1f} tokens/s; "
            f"prompt {st['prompt_tokens']} tokens ({st['evaluated_prompt_tokens']} evaluated), first token after {st['ttft_seconds']:.2f} s"
        )
    lines.append(f"process      RSS {human_size(info['rss_bytes'])}, {info['threads']} threads, {info['gpu_layers']} GPU layers")
    return "\n".join(lines)


def strip_bos(rt: Runtime, data: bytes) -> tuple[bytes, list[int]]:
    """(text, [BOS] or []): when the vocab adds BOS and the template also wrote it, keep one BOS token."""
    if not rt.add_bos:
        return data, []
    bos_text = rt.token_text(rt.token_bos()).encode("utf-8")
    if bos_text and data.startswith(bos_text):
        data = data[len(bos_text) :]
    return data, [rt.token_bos()]


def template_tokens(rt: Runtime, template: ChatTemplate, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    """A conversation rendered by the model's template (`extra`: more template variables, e.g. `tools`) and tokenized as `ChatSession` does it."""
    data, bos = strip_bos(rt, template.render(messages, add_generation_prompt=True, **extra).encode("utf-8"))
    return bos + (rt.tokenize(data.decode("utf-8"), add_bos=False, special=True) if data else [])


def stats_line(st: GenerationStats) -> str:
    """The one-line summary printed on stderr after a reply."""
    s = (
        f"[{st.generated_tokens} tokens, {st.tokens_per_second:.1f} tokens/s; prompt {st.prompt_tokens} tokens, "
        f"{st.evaluated_prompt_tokens} evaluated in {st.prompt_seconds:.2f} s; stop: {st.stop_reason}"
    )
    if st.dropped_turns:
        s += f"; dropped {st.dropped_turns} old turns"
    return s + "]"


def _rss() -> int:
    try:
        import psutil  # psutil only where a process is measured

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return 0


__all__ = [
    "ChatTemplate",
    "Conversation",
    "ChatSession",
    "ChatTotals",
    "TemplateError",
    "format_info",
    "open_session",
    "stats_line",
    "strip_bos",
    "template_tokens",
]
