"""Chat history: one append-only JSONL file per session under `paths.history_dir()`.

Each line is one JSON record, written with a single `write` and fsync'd, so a
crash can at worst tear the last line; loading ignores a torn last line and
resuming cuts it off before appending. Records:

    {"type": "session", "version": 1, "id", "model", "created", "system"}   (first line)
    {"type": "system", "content", "time"}                                     (/system)
    {"type": "message", "role", "content", "time", "stats"?, "cancelled"?}
    {"type": "retract", "time"}       (the last user message got no reply: it was cancelled at once)
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm import paths
from edgellm.errors import ModelNotFound, StoreError, UsageError
from edgellm.fsutil import atomic_write_text

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z_.-]{0,80}$")
VERSION = 1


def new_session_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass
class SessionSummary:
    id: str
    path: Path
    model: str
    created: float
    updated: float
    messages: int
    title: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


@dataclass
class SavedSession:
    """A session read back from disk."""

    id: str
    path: Path
    model: str
    created: float
    system: Optional[str]
    messages: list[dict[str, Any]] = field(default_factory=list)
    torn_tail: bool = False  # the last line was incomplete and ignored

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


class HistoryWriter:
    """Appends records to one session file, fsync'd line by line."""

    def __init__(self, path: Path, session_id: str) -> None:
        self.path = path
        self.id = session_id

    @classmethod
    def create(
        cls, *, model: str, system: Optional[str], folder: Optional[Path] = None, session_id: Optional[str] = None
    ) -> HistoryWriter:
        folder = paths.ensure(folder or paths.history_dir())
        sid = session_id or new_session_id()
        w = cls(folder / f"{sid}.jsonl", sid)
        w.append({"type": "session", "version": VERSION, "id": sid, "model": model, "created": time.time(), "system": system})
        return w

    @classmethod
    def reopen(cls, saved: SavedSession) -> HistoryWriter:
        """Continue a saved session: cut a torn last line so new lines stay whole."""
        _truncate_torn_tail(saved.path)
        return cls(saved.path, saved.id)

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False, default=_default) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise StoreError(f"cannot write chat history {self.path}: {e.strerror or e}") from None

    def message(self, role: str, content: str, **extra: Any) -> None:
        self.append({"type": "message", "role": role, "content": content, "time": time.time(), **extra})

    def system(self, content: Optional[str]) -> None:
        self.append({"type": "system", "content": content, "time": time.time()})


def _default(o: Any) -> Any:
    if hasattr(o, "to_json"):
        return o.to_json()
    raise TypeError(type(o).__name__)


def _truncate_torn_tail(path: Path) -> None:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())


def resolve(ref: str, *, folder: Optional[Path] = None) -> Path:
    """A session id in the history folder, or a path to a JSONL file."""
    folder = folder or paths.history_dir()
    if _ID_RE.match(ref) and (folder / f"{ref}.jsonl").is_file():
        return folder / f"{ref}.jsonl"
    p = Path(ref).expanduser()
    if p.suffix == ".jsonl" and p.is_file():
        return p
    raise ModelNotFound(f"no chat session '{ref}' (see `edgellm chat --list`)")


def load(ref: str | Path, *, folder: Optional[Path] = None) -> SavedSession:
    path = ref if isinstance(ref, Path) else resolve(ref, folder=folder)
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise StoreError(f"cannot read chat history {path}: {e.strerror or e}") from None
    torn = False
    if lines and lines[-1] == b"":
        lines.pop()
    records = []
    for i, raw in enumerate(lines):
        try:
            records.append(json.loads(raw))
        except ValueError:
            if i == len(lines) - 1:  # a crash mid-append: the only damage we expect
                torn = True
                continue
            raise StoreError(f"chat history {path.name} is damaged at line {i + 1}") from None
    if not records or records[0].get("type") != "session":
        raise StoreError(f"{path} is not an edgellm chat history file")
    head = records[0]
    s = SavedSession(
        id=str(head.get("id") or path.stem),
        path=path,
        model=str(head.get("model", "")),
        created=float(head.get("created", 0)),
        system=head.get("system"),
        torn_tail=torn,
    )
    for r in records[1:]:
        if r.get("type") == "system":
            s.system = r.get("content")
        elif r.get("type") == "message" and r.get("role") in ("user", "assistant"):
            s.messages.append({"role": r["role"], "content": str(r.get("content", ""))})
        elif r.get("type") == "retract" and s.messages and s.messages[-1]["role"] == "user":
            s.messages.pop()  # a turn cancelled before any reply
    return s


def list_sessions(*, folder: Optional[Path] = None) -> list[SessionSummary]:
    folder = folder or paths.history_dir()
    out = []
    for p in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        try:
            s = load(p)
        except Exception as e:  # one bad file must not hide the others
            log.warning("skipping %s: %s", p.name, e)
            continue
        first = next((m["content"] for m in s.messages if m["role"] == "user"), "")
        title = " ".join(first.split())[:60]
        out.append(SessionSummary(s.id, p, s.model, s.created, p.stat().st_mtime, len(s.messages), title))
    out.sort(key=lambda x: x.updated, reverse=True)
    return out


def delete(ref: str, *, folder: Optional[Path] = None) -> Path:
    folder = folder or paths.history_dir()
    if not _ID_RE.match(ref):
        raise UsageError(f"'{ref}' is not a chat session id")
    p = resolve(ref, folder=folder)
    if p.parent.resolve() != folder.resolve():
        raise UsageError("only sessions in the history folder can be deleted by id")
    p.unlink()
    return p


def to_markdown(s: SavedSession) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.created)) if s.created else "?"
    parts = [f"# Chat {s.id}", "", f"Model: `{s.model}` · started {when}", ""]
    if s.system:
        parts += ["## System", "", s.system, ""]
    for m in s.messages:
        parts += [f"## {m['role'].capitalize()}", "", m["content"], ""]
    return "\n".join(parts)


def write_copy(s: SavedSession, target: Path) -> Path:
    """/save PATH: Markdown when the name ends in .md, else the JSONL records."""

    target = target.expanduser()
    if target.suffix.lower() in (".md", ".markdown"):
        atomic_write_text(target, to_markdown(s))
    else:
        lines = [
            json.dumps(
                {"type": "session", "version": VERSION, "id": s.id, "model": s.model, "created": s.created, "system": s.system}
            )
        ]
        lines += [json.dumps({"type": "message", **m}, ensure_ascii=False) for m in s.messages]
        atomic_write_text(target, "\n".join(lines) + "\n")
    return target
