"""Speculative decoding and adaptive threads (issue 26) on the real default model.

* temperature 0: the reply with `--draft ngram` is token for token the reply without;
* temperature 0.8: the first sampled tokens have the same distribution with and
  without drafts (chi-square), on a prompt whose drafts are accepted;
* the draft length adapts: on open-ended text speculation switches itself off;
* the thread controller's decisions from fed measurements, and one real run
  under a spinning process that moves to 1 thread.

Flash attention is on wherever replies are compared: its CPU kernel computes
each query row on its own, so a verify batch rounds as single-token decodes
do (without it, batched verification changes a near-tie greedy choice in
about half of these replies; see docs/chat.md), once edgellm's switch keeps a
lone row from splitting its cells over the threads (past 512 cells, at 2+
threads: the two tests at 2 threads below).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import llama_cpp
import numpy as np
import pytest

from edgellm.engine import backends
from edgellm.engine.ngram import NgramDrafter
from edgellm.engine.runtime import GenerationStats, Runtime, RuntimeOptions, SamplingParams
from edgellm.engine.speculative import FA_TILE, DraftJudge, DraftMismatch, DraftPolicy, Speculator, VerifyCost
from edgellm.engine.threads import ThreadController
from support.stats import chi_square_p

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
"""
PASSAGE = (
    "The lighthouse stood on the northern cape for two hundred years. Its keeper, Ada Moss, "
    "wrote in her log every night: 'The light is lit, the sea is calm, and the ships are safe.' "
    "In 1921 a storm broke the lens, and the town rebuilt it in a single summer."
)
REPEAT = "Repeat this line exactly:\nThe quick brown fox jumps over the lazy dog and runs into the forest.\n"


@pytest.fixture(scope="module")
def rt(default_gguf):
    r = Runtime(default_gguf, RuntimeOptions(n_ctx=2048, n_threads=1, flash_attn=True))
    yield r
    r.close()


def _cheap_verify(rt):
    """Verify steps priced as on a machine where a batch costs little more than a token (this one,
    shared, measures anything): the policy then drafts whenever drafts are accepted, which is what
    the identity and distribution tests need to exercise."""
    rt.verify_cost = VerifyCost(t1=1.0, tn={2: 1.0}, frozen=True)


def _chat(rt, text):
    return rt.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_bos=False)


def _reply(rt, prompt, **kw):
    st = GenerationStats()
    rt.reset()
    text = "".join(rt.stream(prompt, SamplingParams(**kw), stats=st))
    return text, list(rt.cached_tokens()[len(prompt) :]), st


# -- pure parts -----------------------------------------------------------------


def test_ngram_drafter_continues_the_longest_earlier_match_and_loops():
    d = NgramDrafter()
    d.reset([1, 2, 3, 4, 5, 9, 9, 2, 3, 4])
    draft, m = d.draft(3)
    assert draft == [5, 9, 9] and m == 3  # "2 3 4" matched, what followed it
    d.reset([7, 1, 2, 1, 2])  # a loop: past the present the draft repeats with its period
    assert d.draft(5) == ([1, 2, 1, 2, 1], 2)
    d.reset([1, 2, 3])
    assert d.draft(4) == ([], 0)
    d.reset([5, 6], memory=[[1, 2, 3, 4]])  # earlier replies are drafted from too
    d.extend([1, 2])
    assert d.draft(2)[0] == [3, 4]
    # nothing past a token that ends the reply can be kept: a quote that ended the user's turn is
    # drafted up to the turn's end, not on into the next turn's header
    eos = 9
    d = NgramDrafter(is_end=lambda t: t == eos)
    d.reset([1, 2, 3, 4, eos, 7, 8, 5, 1, 2])
    assert d.draft(8) == ([3, 4, eos], 2)


def record(p: DraftPolicy, match_len: int, accepted: int, rejected: bool) -> None:
    """An n-gram draft from a `match_len` match resolved as its shadow counts it: `accepted` tokens right,
    then a wrong one if `rejected`."""
    p.record_buckets([p.position_bucket(match_len, j) for j in range(accepted + 1)], accepted, rejected)


