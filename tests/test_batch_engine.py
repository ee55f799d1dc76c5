"""How the serving engine lays out a decode step (edgellm.engine.batch), on the default model.

llama.cpp puts sequences with their own KV streams in one ubatch only when each
brings the same number of tokens and their ids run on without a gap
(`llama_batch_allocr::split_equal(..., sequential=true)`); otherwise it splits the
decode and passes over the weights once per piece. The engine therefore decodes a
newcomer whose prompt is cached but for its last token as one more row of the
running step, and gives an idle slot between two running ones a throw-away row.
Neither may change a reply: every row under FA_TILE rows is computed as it would be
alone (tests/test_batch_invariance.py), which these tests check end to end.
"""

from __future__ import annotations

import llama_cpp
import pytest

from edgellm.engine.batch import BatchEngine, Sequence
from edgellm.engine.decode import Batch
from edgellm.engine.runtime import Runtime, RuntimeOptions, SamplingParams

# Plain text, no template, no BOS: no two share a first token, so each empty slot is
# picked by age alone and the test knows which slot each prompt lands in.
PROMPTS = [
    "Once upon a time, in a village by the sea, there lived",
    "Water boils at a lower temperature on a mountain because",
    "Here is a list of the planets of the solar system:",
]


@pytest.fixture(scope="module")
def engine(default_gguf):
    r = Runtime(default_gguf, RuntimeOptions(n_ctx=3 * 256, n_threads=1, flash_attn=True))
    eng = BatchEngine(r, 3)
    try:
        yield r, eng
    finally:
        eng.close()
        r.close()


def _seq(rt, text: str, out: list) -> Sequence:
    def emit(kind, value):
        out.append((kind, value))

    return Sequence(rt.tokenize(text, add_bos=False), SamplingParams(temperature=0, max_tokens=24), emit)


def _text(out: list) -> str:
    return "".join(v for k, v in out if k == "text")


def test_a_cached_newcomer_joins_the_running_step_and_an_idle_slot_between_is_padded(engine, monkeypatch):
    rt, eng = engine
    assert eng.invariant, "the host build carries scripts/patches"
    # Alone, one after another: fresh prompts, slots 0, 1, 2 in turn.
    alone = []
    for text in PROMPTS:
        out: list = []
        s = _seq(rt, text, out)
        eng.add(s)
        assert s.slot == len(alone) and s.n_done == 0
        while eng.active():
            eng.step()
        alone.append(_text(out))
    held = [list(c) for c in eng.cached]

    decodes: list[list[tuple[int, int, bool]]] = []  # each llama_decode's rows: (slot, position, logits)
    real = Batch.decode

    def recording(self, ctx):
        decodes.append([(self.seq_id[i][0], self.pos[i], bool(self.logits[i])) for i in range(self.n)])
        return real(self, ctx)

    monkeypatch.setattr(Batch, "decode", recording)

    # Prompts 0 and 2 again (each cached whole in its slot), slot 1 left idle between them.
    outs: list[list] = [[], []]
    first = _seq(rt, PROMPTS[0], outs[0])
    eng.add(first)
    assert first.slot == 0 and first.n_done == len(first.prompt) - 1  # all but the last token reused
    eng.step()
    assert decodes == [[(0, len(first.prompt) - 1, True)]]  # the last prompt token alone gives the first token
    eng.step()
    third = _seq(rt, PROMPTS[2], outs[1])
    eng.add(third)
    assert third.slot == 2 and third.n_done == len(third.prompt) - 1
    decodes.clear()
    eng.step()
    # One decode: slot 0's next token, a throw-away row in idle slot 1 past its cells, slot 2's last prompt token.
    assert decodes == [[(0, len(first.prompt) + 1, True), (1, len(held[1]), False), (2, len(third.prompt) - 1, True)]]
    while eng.active():
        eng.step()
    assert all(len(rows) == 1 or [r[0] for r in rows] == [0, 1, 2] for rows in decodes), decodes
    assert [_text(outs[0]), _text(outs[1])] == [alone[0], alone[2]]
    # The idle slot's cache is what it held: the throw-away rows are gone.
    mem = llama_cpp.llama_get_memory(eng.ctx)
    assert eng.cached[1] == held[1] and llama_cpp.llama_memory_seq_pos_max(mem, 1) == len(held[1]) - 1


def test_a_newcomer_with_more_than_its_last_token_to_compute_gets_a_decode_of_its_own(engine, monkeypatch):
    rt, eng = engine
    decodes: list[list[tuple[int, int, bool]]] = []
    real = Batch.decode

    def recording(self, ctx):
        decodes.append([(self.seq_id[i][0], self.pos[i], bool(self.logits[i])) for i in range(self.n)])
        return real(self, ctx)

    out_a: list = []
    a = _seq(rt, PROMPTS[0], out_a)
    eng.add(a)
    eng.step()
    monkeypatch.setattr(Batch, "decode", recording)
    # Prompt 1 with other words after its cached part: several tokens to compute.
    out_b: list = []
    b = _seq(rt, PROMPTS[1] + " (asked by a child on a rainy Tuesday)", out_b)
    eng.add(b)
    k = len(b.prompt) - b.n_done
    assert k > 1
    eng.step()
    assert len(decodes) == 2 and [r[0] for r in decodes[0]] == [0] and [r[0] for r in decodes[1]] == [b.slot] * k
    while eng.active():
        eng.step()
    # and the reply is the one it gets alone, from a fresh prompt
    while eng._evict_one():
        pass
    alone: list = []
    c = _seq(rt, PROMPTS[1] + " (asked by a child on a rainy Tuesday)", alone)
    eng.add(c)
    assert c.n_done == 0
    while eng.active():
        eng.step()
    assert _text(out_b) == _text(alone) and _text(out_b)
