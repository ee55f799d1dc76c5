"""The texts quality is measured on: a file, WikiText-2 (not shipped; tests
and benchmarks find it beside the clone or in $EDGELLM_CORPUS_DIR), or the
built-in corpus that needs no download."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from edgellm.errors import EvalError, UsageError
from edgellm.fsutil import unreadable

WIKITEXT_REL = Path("wikitext-2-raw") / "wiki.test.raw"
BUILTIN_CORPUS = "python-docs"
CORPORA = ("wikitext-2", BUILTIN_CORPUS)


@dataclass
class Text:
    """The bytes llama.cpp would tokenize, and what they are called in reports."""

    data: bytes
    label: str  # "wikitext-2", "python-docs", or the file name
    sha256: str


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def wikitext_path() -> Path:
    env = os.environ.get("EDGELLM_CORPUS_DIR")
    if env:
        return Path(env).expanduser() / WIKITEXT_REL
    return _repo_root().parent / "shared" / "data" / WIKITEXT_REL


def _builtin_text() -> bytes:
    # Python's own documentation topics ship with every CPython: a corpus the
    # demo can use on any machine without a download.
    try:
        from pydoc_data.topics import topics  # the Python docs corpus, only when it is asked for
    except ImportError:  # pragma: no cover - stripped Pythons
        raise EvalError(
            "the built-in corpus needs Python's pydoc_data module, which this Python lacks; use --text FILE"
        ) from None
    return "\n\n".join(topics[k].strip() for k in sorted(topics)).encode("utf-8")


def load_text(text: Optional[str | Path] = None, corpus: Optional[str] = None) -> Text:
    """Read `--text FILE` or resolve `--corpus NAME`; refuse empty and binary input."""
    if (text is None) == (corpus is None):
        raise UsageError("give exactly one of --text FILE or --corpus NAME")
    if corpus is not None:
        name = corpus.strip().lower()
        if name in ("wikitext-2", "wikitext2", "wikitext"):
            path = wikitext_path()
            if not path.is_file():
                raise EvalError(
                    f"the WikiText-2 corpus is not shipped with edgellm and was not found at {path}; "
                    "download wikitext-2-raw and set EDGELLM_CORPUS_DIR to the folder holding wikitext-2-raw/, "
                    f"or use --corpus {BUILTIN_CORPUS} or --text FILE"
                )
            t = _read_text_file(path)
            return Text(t.data, "wikitext-2", t.sha256)
        if name in (BUILTIN_CORPUS, "pydoc", "builtin"):
            data = _builtin_text()
            return Text(data, BUILTIN_CORPUS, hashlib.sha256(data).hexdigest())
        raise UsageError(f"unknown corpus {corpus!r} (known: {', '.join(CORPORA)})")
    assert text is not None  # exactly one of the two, and it was not corpus
    return _read_text_file(Path(text))


def _read_text_file(path: Path) -> Text:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise EvalError(unreadable(path, e)) from None
    if not data.strip():
        raise EvalError(f"{path.name}: the file is empty")
    if b"\x00" in data[: 1 << 20]:
        raise EvalError(f"{path.name}: looks like a binary file, not text")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"{path.name}: not UTF-8 text (bad byte at offset {e.start}); perplexity needs a text file") from None
    # llama.cpp's -f drops exactly one trailing newline; so do we, for equal tokens.
    if data.endswith(b"\n"):
        data = data[:-1]
    return Text(data, path.name, hashlib.sha256(data).hexdigest())