def test_policy_drafts_long_when_drafts_are_right_and_not_at_all_when_wrong():
    p = DraftPolicy(cost=VerifyCost())
    for _ in range(6):
        record(p, 3, 20, True)  # 20 accepted, then a miss: 95 %
    assert p.choose(3, 40) >= 12
    q = DraftPolicy(cost=VerifyCost())
    for _ in range(6):
        record(q, 0, 1, True)  # one in two
    assert q.choose(0, 40) == 0
    # verifying measured as cheap here makes shorter, less certain drafts pay
    cheap = VerifyCost()
    cheap.observe(1, 0.010)
    cheap.observe(5, 0.011)
    assert cheap.ratio(5) == pytest.approx(1.1) and q.__class__(cost=cheap, hits=q.hits, misses=q.misses).choose(0, 40) > 0


def test_a_draft_model_stops_drafting_where_it_is_unsure_and_goes_on_where_it_is_sure():
    # the 135M drafting for its 1.93B widening: its sure tokens are nearly always right, its unsure
    # ones often wrong. Priced by place in the draft instead, it drafted 11-15 a step and lost them all
    # when the first token was an unsure one (0 of 15 after a 0.12).
    cost = VerifyCost(t1=1.0, tn={n: 1.0 + 0.1 * (n - 1) for n in range(2, 18)}, frozen=True)  # memory-bound: rows cheap
    p = DraftPolicy(cost=cost, draft_cost=0.08)
    sure, unsure = p.conf_bucket(0.99), p.conf_bucket(0.2)
    assert sure != unsure and p.conf_bucket(0.0) == unsure and p.conf_bucket(1.0) == sure
    for _ in range(12):
        p.record_buckets([sure, sure, sure, unsure], 3, True)  # three sure ones right, the unsure one wrong
    assert p.acceptance(sure) > 0.95 and p.acceptance(unsure) < 0.2

    def judged(confs):
        j = DraftJudge(p)
        seen = 0
        for c in confs:
            seen += 1
            if not j(c):
                break
        return j.best_k, seen

    best, seen = judged([0.99, 0.99, 0.2, 0.99, 0.99])
    assert best == 2 and seen == 3  # cut before the unsure token, and no token drafted past it
    best, seen = judged([0.99] * 16)
    assert best >= 12  # where every token is sure, long drafts pay (rows are cheap here)
    assert judged([0.2])[0] == 0  # an unsure first token: no draft, a plain step
    # where verifying is dear, the same sure tokens are drafted in short steps
    dear = DraftPolicy(cost=VerifyCost(t1=1.0, tn={2: 1.5, 3: 1.65, 4: 1.9, 5: 2.7}, frozen=True), draft_cost=0.1)
    dear.hits, dear.misses = p.hits, p.misses
    j = DraftJudge(dear)
    for _ in range(5):
        if not j(0.99):
            break
    assert j.best_k == 3  # 4 rows cost 1.9 steps, 5 cost 2.7: not worth a fourth token


def test_a_copy_of_the_prompt_turns_drafting_on_while_it_is_being_copied():
    # a reply that starts copying an 80-token passage of its prompt: the shadow draft from the first
    # 2-token match is right token after token, and those tokens teach the longer-match buckets
    # the copy is now in. Counted per draft's starting match instead, the copy ran 53 tokens
    # before the first draft (the shadow had to end before its 48 tokens taught anything).
    passage = list(range(100, 180))
    d = NgramDrafter()
    d.reset([1, 2, *passage, 3, 4])
    sp = Speculator(d, cost=VerifyCost(frozen=True))  # verify priced as llama-bench measured it
    first = None
    for i, t in enumerate(passage):
        sp.push(t)
        if sp.propose(48):
            first = i + 1
            break
    assert first is not None and first <= 12, first
    # and a 2-token match on its own is not trusted: a fresh policy declines it
    assert DraftPolicy(cost=VerifyCost(frozen=True)).choose(2, 48) == 0


def test_a_copy_drafts_long_as_soon_as_its_shorter_matches_were_right():
    # the same copy, generated: each draft is verified against the reply, its accepted tokens and the
    # next one pushed. The shadow follows the copy through the verified drafts, and a longer match's
    # bucket borrows the shorter one's record until it has its own, so the draft after the first is
    # long. With one-in-two for every unseen bucket and shadows dropped while drafting, the copy took
    # drafts of 1, 2, 1, 2, 3 tokens before its first long one (21 steps for 80 tokens).
    passage = list(range(100, 180))
    d = NgramDrafter()
    d.reset([1, 2, *passage, 3, 4])
    sp = Speculator(d, cost=VerifyCost(frozen=True))
    reply = [*passage, 7, 8, 9]
    i, steps, drafts = 0, 0, []
    while i < len(passage):
        sp.push(reply[i])
        i += 1
        steps += 1
        draft = sp.propose(48)
        if draft:
            acc = 0
            while acc < len(draft) and reply[i + acc] == draft[acc]:
                acc += 1
            for t in draft[:acc]:
                sp.push(t)
            i += acc
            drafts.append(len(draft))
            sp.verified(len(draft), acc, acc < len(draft), 0.1)
    assert len(drafts) >= 2 and drafts[1] >= 12, drafts
    assert steps <= 12, (steps, drafts)
    # and where short matches were wrong, the longer buckets inherit that distrust, not one in two
    q = DraftPolicy(cost=VerifyCost(frozen=True))
    for _ in range(6):
        record(q, 2, 0, True)
    assert q.acceptance(q.bucket(8)) < 0.3 and q.choose(8, 48) == 0


