"""`--draft ngram|MODEL|auto|off`: what drafts for speculative decoding, and the draft model's load.

`ngram` drafts from the prompt and the conversation (free); `MODEL` loads a
second, smaller model of the same vocabulary (refused with what differs
when it is not); `auto` takes the smallest model in the store that is
smaller than the target and whose vocabulary matches. Both runtimes then
share the machine's cores: the draft model gets the same thread settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Optional

from edgellm.engine.runtime import Runtime
from edgellm.engine.speculative import DEFAULT_DRAFT_MAX, DRAFT_MAX_LIMIT, DraftMismatch
from edgellm.errors import UsageError
from edgellm.models.resolve import resolve
from edgellm.models.store import Store

log = logging.getLogger(__name__)

_AUTO_TRIES = 4  # candidates loaded before `auto` gives up (each is a model load)


@dataclass
class DraftChoice:
    mode: str  # "off", "ngram" or "model" (SamplingParams.draft)
    model: Optional[str] = None  # the draft model's name or path
    runtime: Optional[Runtime] = None  # the loaded draft model, attached to the target

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None


def parse_draft(value: Optional[str]) -> str:
    """`off`, `ngram`, `auto`, or a model reference."""
    v = (value or "off").strip()
    if not v:
        raise UsageError("--draft takes ngram, auto, off or a model")
    return v.lower() if v.lower() in ("off", "ngram", "auto", "none") else v


def flash_attn(draft: str) -> Optional[bool]:
    """Flash attention for `--flash-attn auto`: on while drafting, since its kernel rounds a verify batch as it
    rounds one token, so a drafted reply is the plain one (off, a batch changed 4 of 8 replies); else the default."""
    return True if parse_draft(draft) not in ("off", "none") else None


def check_draft_max(n: int) -> int:
    """`--draft-max N`: 0 is the default length; a negative one would silently never draft."""
    if n < 0:
        raise UsageError(f"--draft-max must be 0 (the default, {DEFAULT_DRAFT_MAX}) or more, not {n}")
    if n > DRAFT_MAX_LIMIT:
        raise UsageError(
            f"--draft-max must be at most {DRAFT_MAX_LIMIT}, not {n}: a longer verify step takes another "
            "attention path in llama.cpp, and the reply would no longer be the one decoding without drafts gives"
        )
    return n


def attach(
    target: Runtime, value: Optional[str], *, warn: Callable[[str], None] = log.warning, store: Optional[Store] = None
) -> DraftChoice:
    """Resolve `--draft` for `target`; a draft model is loaded, checked and attached (`Runtime.attach_draft`).

    Raises `DraftMismatch` when the named model's vocabulary differs, `ModelNotFound` when it is not
    there, `UsageError` when `auto` finds no compatible model.
    """
    v = parse_draft(value)
    if v in ("off", "none"):
        return DraftChoice("off")
    if v == "ngram":
        return DraftChoice("ngram")
    opts = replace(target.options, n_ctx=target.n_ctx, force=False, rpc=None, rpc_split=None)
    if v != "auto":
        resolved = resolve(v, store=store)
        rt = Runtime(resolved.path, opts, warn=warn)
        try:
            target.attach_draft(rt)
        except BaseException:
            rt.close()
            raise
        return DraftChoice("model", resolved.label, rt)
    size = target.path.stat().st_size
    cands = sorted(
        (
            m
            for m in (store or Store()).list()
            if m.path.is_file() and m.path.resolve() != target.path.resolve() and m.path.stat().st_size < size
        ),
        key=lambda m: m.path.stat().st_size,
    )
    refused: list[str] = []
    for rec in cands[:_AUTO_TRIES]:
        rt = Runtime(rec.path, opts, warn=warn)
        try:
            target.attach_draft(rt)
        except DraftMismatch as e:
            rt.close()
            refused.append(f"{rec.name}: {e}")
            continue
        except BaseException:
            rt.close()
            raise
        return DraftChoice("model", rec.name, rt)
    why = "; ".join(refused) if refused else "no smaller model in the store"
    raise UsageError(
        f"--draft auto found no draft model for {target.path.name} ({why}); pull a smaller model of the same family, or use --draft ngram"
    )


def describe(choice: DraftChoice) -> dict[str, Any]:
    return {"mode": choice.mode, "model": choice.model}


__all__ = ["DraftChoice", "attach", "parse_draft", "describe"]
