"""Drafts for speculative decoding from the n-grams of the text the model has already seen.

A reply that rewrites given code, quotes a passage or answers from a
document repeats long runs of its prompt; a model at temperature 0 that
falls into a loop repeats itself. Both are predictable from the context
alone, for free: find the earlier place where the context's last tokens
occurred, and propose what followed there.

llama-server's best n-gram mode here (`ngram-mod`, common/ngram-mod.cpp)
hashes the last 24 tokens to the one token that followed them and chains
lookups, drafting only when it can chain at least 48 tokens. That is safe
but blind to shorter matches, which are often right too. This drafter finds
the longest earlier match of the context's suffix (at least 2 tokens, found
through a bigram index, extended backwards to at most `max_match`) and
reports its length with the draft, so the caller (`speculative.DraftPolicy`)
can learn how often drafts after matches of each length are accepted and
draft only where they pay. When the match runs into the present (a loop),
the continuation repeats with the loop's period, as chained lookups would.

Earlier replies can be added as `memory` (separated by -1, which no token
equals, so no match spans two documents): a server asked the same thing
twice then drafts the second reply from the first, as ngram-mod's shared
table does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Optional

SEP = -1  # between documents: matches neither a token nor the bigram index
_CANDIDATES = 12  # most recent occurrences of the bigram that are extended; older ones rarely match longer


class NgramDrafter:
    """The context's tokens, a bigram index over them, and drafts from the longest earlier suffix match."""

    __slots__ = ("toks", "index", "max_match", "is_end")

    def __init__(self, *, max_match: int = 32, is_end: Optional[Callable[[int], bool]] = None) -> None:
        self.toks: list[int] = []
        self.index: dict[int, list[int]] = {}  # bigram key -> positions just after each occurrence
        self.max_match = max_match
        # a token that ends a reply (the model's end-of-generation tokens): a draft stops after it, since
        # nothing past it can be kept. A quote that ends the user's message is followed there by the
        # template's end of turn, and a draft ran on into the next turn's header: a 15-token step that
        # kept 6 on the 1.93B's document reply, ~100 ms lost at every such quote's end.
        self.is_end = is_end

    def reset(self, tokens: Sequence[int], memory: Iterable[Sequence[int]] = ()) -> None:
        self.toks = []
        self.index = {}
        for doc in memory:
            self.extend(doc)
            self.extend((SEP,))
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks, index = self.toks, self.index
        for t in tokens:
            toks.append(t)
            n = len(toks)
            if n >= 2:
                a = toks[n - 2]
                if a != SEP and t != SEP:
                    index.setdefault((a << 32) | t, []).append(n)

    def prefill(self) -> None:
        """Nothing to compute ahead: the table is built as tokens come (a draft model's drafter decodes here)."""

    def push(self, token: int) -> None:
        toks = self.toks
        toks.append(token)
        n = len(toks)
        if n >= 2 and toks[n - 2] != SEP:
            self.index.setdefault((toks[n - 2] << 32) | token, []).append(n)

    def draft(self, k: int) -> tuple[list[int], int]:
        """Up to `k` tokens that followed the longest earlier match of the suffix, and that match's length (0: none)."""
        toks = self.toks
        n = len(toks)
        if k <= 0 or n < 3:
            return [], 0
        where = self.index.get((toks[n - 2] << 32) | toks[n - 1])
        if not where or len(where) < 2:  # the only occurrence is the suffix itself
            return [], 0
        best_p, best_len = -1, 0
        limit = min(self.max_match, n - 1)
        checked = 0
        for idx in range(len(where) - 1, -1, -1):
            p = where[idx]
            if p >= n:
                continue
            # the bigram matched; extend backwards
            m = 2
            while m < limit and p - 1 - m >= 0 and toks[p - 1 - m] == toks[n - 1 - m]:
                m += 1
            if m > best_len:
                best_p, best_len = p, m
                if m >= limit:
                    break
            checked += 1
            if checked >= _CANDIDATES:
                break
        if best_p < 0:
            return [], 0
        period = n - best_p  # how far back the match is: a continuation past the present repeats with this period
        out: list[int] = []
        for j in range(k):
            src = best_p + j
            t = toks[src] if src < n else out[j - period]
            if t == SEP:
                break
            out.append(t)
            if self.is_end is not None and self.is_end(t):
                break
        return out, best_len


__all__ = ["NgramDrafter", "SEP"]