def test_verify_cost_keeps_a_sizes_cheapest_first_steps_and_interpolates_between_measured_sizes():
    c = VerifyCost()
    c.observe(1, 0.100)
    for sec in (0.914, 0.472, 0.480):  # a size's first step pays one-off costs (a 1.93B Q8_0, measured)
        c.observe(5, sec)
    assert c.tn[5] == 0.472  # kept in a running mean, 0.914 priced 5-token steps out for good
    c.observe(3, 0.200)
    # 4 tokens lie between two measured sizes: the line between them; once tried, measured
    assert c.ratio(4) == pytest.approx(3.36) and c.ratio(3) == pytest.approx(2.0) and c.ratio(5) == pytest.approx(4.72)
    c.observe(4, 0.205)
    assert c.ratio(4) == pytest.approx(2.05)


def test_a_draft_model_is_tried_early_and_priced_by_its_own_decodes():
    class SlowCatchUp:
        """A draft model's interface; each draft first catches up on the target's tokens (slow), then
        decodes its own: one of those is what a drafted token costs."""

        decode_seconds = 0.0
        conf: list[float] = []

        def push(self, token):
            pass

        def draft(self, k, judge=None):
            time.sleep(0.05)
            self.decode_seconds = 0.01
            self.conf = []
            for _ in range(k):
                self.conf.append(0.99)
                if judge is not None and not judge(0.99):
                    break
            return [7] * len(self.conf), -1

    sp = Speculator(SlowCatchUp(), cost=VerifyCost())
    assert sp.propose(48) == []  # the first step is plain: it prices a step
    sp.plain(0.100)
    d = sp.propose(48)
    assert len(d) == 3  # then a probe of llama-server's length, not after probe_every plain steps
    assert sp.policy.draft_cost == pytest.approx(0.1)  # one draft decode / one target step, not the catch-up
    sp.verified(3, 3, False, 0.05 + 0.20)  # the step's seconds include making the draft
    assert sp.policy.cost.tn[4] == pytest.approx(0.20, abs=0.01)
    # then drafts as long as the judge finds worth it, the sure tokens' acceptance learned from the probe
    d = sp.propose(48)
    assert 3 <= len(d) < 48 and sp.buckets == [sp.policy.conf_bucket(0.99)] * len(d)


def test_thread_controller_follows_the_load_and_the_measured_token_times():
    c = ThreadController(2)
    assert c.threads == 2
    assert c.observe(0.006, 0.05, now=0.0) == 2  # idle: every core
    assert c.observe(0.018, 0.70, now=0.3) == 1  # another process took a core: 2 threads ran at a third
    assert c.observe(0.0065, 0.98, now=0.6) == 1  # 1 thread is faster than the 2 were: kept
    assert c.observe(0.0064, 1.0, now=0.9) == 1
    assert c.observe(0.0064, 0.02, now=1.2) == 2  # the load went: probe one more
    assert c.observe(0.0058, 0.03, now=1.5) == 2  # faster: kept
    assert [d.reason for d in c.history] == ["start", "load", "probe-up", "kept"]
    # a probe up that is slower goes back, and the next probe waits twice as long
    c = ThreadController(2, threads=1)
    assert c.observe(0.007, 0.0, now=0.0) == 2
    assert c.observe(0.009, 0.0, now=0.3) == 1
    assert c.observe(0.007, 0.0, now=1.0) == 1  # within the 2 s back-off
    assert c.observe(0.007, 0.0, now=2.4) == 2
    assert c.observe(0.009, 0.0, now=2.7) == 1
    assert c.observe(0.007, 0.0, now=5.0) == 1  # the back-off is now 4 s
    # a move down that made tokens slower is undone and not repeated at once
    c = ThreadController(4)
    assert c.observe(0.010, 1.5, now=0.0) == 2
    assert c.observe(0.013, 1.5, now=0.3) == 4
    assert c.observe(0.010, 1.5, now=0.6) == 4
    # never above the physical cores, never below 1
    c = ThreadController(2)
    assert c.observe(0.01, 0.0, now=0.0) == 2 and c.free_cores(5.0) == 1


