"""Runtime on the real default model: streaming, seeds, cancel, grammar checks, KV types.

One Runtime per module (threads=1: the test machine's cores are shared, and
ggml's spinning thread pool is much slower when oversubscribed).
"""

from __future__ import annotations

import pytest

from edgellm.errors import UsageError
from edgellm.progress import CancelToken
from edgellm.engine.runtime import KV_BYTES_PER_ELEMENT, GenerationStats, Runtime, RuntimeOptions, SamplingParams


@pytest.fixture(scope="module")
def rt(default_gguf):
    r = Runtime(default_gguf, RuntimeOptions(n_ctx=512, n_threads=1))
    yield r
    r.close()


def _prompt(rt, text="Write a sentence about the sea."):
    return rt.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_bos=False)


def test_tokens_arrive_incrementally(rt):
    st = GenerationStats()
    seen_at = []  # generated-token count when each piece reached us
    pieces = []
    for piece in rt.stream(_prompt(rt), SamplingParams(max_tokens=24, seed=5, temperature=0.7), stats=st):
        pieces.append(piece)
        seen_at.append(st.generated_tokens)
    assert len(pieces) > 1
    assert seen_at[0] < st.generated_tokens, "the first piece came only after generation finished"
    assert st.generated_tokens > 1 and st.tokens_per_second > 0
    assert st.evaluated_prompt_tokens + st.reused_tokens == st.prompt_tokens


def test_same_seed_same_reply_and_seeds_differ(rt):
    def reply(seed):
        rt.reset()  # identical KV state: reuse changes the last token's batch shape
        return rt.complete(_prompt(rt, "Invent a name for a cat."), SamplingParams(max_tokens=16, seed=seed, temperature=1.0))[0]

    a, b = reply(11), reply(11)
    assert a == b and a
    others = {reply(s) for s in (12, 13, 14)}
    assert len(others | {a}) > 1, "different seeds never changed the reply"


def test_cancel_stops_and_runtime_stays_usable(rt):
    cancel = CancelToken()
    st = GenerationStats()
    n = 0
    for _ in rt.stream(
        _prompt(rt, "Tell me a long story."), SamplingParams(max_tokens=200, seed=1, temperature=0.8), cancel=cancel, stats=st
    ):
        n += 1
        if n == 3:
            cancel.cancel()
    assert st.stop_reason == "cancelled"
    assert st.generated_tokens <= 4
    text, st2 = rt.complete(_prompt(rt, "Say yes."), SamplingParams(max_tokens=8, seed=1))
    assert st2.generated_tokens > 0 and st2.stop_reason in ("eos", "length")


def test_prompt_longer_than_context(rt):
    with pytest.raises(UsageError, match="context holds 512"):
        list(rt.stream(list(range(100, 700)), SamplingParams(max_tokens=4)))


def test_grammar_checked_by_llama_cpp(rt):
    rt.check_grammar('root ::= "yes" | "no"')
    with pytest.raises(UsageError, match="Undefined rule identifier 'nope'"):
        rt.check_grammar("root ::= nope")
    with pytest.raises(UsageError, match="root"):
        rt.check_grammar('answer ::= "a"')
    from llama_cpp.llama_grammar import LlamaGrammar

    text, st = rt.complete(
        _prompt(rt, "Is water wet?"),
        SamplingParams(max_tokens=8, seed=3, grammar=LlamaGrammar.from_string('root ::= "yes" | "no"')),
    )
    assert text in ("yes", "no")


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_kv_type_memory_matches_llama_cpp(default_gguf, kv_type):
    """The KV bytes we report per kv type are what llama.cpp's own state holds."""
    sizes = {}
    for kt in ("f16", kv_type):
        r = Runtime(default_gguf, RuntimeOptions(n_ctx=256, n_threads=1, kv_type=kt))
        try:
            before = r.state_bytes()
            r.complete(r.tokenize("The quick brown fox jumps over the lazy dog. " * 6), SamplingParams(max_tokens=1, seed=1))
            used = r.state_bytes() - before
            expected = r.kv_cache_bytes(r.n_cached)
            assert expected > 0
            assert abs(used - expected) / expected < 0.01, (kt, used, expected)
            sizes[kt] = expected
            assert r.kv_cache_bytes() == r.info.kv_cache_bytes(256, bytes_per_elem=KV_BYTES_PER_ELEMENT[kt])
        finally:
            r.close()
    assert sizes[kv_type] < sizes["f16"] * 0.6


def test_unknown_kv_type(default_gguf):
    with pytest.raises(UsageError, match="unknown KV cache type"):
        Runtime(default_gguf, RuntimeOptions(kv_type="q3_k"))


def test_text_stream_keeps_characters_whole_and_hides_stop_strings(rt):
    """edgellm's detokenizer: token pieces from llama.cpp, multi-byte characters never split, stop strings never shown."""
    from edgellm.engine.decode import TextStream

    text = "Grüße, 你好 — the end. STOP here"
    tokens = rt.tokenize(text, add_bos=False)
    vocab = rt.llm._model.vocab
    whole = TextStream(vocab)
    pieces = [whole.push(t) for t in tokens] + [whole.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # a split character would show as U+FFFD
    cut = TextStream(vocab, ["STOP", "never"])
    shown = ""
    for t in tokens:
        shown += cut.push(t)
        if cut.stopped:
            break
    assert cut.stopped and shown == "Grüße, 你好 — the end. " and cut.flush() == ""


def test_temperature_zero_is_greedy_and_matches_llama_cpp_argmax(rt):
    """The native sampler chain at temperature 0 picks llama.cpp's argmax (checked on the logits of the first step)."""
    import numpy as np
    import llama_cpp

    rt.reset()
    prompt = _prompt(rt, "Name a colour.")
    text, st = rt.complete(prompt, SamplingParams(temperature=0, max_tokens=1))
    rt.reset()
    from edgellm.engine.decode import Batch, decode_prompt

    b = Batch(64)
    decode_prompt(rt.llm.ctx, b, prompt, 0)
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(rt.llm.ctx, -1), shape=(rt.llm.n_vocab(),))
    b.close()
    rt.reset()
    assert text == rt.detokenize([int(np.argmax(logits))])


@pytest.mark.parametrize("flash_attn", [None, False])
def test_flash_attention_on_by_default_on_the_cpu_and_the_estimate_counts_its_buffer(default_gguf, flash_attn):
    """auto (None) is on where every layer runs on the CPU, as llama.cpp's -fa auto; the estimate's compute
    bytes follow what llama.cpp reserves either way (at ctx 8192 the score buffer is 1.7x the logits')."""
    import re

    r = Runtime(default_gguf, RuntimeOptions(n_ctx=8192, n_threads=1, flash_attn=flash_attn))
    try:
        assert r.flash_attn is (flash_attn is None)
        m = re.search(r"CPU compute buffer size =\s*([0-9.]+) MiB", r.load_log)
        assert m, r.load_log[-2000:]
        reserved = float(m.group(1)) * 2**20
        assert abs(r.memory.compute_bytes - reserved) <= 0.06 * reserved, (r.memory.compute_bytes, reserved)
    finally:
        r.close()
