"""The Chat screen's calls into edgellm.chat.session, in one place.

Each function is one core call; they exist so the screen does not depend on
the exact spelling of the chat module's API, and so a build without
edgellm.chat.session says "not available yet" instead of failing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from edgellm.progress import CancelToken

from tui.screens.base import NotAvailable


def _chat():
    try:
        import edgellm.chat.session as chat
    except ImportError as e:
        raise NotAvailable(f"chat is not available in this build yet ({e})") from None
    return chat


def _int(v: str, default: Optional[int]) -> Optional[int]:
    v = (v or "").strip()
    return int(v) if v.lstrip("-").isdigit() else default


def _float(v: str, default: float) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def runtime_options(s: dict):
    from edgellm.engine.runtime import RuntimeOptions

    gl = (s.get("gpu_layers") or "0").strip()
    return RuntimeOptions(n_ctx=_int(s.get("ctx", ""), 2048) or 2048, n_threads=_int(s.get("threads", ""), None), n_gpu_layers=gl if gl == "auto" else (_int(gl, 0) or 0))


def sampling(s: dict):
    from edgellm.engine.runtime import SamplingParams

    return SamplingParams(
        temperature=_float(s.get("temperature"), 0.8), top_k=_int(s.get("top_k", ""), 40) or 0, top_p=_float(s.get("top_p"), 0.95),
        min_p=_float(s.get("min_p"), 0.05), repeat_penalty=_float(s.get("repeat_penalty"), 1.0), max_tokens=_int(s.get("max_tokens", ""), 512) or 512,
        seed=_int(s.get("seed", ""), None),
    )


def open_session(s: dict, *, resume: Optional[str] = None, warn: Optional[Callable[[str], None]] = None) -> Any:
    """Load the model with the settings and start (or resume) a conversation."""
    chat = _chat()
    from edgellm.models.resolve import resolve
    from edgellm.engine.runtime import Runtime

    resolved = resolve(s["model"])
    runtime = Runtime(resolved.path, runtime_options(s))
    try:
        kw = dict(sampling=sampling(s), model_name=resolved.label, warn=warn)
        if resume:
            session = chat.ChatSession.resume(runtime, resume, **kw)
        else:
            session = chat.ChatSession(runtime, chat.Conversation(system=s.get("system") or None), **kw)
    except BaseException:
        runtime.close()
        raise
    return session


def send(session: Any, text: str, s: dict, *, on_piece: Callable[[str], None], cancel: CancelToken) -> Any:
    """One turn; pieces go to `on_piece` as they stream. Returns the turn's GenerationStats."""
    session.sampling = sampling(s)  # sampling changes need no reload
    for piece in session.send(text, cancel=cancel):
        on_piece(piece)
    return session.last_stats


def session_id(session: Any) -> Optional[str]:
    return getattr(session, "session_id", None)


def reset(session: Any) -> None:
    session.reset()


def close(session: Any) -> None:
    session.close()
    runtime = getattr(session, "runtime", None)
    if runtime is not None:
        runtime.close()


def _history():
    _chat()
    from edgellm.chat import history as chat_history

    return chat_history


def list_sessions() -> list[dict]:
    return [
        {"id": x.id, "model": x.model, "turns": x.messages // 2, "title": x.title}
        for x in _history().list_sessions()
    ]


def load_messages(sid: str) -> list[dict]:
    return list(_history().load(sid).messages)


def delete_session(sid: str) -> None:
    _history().delete(sid)


def export_session(sid: str) -> str:
    """Write the session as Markdown under EDGELLM_HOME/exports; return the path."""
    from edgellm import paths

    h = _history()
    saved = h.load(sid)
    target = paths.ensure(paths.home() / "exports") / f"chat-{saved.id}.md"
    return str(h.write_copy(saved, target))