# -- the real model -----------------------------------------------------------------

IDENTITY_PROMPTS = [
    "Rewrite this Python code with the variable `items` renamed to `products`. Output only the code.\n\n" + CODE,
    "Summarize this passage in two sentences, quoting the keeper's log:\n\n" + PASSAGE,
    "Answer from this document only: when was the lens rebuilt?\n\n" + PASSAGE,
    "Write a short poem about the sea.",
]


def test_temperature_zero_reply_is_identical_with_and_without_drafts(rt):
    _cheap_verify(rt)
    accepted = 0
    for text in IDENTITY_PROMPTS:
        prompt = _chat(rt, text)
        plain, plain_toks, st0 = _reply(rt, prompt, temperature=0, max_tokens=96)
        spec, spec_toks, st1 = _reply(rt, prompt, temperature=0, max_tokens=96, draft="ngram")
        assert spec_toks == plain_toks and spec == plain, text[:40]
        assert st0.draft_tokens == 0 and st1.draft == "ngram"
        assert st1.draft_accepted <= st1.draft_tokens
        accepted += st1.draft_accepted
    assert accepted > 40  # the rewrite and the quotes were drafted and accepted


def test_a_lone_token_and_the_same_token_in_a_verify_batch_get_the_same_logits(default_gguf):
    # 600 cached cells at 2 threads: past the 512 where stock ggml splits a lone row's attention over
    # the threads (another summation order than a batch row's), so without edgellm's switch the two
    # rows differ in their last bits on any CPU; this is what makes drafts lossless on long prompts
    r = Runtime(default_gguf, RuntimeOptions(n_ctx=1024, n_threads=2, flash_attn=True, logits_all=True))
    try:
        assert backends.keep_batch_invariant(FA_TILE)
        prompt = r.tokenize("Rewrite this code.\n\n" + CODE * 8)[:600]
        assert len(prompt) == 600
        t, u = r.tokenize(" subtotal tax", add_bos=False)[:2]
        llm = r.llm

        def first_row() -> np.ndarray:  # the logits of the last decode's first token, read as the engine reads them
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, 0), shape=(llm.n_vocab(),)).copy()

        llm.reset()
        llm.eval(prompt)
        llm.eval([t])  # the lone decode
        alone = first_row()
        llm.n_tokens = 600  # eval() drops the cells from n_tokens on
        llm.eval([t, u])  # t as the first row of a two-row verify batch
        in_batch = first_row()
        assert np.array_equal(alone, in_batch), float(np.abs(alone - in_batch).max())
    finally:
        r.close()


def test_long_prompt_at_two_threads_is_identical_with_and_without_drafts(default_gguf):
    # the rewrite with the code six times (547 tokens): before the switch its reply at 2 threads
    # differed from the 45th token on with drafts (docs/chat.md)
    r = Runtime(default_gguf, RuntimeOptions(n_ctx=2048, n_threads=2, flash_attn=True))
    try:
        _cheap_verify(r)
        prompt = _chat(r, IDENTITY_PROMPTS[0].replace(CODE, CODE * 6))
        assert len(prompt) > 520
        plain, plain_toks, _ = _reply(r, prompt, temperature=0, max_tokens=96)
        spec, spec_toks, st = _reply(r, prompt, temperature=0, max_tokens=96, draft="ngram")
        assert st.draft_accepted > 10
        assert spec_toks == plain_toks and spec == plain
    finally:
        r.close()


def test_temperature_08_first_tokens_follow_the_same_distribution(rt):
    _cheap_verify(rt)
    prompt = _chat(rt, REPEAT)
    # one longer reply first: the runtime learns that drafts after this prompt's matches are accepted
    _, _, warm = _reply(rt, prompt, temperature=0.8, seed=1, max_tokens=48, draft="ngram")
    n_pos, runs = 5, 60
    plain = [Counter() for _ in range(n_pos)]
    spec = [Counter() for _ in range(n_pos)]
    drafted = accepted = 0
    for seed in range(runs):
        for arm, extra in ((plain, {}), (spec, {"draft": "ngram"})):
            s = seed if arm is plain else seed + 10_000  # disjoint seeds: a test of distributions, not of identity
            st = GenerationStats()  # no reset: the prompt stays in the KV cache between runs
            "".join(rt.stream(prompt, SamplingParams(temperature=0.8, seed=s, max_tokens=n_pos, **extra), stats=st))
            toks = rt.cached_tokens()[len(prompt) :]
            for i, t in enumerate(toks[:n_pos] + [-1] * (n_pos - len(toks))):
                arm[i][t] += 1
            if extra:
                drafted += st.draft_tokens
                accepted += st.draft_accepted
    assert accepted >= runs  # drafts were verified and accepted in the positions tested
    for i in range(1, n_pos):  # position 0 comes from the prompt's logits, never from a draft
        p = chi_square_p(plain[i], spec[i])
        assert p > 0.01, (i, p, plain[i].most_common(4), spec[i].most_common(4))


