"""A smaller model of the same vocabulary as a drafter (`--draft MODEL`), and the check that it may draft.

Its KV cache is kept in step with the target's tokens; each drafted token
comes with the probability the draft model gave it, which
`edgellm.engine.speculative.DraftJudge` prices.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from edgellm.engine.speculative import DraftMismatch


class ModelDrafter:
    """Greedy drafts from a smaller model of the same vocabulary, its KV cache kept in step with the target's tokens."""

    def __init__(self, draft_rt: Any) -> None:
        import llama_cpp  # lazy: llama.cpp loads only when a draft model is used

        self.rt = draft_rt
        self.ctx, self.vocab, self.batch = draft_rt._engine()
        self.greedy = llama_cpp.llama_sampler_init_greedy()
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.conf: list[float] = []
        self.toks: list[int] = []
        self.decode_seconds = 0.0  # one decode of the draft model (running mean): what each drafted token costs

    def reset(self, tokens: Sequence[int], memory: Any = ()) -> None:
        self.toks = list(tokens)

    def push(self, token: int) -> None:
        self.toks.append(token)

    def draft(self, k: int, judge: Optional[Callable[[float], bool]] = None) -> tuple[list[int], int]:
        """Up to `k` greedy tokens; `judge` sees each one's probability and stops the draft by returning False."""
        import llama_cpp

        kv = self.rt._kv
        toks = self.toks
        if len(toks) + k + 1 >= self.rt.n_ctx:
            return [], -1
        t = time.perf_counter()
        caught_up = self._catch_up(len(toks))
        if caught_up <= 2:  # drafting every step, the catch-up is the one decode each drafted token costs
            self._timed(time.perf_counter() - t)
        out: list[int] = []
        b = self.batch
        self.conf = []
        for j in range(k):
            t = int(llama_cpp.llama_sampler_sample(self.greedy, self.ctx, -1))
            if llama_cpp.llama_vocab_is_eog(self.vocab, t):
                break
            out.append(t)
            self.conf.append(self._top_p())
            if j == k - 1 or (judge is not None and not judge(self.conf[-1])):
                break
            b.clear()
            b.add(t, len(kv), 0, True)
            t0 = time.perf_counter()
            if b.decode(self.ctx) != 0:
                break
            self._timed(time.perf_counter() - t0)
            kv.append(t)
        return out, -1

    def _top_p(self) -> float:
        """The probability the draft model gave its greedy token: how sure it was (DraftJudge prices by it)."""
        import llama_cpp
        import numpy as np

        n = self._n_vocab
        lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1), shape=(n,))
        return float(1.0 / np.exp(lg - lg.max()).sum())

    def prefill(self) -> None:
        """Decode the prompt into the draft model's cache now, in the prompt's time, as llama-server decodes
        the draft's prompt beside the target's: in the first draft step it was billed to generation."""
        if len(self.toks) < self.rt.n_ctx:
            self._catch_up(len(self.toks) - 1)

    def _catch_up(self, upto: int) -> int:
        """Make the draft cache hold toks[:upto] (the last of them decoded again, for its logits); the tokens decoded."""
        from edgellm.engine.decode import decode_prompt

        if upto < 1:
            return 0
        toks = self.toks[:upto]
        keep = self.rt.trim_kv(toks)
        decode_prompt(self.ctx, self.batch, toks[keep:], keep)
        self.rt._kv.extend(toks[keep:])
        return upto - keep

    def _timed(self, seconds: float) -> None:
        d = self.decode_seconds
        self.decode_seconds = seconds if d == 0.0 else d + 0.3 * (seconds - d)

    def close(self) -> None:
        import llama_cpp

        if self.greedy:
            llama_cpp.llama_sampler_free(self.greedy)
            self.greedy = None


def check_compatible(target: Any, draft: Any, *, names: tuple[str, str] = ("target", "draft")) -> None:
    """Refuse a draft model whose tokens do not mean the target's: vocabulary type, size, BOS/EOS, token texts.

    Raises `DraftMismatch` naming the first difference (llama.cpp's own check,
    common_speculative_are_compatible, compares the same things).
    """
    import llama_cpp

    vt, vd = target.llm._model.vocab, draft.llm._model.vocab
    a, b = names

    def differ(what: str, x: Any, y: Any) -> None:
        raise DraftMismatch(f"{b} model cannot draft for {a}: {what} differs ({a}: {x}, {b}: {y})")

    for what, fn in (
        ("vocabulary type", llama_cpp.llama_vocab_type),
        ("vocabulary size", llama_cpp.llama_vocab_n_tokens),
        ("BOS token", llama_cpp.llama_vocab_bos),
        ("EOS token", llama_cpp.llama_vocab_eos),
        ("add-BOS flag", llama_cpp.llama_vocab_get_add_bos),
    ):
        x, y = fn(vt), fn(vd)
        if x != y:
            differ(what, x, y)
    buf_t, buf_d = ctypes.create_string_buffer(256), ctypes.create_string_buffer(256)
    for tok in range(int(llama_cpp.llama_vocab_n_tokens(vt))):
        nt = llama_cpp.llama_token_to_piece(vt, tok, buf_t, 256, 0, True)
        nd = llama_cpp.llama_token_to_piece(vd, tok, buf_d, 256, 0, True)
        if nt != nd or buf_t.raw[: max(nt, 0)] != buf_d.raw[: max(nd, 0)]:
            differ(f"token {tok}", buf_t.raw[: max(nt, 0)], buf_d.raw[: max(nd, 0)])


__all__ = ["ModelDrafter", "check_compatible"]