def test_speculation_switches_itself_off_on_open_ended_text(rt):
    # first a prompt whose drafts are accepted, so that speculation is on when the story starts
    _cheap_verify(rt)
    _, _, warm = _reply(rt, _chat(rt, REPEAT), temperature=0, max_tokens=24, draft="ngram")
    assert warm.draft_accepted > 0
    rt.verify_cost = VerifyCost(frozen=True)  # verifying priced as llama-bench measured it (pp8 = 4.9 tokens' time)
    prompt = _chat(rt, "Write a short story about a fox who learns to sail.")
    text, toks, st = _reply(rt, prompt, temperature=0.9, seed=7, max_tokens=160, draft="ngram")
    # how often a draft was on offer: the n-gram drafter run over the same tokens
    d = NgramDrafter()
    d.reset(prompt)
    offered = 0
    for t in toks:
        d.push(t)
        offered += bool(d.draft(8)[0])
    assert offered >= 15, offered  # plenty of bigram matches to draft from
    assert st.draft_steps <= max(3, offered // 4), (st.draft_steps, offered)
    assert st.draft_tokens - st.draft_accepted <= 40  # little verify work wasted on rejected drafts


def test_a_model_of_another_vocabulary_is_refused_naming_the_difference(rt, tiny_f32):
    other = Runtime(tiny_f32, RuntimeOptions(n_ctx=256, n_threads=1))
    try:
        with pytest.raises(DraftMismatch, match="differs"):
            rt.attach_draft(other)
    finally:
        other.close()


def test_a_draft_model_drafts_losslessly(default_gguf, rt):
    draft = Runtime(default_gguf, RuntimeOptions(n_ctx=2048, n_threads=1, flash_attn=True))
    try:
        rt.attach_draft(draft)
        _cheap_verify(rt)
        prompt = _chat(rt, IDENTITY_PROMPTS[1])
        plain, _, _ = _reply(rt, prompt, temperature=0, max_tokens=48)
        spec, _, st = _reply(rt, prompt, temperature=0, max_tokens=48, draft="model")
        assert spec == plain
        assert st.draft_steps > 0 and st.draft_accepted > 0.8 * st.draft_tokens  # the same model agrees with itself
    finally:
        rt.attach_draft(None)
        draft.close()


def test_chat_json_reports_drafts_and_threads(cli, default_model):
    args = ["chat", default_model.name, "-p", REPEAT, "--temperature", "0", "--max-tokens", "40", "--json", "--no-history"]
    base = cli(*args, "--flash-attn", "on", "--threads", "1")
    spec = cli(*args, "--draft", "ngram")
    assert base.exit_code == 0 and spec.exit_code == 0, spec.stderr
    b, s = base.json(), spec.json()
    assert s["reply"] == b["reply"]
    assert s["draft"] == {"mode": "ngram", "model": None} and s["stats"]["draft"] == "ngram"
    assert s["stats"]["draft_accepted"] <= s["stats"]["draft_tokens"]
    assert b["threads"] == {"now": 1, "pinned": True} and s["threads"]["pinned"] is False
    bad = cli(*args, "--draft", "no-such-model")
    assert bad.exit_code != 0 and "error:" in bad.stderr


def test_threads_drop_to_one_while_another_process_spins(default_gguf):
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        r = Runtime(default_gguf, RuntimeOptions(n_ctx=512))
        try:
            if r.n_threads < 2:
                pytest.skip("one physical core: nothing to adapt")
            st = GenerationStats()
            prompt = _chat(r, "Write a long story about a dragon.")
            "".join(r.stream(prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=120), stats=st))
            moves = [(d.threads, d.reason) for d in r.governor().controller.history]
            assert (1, "load") in moves, moves
        finally:
            r.close()
    finally:
        spin.kill()
        spin.wait()


def test_batched_sequences_speculate_inside_the_batch_losslessly(default_gguf, monkeypatch):
    from edgellm.engine.batch import BatchEngine, Sequence

    r = Runtime(default_gguf, RuntimeOptions(n_ctx=2048, n_threads=1, flash_attn=True))
    try:
        eng = BatchEngine(r, 2)
        eng.verify_cost = VerifyCost(t1=1.0, tn={2: 1.0}, frozen=True)
        prompts = [_chat(r, IDENTITY_PROMPTS[1]), _chat(r, REPEAT)]
        rooms: list[tuple[int, int]] = []  # (sequences generating, drafted tokens one of them may add to the step)
        propose = Speculator.propose

        def recording(self, room):
            rooms.append((sum(1 for s in eng.slots if s is not None and s.last >= 0), room))
            return propose(self, room)

        monkeypatch.setattr(Speculator, "propose", recording)

        def run(draft: str) -> list[tuple[str, GenerationStats]]:
            out: list[list] = [[], []]
            seqs = []
            for i, p in enumerate(prompts):

                def emit(kind, value, i=i):
                    out[i].append((kind, value))

                seqs.append(Sequence(p, SamplingParams(temperature=0, max_tokens=48, draft=draft), emit))
            for s in seqs:
                eng.add(s)
            while eng.active():
                eng.step()
            return [("".join(v for k, v in o if k == "text"), o[-1][1]) for o in out]

        plain, spec = run("off"), run("ngram")
        assert [t for t, _ in spec] == [t for t, _ in plain]
        assert sum(st.draft_accepted for _, st in spec) > 10 and eng.drafts.accepted == sum(st.draft_accepted for _, st in spec)
        assert eng.drafts.drafted == sum(st.draft_tokens for _, st in spec) and eng.drafts.steps > 0
        # a step's rows stay under FA_TILE in all, where each is computed as it would be alone
        assert max(n for n, _ in rooms) == 2 and all(n * (1 + room) < FA_TILE for n, room in rooms), rooms
    finally:
        r.close()


def test_serve_draft_default_per_request_field_and_llamacpp_counters(tmp_path, default_gguf):
    import json
    import os
    import urllib.error
    import urllib.request

    from support.helpers import DEFAULT_NAME, register_default
    from support.serve_proc import start_serve, stop_process

    home = tmp_path / "serve-home"
    register_default(default_gguf, home)
    proc, url = start_serve(
        DEFAULT_NAME,
        "--draft",
        "ngram",
        "--parallel",
        "2",
        "--ctx",
        "2048",
        "--threads",
        "1",
        env=dict(os.environ, EDGELLM_HOME=str(home)),
    )
    try:

        def ask(**extra):
            body = json.dumps(
                {
                    "model": DEFAULT_NAME,
                    "messages": [{"role": "user", "content": IDENTITY_PROMPTS[1]}],
                    "max_tokens": 64,
                    "temperature": 0,
                    **extra,
                }
            ).encode()
            req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                j = json.load(r)
            timings.append(j["timings"])
            return j["choices"][0]["message"]["content"]

        timings: list[dict] = []
        assert ask() == ask(draft="off")  # the server default drafts; the field turns it off; same reply
        assert "draft_n" in timings[0] and "draft_n" not in timings[1]
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        vals = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("llamacpp:")}
        drafted, accepted = (
            vals["llamacpp:spec_decode_num_draft_tokens_total"],
            vals["llamacpp:spec_decode_num_accepted_tokens_total"],
        )
        assert 0 <= accepted <= drafted and "llamacpp:spec_decode_num_drafts_total" in vals
        # the reply's own counters are the server's: a reply that ends inside a verify step counts that step too
        assert (timings[0]["draft_n"], timings[0]["draft_n_accepted"]) == (drafted, accepted)
        assert sum(v for k, v in vals.items() if "per_pos" in k) == accepted  # per position adds up, as llama-server's does
        # a draft length past the verify step llama.cpp sums as it sums one token: a 400 naming the limit
        req = urllib.request.Request(
            url + "/v1/chat/completions",
            json.dumps({"model": DEFAULT_NAME, "messages": [{"role": "user", "content": "hi"}], "draft_max": 100}).encode(),
            {"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(req, timeout=30)
        err = json.load(bad.value)["error"]
        assert bad.value.code == 400 and err["param"] == "draft_max" and "between 0 and 62" in err["message"], err
    finally:
        stop_process(proc, timeout=20)
