"""`edgellm serve` through the official `openai` client, on 127.0.0.1, with the real default model.

One server subprocess serves the module (its own EDGELLM_HOME, an ephemeral
port, --api-key, --queue 1, --ctx 1024, --max-loaded 1, --parallel 1,
--threads 1: one thread degrades least when other jobs share the two cores); the shutdown test
starts a second one because it stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema  # the `test` extra: a missing client must fail the run, not skip it
import openai
import pytest

from support.helpers import DEFAULT_NAME, assert_one_line_error
from support.serve_proc import start_serve, stop_process

KEY = "test-key-123"
SECOND = "smollm2-copy"  # the same file under a second store name, to exercise LRU eviction
CTX = 1024
# A schema whose string cannot end early: the grammar keeps a request busy for as long as max_tokens allows.
LONG_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "minLength": 4000}}, "required": ["s"]}


def _register(home: Path, gguf: Path, *names: str) -> None:
    from edgellm.gguf.reader import read_gguf
    from edgellm.models.resolve import record_from_info
    from edgellm.models.store import Store

    info = read_gguf(gguf)
    for name in names:
        Store(home).register(record_from_info(name, info, [str(gguf)], "0" * 64, source="test"))


def _start(home: Path, *args: str) -> tuple[subprocess.Popen, str]:
    return start_serve(*args, env=dict(os.environ, EDGELLM_HOME=str(home)))


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_gguf):
    home = tmp_path_factory.mktemp("serve-home")
    _register(home, default_gguf, DEFAULT_NAME, SECOND)
    proc, url = _start(
        home,
        DEFAULT_NAME,
        "--api-key",
        KEY,
        "--queue",
        "1",
        "--ctx",
        str(CTX),
        "--max-loaded",
        "1",
        "--threads",
        "1",
        "--parallel",
        "1",
    )
    yield url
    stop_process(proc, timeout=20)
    err = proc.stderr.read()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "graceful shutdown exceeded" not in err, err


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _ask(c: openai.OpenAI, q: str, max_tokens: int = 24, **kw):
    """One user message `q` to the default model, greedy: the request most tests here make."""
    return c.chat.completions.create(
        model=DEFAULT_NAME, messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0, **kw
    )


def _raw(url: str, path: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + path, data=body, method="POST" if body is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _assert_error_body(body: dict, *, code: str | None = None, param: str | None = None) -> None:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if code:
        assert err["code"] == code, err
    if param:
        assert err["param"] == param, err


def _template_prompt_tokens(gguf: Path, messages: list[dict]) -> int:
    """Token count of the GGUF's own chat template rendered independently of the server."""
    import llama_cpp
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from edgellm.gguf.reader import read_gguf

    template = read_gguf(gguf).chat_template
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        text = (
            ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            .from_string(template)
            .render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        )
        return len(llm.tokenize(text.encode(), add_bos=False, special=True))
    finally:
        llm.close()


# -- the API -------------------------------------------------------------------


def test_models_list(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {DEFAULT_NAME, SECOND}
    m = models[DEFAULT_NAME]
    assert m.owned_by == "edgellm"
    assert m.model_extra["context_length"] == 8192 and m.model_extra["level"] == "q4_1"


def test_chat_uses_template_and_reports_usage(client, default_gguf):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=DEFAULT_NAME, messages=messages, max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert isinstance(text, str) and text.strip(), r
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == _template_prompt_tokens(default_gguf, messages)
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    t = r.model_extra["timings"]
    assert t["predicted_n"] == r.usage.completion_tokens
    assert t["cache_n"] + t["prompt_n"] == r.usage.prompt_tokens
    assert t["predicted_ms"] > 0 and t["prompt_ms"] > 0

    # The same conversation again: llama.cpp reuses the prompt from the KV cache.
    r2 = client.chat.completions.create(model=DEFAULT_NAME, messages=messages, max_tokens=1, temperature=0)
    assert r2.choices[0].finish_reason == "length" and r2.usage.completion_tokens == 1
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_completion_without_model_uses_the_default(client):
    r = client.completions.create(model="", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.model == DEFAULT_NAME
    assert "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_chat_streaming(client):
    stream = _ask(client, "Write one sentence about the sea.", max_tokens=20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(pieces) >= 3, chunks
    assert len(finals) == 1 and finals[0].usage is not None
    usage = finals[0].usage
    assert len(pieces) <= usage.completion_tokens <= 20
    assert chunks[-1].choices == [] and chunks[-1].usage == usage  # the opt-in usage chunk comes last
    assert all(c.id == chunks[0].id for c in chunks)


def test_completion_streaming(client):
    chunks = list(
        client.completions.create(model=DEFAULT_NAME, prompt="One, two, three,", max_tokens=8, temperature=0, stream=True)
    )
    assert len(chunks) >= 3
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_json_schema_reply_validates(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = _ask(
        client,
        "Describe a person as JSON with a name and an age.",
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop", r
    obj = json.loads(r.choices[0].message.content)
    jsonschema.validate(obj, schema)


def test_json_object_is_json(client):
    r = _ask(client, "Say hi", max_tokens=6, response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith(("{", "["))


def test_bad_json_schema_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=DEFAULT_NAME,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
        )
    _assert_error_body(e.value.response.json(), code="invalid_schema", param="response_format")


def test_wrong_or_missing_key_is_401(server):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    _assert_error_body(e.value.response.json(), code="invalid_api_key")
    status, _, body = _raw(server, "/v1/chat/completions", b'{"messages": []}', key=None)
    assert status == 401
    _assert_error_body(body, code="invalid_api_key")


def test_malformed_json_is_400_and_server_keeps_serving(server, client):
    status, _, body = _raw(server, "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400
    _assert_error_body(body, code="invalid_json")
    assert body["error"]["type"] == "invalid_request_error"
    r = client.chat.completions.create(model=DEFAULT_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    _assert_error_body(e.value.response.json(), code="model_not_found", param="model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="../../etc/passwd", messages=[{"role": "user", "content": "Hi"}])


def test_max_tokens_beyond_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=CTX + 1)
    body = e.value.response.json()
    _assert_error_body(body, code="context_length_exceeded", param="max_tokens")
    assert str(CTX) in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_NAME, prompt="word " * (CTX + 50), max_tokens=1)
    _assert_error_body(e.value.response.json(), code="context_length_exceeded", param="prompt")
    r = client.completions.create(model=DEFAULT_NAME, prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens == 2


def _health(server: str) -> dict:
    return _raw(server, "/health")[2]["models"]


def _wait_for(pred, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_full_queue_is_429_then_cancelled_streams_free_it(server, client):
    def long_stream():
        return client.chat.completions.create(
            model=DEFAULT_NAME,
            messages=[{"role": "user", "content": "Write a long story."}],
            max_tokens=CTX - 100,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": LONG_SCHEMA}},
        )

    first = long_stream()
    next(iter(first))  # running now
    second: dict = {}
    t = threading.Thread(target=lambda: second.setdefault("stream", long_stream()))
    t.start()
    _wait_for(lambda: _health(server)[DEFAULT_NAME]["queued"] == 1, "the second request to be queued")
    with pytest.raises(openai.RateLimitError) as e:  # --queue 1: one running, one waiting, the third is refused
        client.chat.completions.create(model=DEFAULT_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert e.value.status_code == 429
    assert int(e.value.response.headers["retry-after"]) >= 1
    _assert_error_body(e.value.response.json(), code="rate_limit_exceeded")

    # Closing the first stream cancels its generation, so the queued one starts at once.
    t0 = time.monotonic()
    first.close()
    t.join(60)
    assert "stream" in second
    next(iter(second["stream"]))
    second["stream"].close()
    assert time.monotonic() - t0 < 30
    _wait_for(lambda: not _health(server)[DEFAULT_NAME]["busy"], "the cancelled stream to stop")
    r = client.chat.completions.create(model=DEFAULT_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_client_that_gives_up_while_queued_is_never_run(server, client):
    def long_request(c, stream):
        return c.chat.completions.create(
            model=DEFAULT_NAME,
            messages=[{"role": "user", "content": "Write a long story."}],
            max_tokens=900,
            stream=stream,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": LONG_SCHEMA}},
        )

    served = _health(server)[DEFAULT_NAME]["served"]
    first = long_request(client, True)
    next(iter(first))
    impatient = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        long_request(impatient, False)  # queued behind the first, then the client hangs up
    assert _health(server)[DEFAULT_NAME]["queued"] == 1
    first.close()
    # 900 forced tokens would take many seconds; a cancelled job is dropped when its turn comes.
    _wait_for(lambda: (h := _health(server)[DEFAULT_NAME])["queued"] == 0 and not h["busy"], "the queue to drain", timeout=5)
    assert _health(server)[DEFAULT_NAME]["served"] == served + 2


def test_models_load_on_demand_with_lru_eviction(server, client):
    client.completions.create(model=DEFAULT_NAME, prompt="a", max_tokens=1)
    assert [n for n, s in _health(server).items() if s["loaded"]] == [DEFAULT_NAME]
    r = client.completions.create(model=SECOND, prompt="a", max_tokens=1)
    assert r.model == SECOND and r.model_extra["timings"]["load_ms"] > 0
    assert [n for n, s in _health(server).items() if s["loaded"]] == [SECOND]  # --max-loaded 1
    loaded = {m.id: m.model_extra["loaded"] for m in client.models.list().data}
    assert loaded == {DEFAULT_NAME: False, SECOND: True}


# -- process behaviour -----------------------------------------------------------


def test_sigterm_cancels_in_flight_stream_and_exits_cleanly(tmp_path, default_gguf):
    home = tmp_path / "home"
    _register(home, default_gguf, DEFAULT_NAME)
    proc, url = _start(home, DEFAULT_NAME, "--ctx", "512", "--threads", "1", "--parallel", "1")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = c.completions.create(
            model=DEFAULT_NAME,
            prompt="Once",
            max_tokens=400,
            stream=True,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": LONG_SCHEMA}}},
        )
        it = iter(stream)
        next(it)
        proc.send_signal(signal.SIGTERM)
        # The server cancels generation and says why in a last event, which the client raises.
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in it:
                pass
        rc = proc.wait(20)
    finally:
        stop_process(proc, timeout=20)
    err = proc.stderr.read()
    assert rc == 0, err
    assert "Traceback" not in err and "stopped" in err, err


def test_accepted_connections_send_without_waiting_for_an_ack():
    # uvicorn serves on the socket open_socket binds; asyncio turns Nagle off on the connections it
    # accepts only when that socket names TCP. Without it every keep-alive response (the openai and
    # ollama clients keep connections alive) waited ~40 ms for the client's delayed ACK.
    import asyncio
    import socket

    from edgellm.serve.app import open_socket

    async def main() -> int:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def accepted(reader, writer):
            got.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=open_socket("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, w = await asyncio.open_connection("127.0.0.1", port)
        nodelay = await asyncio.wait_for(got, 10)
        w.close()
        server.close()
        return nodelay

    assert asyncio.run(main()) != 0


def test_bind_warning_only_off_loopback_without_key():
    from edgellm.serve.app import bind_warning, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0")
    assert bind_warning("127.0.0.1", None) is None
    assert "api-key" in bind_warning("0.0.0.0", None)
    assert bind_warning("0.0.0.0", "k") is None


def test_cli_errors_are_one_line(cli, default_model):
    res = cli("serve", "no-such-model", "--port", "0")
    assert_one_line_error(res)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        res = cli("serve", DEFAULT_NAME, "--port", str(s.getsockname()[1]))
    assert_one_line_error(res)
    assert "cannot listen" in res.stderr


# -- continuous batching: a second server with 4 slots ---------------------------------

PAR = 4
PAR_CTX = 8192  # 2,048 tokens per slot: room for a 1,000-token system prompt
QUESTIONS = [
    "Write a sentence about the sea.",
    "What is 2+2?",
    "Name three colors.",
    "Tell me about cats.",
    "Why is the sky blue?",
    "Count to five.",
    "What is Python?",
    "Describe a tree.",
    "Give me a fruit.",
    "What is rain?",
]


@pytest.fixture(scope="module")
def batching(tmp_path_factory, default_gguf):
    home = tmp_path_factory.mktemp("serve-par-home")
    _register(home, default_gguf, DEFAULT_NAME)
    proc, url = _start(home, DEFAULT_NAME, "--parallel", str(PAR), "--ctx", str(PAR_CTX), "--threads", "1", "--queue", "64")
    yield proc, url
    stop_process(proc, timeout=20)
    err = proc.stderr.read()
    assert proc.returncode == 0, err
    assert f"{PAR} parallel slots" in err and f"up to {PAR_CTX // PAR} tokens per request" in err, err
    assert "Traceback" not in err, err


def _par_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _concurrently(fns: list) -> list:
    results: list = [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except Exception as e:  # surfaced by the caller's asserts
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def test_batched_replies_equal_one_at_a_time(batching):
    _, url = batching
    c = _par_client(url)
    alone = [_ask(c, q).choices[0].message.content for q in QUESTIONS]
    before = _metrics(url)
    batched = _concurrently([lambda q=q: _ask(c, q) for q in QUESTIONS])
    same = sum(1 for a, r in zip(alone, batched) if not isinstance(r, Exception) and r.choices[0].message.content == a)
    print(f"temperature 0: {same}/10 batched replies equal the one-at-a-time replies")
    assert same >= 9, [(a, getattr(r, "choices", r)) for a, r in zip(alone, batched)]
    # They really ran together: more than one sequence decoded per step on average.
    m = _metrics(url)
    key = f'edgellm_generated_tokens_total{{model="{DEFAULT_NAME}"}}'
    assert m[key] - before[key] == sum(r.usage.completion_tokens for r in batched)


def test_shared_system_prompt_is_served_from_the_prefix_cache(batching):
    _, url = batching
    c = _par_client(url)
    system = " ".join(f"Rule {i}: when asked about topic {i}, answer in one short, polite sentence." for i in range(60))
    rs = [
        c.chat.completions.create(
            model=DEFAULT_NAME,
            max_tokens=4,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        )
        for q in QUESTIONS[:8]
    ]
    assert rs[0].usage.prompt_tokens > 1000
    first_ms = rs[0].model_extra["timings"]["prompt_ms"]
    for r in rs[1:]:
        assert r.usage.prompt_tokens_details.cached_tokens >= 1000, r.usage
        assert r.model_extra["timings"]["prompt_ms"] <= 0.2 * first_ms, (r.model_extra["timings"], first_ms)
    m = _metrics(url)
    assert m[f'edgellm_prefix_cache_hits_total{{model="{DEFAULT_NAME}"}}'] >= 7
    assert m[f'edgellm_cached_prompt_tokens_total{{model="{DEFAULT_NAME}"}}'] >= 7000


def test_a_reused_prefix_gives_the_reply_a_fresh_prompt_gives(batching):
    # ggml tiles the attention of 64+ rows of one sequence and sums fewer row by row: a prompt whose
    # cached prefix was reused and whose last 2 tokens were re-decoded row by row got another reply
    # than the same prompt computed fresh (this summary did, from its 20th token, before `_reuse`
    # re-decoded a tiled tail)
    _, url = batching
    c = _par_client(url)
    passage = (
        "The lighthouse on the northern cape was built in 1821 from granite quarried on the island. For a century its lamp "
        "burned whale oil, then paraffin, and from 1923 electricity brought by a cable laid across the strait. In 1921 a "
        "storm broke the great lens; the town raised the money in a month and rebuilt it in a single summer."
    )
    q = f"Summarize this passage in a few sentences, quoting it where you can:\n\n{passage} (run {time.time()})"
    rs = [_ask_n(c, q, 48) for _ in range(3)]
    first = rs[0].usage.prompt_tokens_details.cached_tokens  # at most the chat template's system prompt, from another slot
    assert rs[0].usage.prompt_tokens >= 64 and first < 40
    assert all(r.usage.prompt_tokens_details.cached_tokens > first for r in rs[1:])
    assert [r.choices[0].message.content for r in rs[1:]] == [rs[0].choices[0].message.content] * 2

    def logprobs(r) -> list[list[float]]:  # every token's top 5, to the bit: a tie need not flip to see the sums differ
        return [[t.logprob for t in tok.top_logprobs] for tok in r.choices[0].logprobs.content]

    assert logprobs(rs[1]) == logprobs(rs[0]) and logprobs(rs[2]) == logprobs(rs[0])


def _berths(place: str, metres: int, step: int, first_hour: int, minutes: str) -> str:
    """A ~700-token system prompt of facts, new to the server's cache (the run's time is in it)."""
    return f"You answer questions about the {place} (run {time.time()}). " + " ".join(
        f"Berth {i} takes ships up to {metres + step * i} metres and opens at {first_hour + i % 5}:{minutes}." for i in range(40)
    )


def _ask_on(c: openai.OpenAI, system: str, q: str):
    """A greedy 24-token reply to `q` under `system`, with its top-5 logprobs."""
    return c.chat.completions.create(
        model=DEFAULT_NAME,
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
    )


def _same_reply(r, fresh) -> None:
    assert r.choices[0].message.content == fresh.choices[0].message.content
    top5 = lambda x: [[t.logprob for t in tok.top_logprobs] for tok in x.choices[0].logprobs.content]  # noqa: E731
    assert top5(r) == top5(fresh)


def test_a_shared_system_prompt_is_reused_up_to_the_last_turn_and_gives_the_fresh_reply(batching):
    # A long prompt's last turn (from the first turn marker in its last MAX_ROW_TAIL tokens) is computed
    # row by row, fresh or reused, so another question on the same system prompt reuses every cell before
    # that turn and decodes only the turn -- and still gets, to the bit, the reply it gets computed fresh
    # (before, it re-decoded a tiled tail of FA_TILE tokens: 4x the turn on the RAG workload)
    c = _par_client(batching[1])
    system = _berths("harbour", 100, 7, 6, "00")
    fresh = _ask_on(c, system, "Which berth takes the longest ship?")
    other = _ask_on(c, system, "When does berth 3 open?")  # reuses the system prompt from `fresh`'s slot
    again = _ask_on(c, system, "Which berth takes the longest ship?")  # its own cells past the system prompt are gone
    for r in (other, again):
        cached, n = r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens
        assert 500 < cached and 2 <= n - cached <= 48, r.usage
    assert fresh.usage.prompt_tokens_details.cached_tokens < 40
    assert again.usage.prompt_tokens_details.cached_tokens == other.usage.prompt_tokens_details.cached_tokens
    _same_reply(again, fresh)


def test_another_question_on_a_system_prompt_reuses_the_turn_opening_it_shares_and_gives_the_fresh_reply(batching):
    # Cells past the last turn's start were computed row by row in the cached prompt too, when its last turn
    # started at the same place: a question sharing its opening ("When does berth ") reuses those cells and
    # decodes only the rest (before, the whole turn), and the reply is still the fresh one to the bit.
    c = _par_client(batching[1])
    system = _berths("port", 120, 9, 5, "30")
    fresh = _ask_on(c, system, "When does berth 14 open?")
    other = _ask_on(c, system, "When does berth 3 open?")
    again = _ask_on(c, system, "When does berth 14 open?")
    assert fresh.usage.prompt_tokens_details.cached_tokens < 40
    for r in (other, again):
        left = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
        assert 1 <= left <= 10, r.usage  # the turn is ~20 tokens; "...berth 3 open?" and the assistant's opening are left
    _same_reply(again, fresh)


def _ask_n(c: openai.OpenAI, q: str, n: int):
    return c.chat.completions.create(
        model=DEFAULT_NAME, max_tokens=n, temperature=0, logprobs=True, top_logprobs=5, messages=[{"role": "user", "content": q}]
    )


def test_requests_arriving_together_compute_their_shared_system_prompt_once(batching):
    # What RAG front ends send: one long system prompt, several clients at once. Without grouping,
    # each of the PAR sequences computes the 1,000 tokens itself; with it, one does and the others copy.
    _, url = batching
    c = _par_client(url)
    system = " ".join(f"Policy {i}: questions on subject {i} get one short, exact sentence." for i in range(60))

    def ask(q: str):
        return c.chat.completions.create(
            model=DEFAULT_NAME,
            max_tokens=8,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        )

    before = _metrics(url)
    together = _concurrently([lambda q=q: ask(q) for q in QUESTIONS[:PAR]])
    assert not [r for r in together if isinstance(r, Exception)], together
    m = _metrics(url)
    key = f'edgellm_cached_prompt_tokens_total{{model="{DEFAULT_NAME}"}}'
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in together)
    assert together[0].usage.prompt_tokens > 1000
    assert cached[0] < 1000 and all(n >= 1000 for n in cached[1:]), cached  # one computed it, the others copied
    assert m[key] - before.get(key, 0) == sum(cached)
    # The copied prefix is the one each would have computed: the same replies one at a time (cached by now).
    alone = [ask(q).choices[0].message.content for q in QUESTIONS[:PAR]]
    assert [r.choices[0].message.content for r in together] == alone


def _stream_text(c: openai.OpenAI, q: str, max_tokens: int, stop_after: int | None = None, on_stop=None) -> str:
    stream = _ask(c, q, max_tokens=max_tokens, stream=True)
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if stop_after is not None and len(pieces) >= stop_after:
                stream.close()  # the client hangs up mid-stream
                on_stop()
                break
    return "".join(pieces)


def test_client_killed_mid_stream_frees_its_sequence_others_unchanged(batching):
    _, url = batching
    c = _par_client(url)
    a, b, k = "Tell me a long story about a dragon.", "Describe the ocean in detail.", "Write a long poem about trees."
    reference = _concurrently([lambda: _stream_text(c, a, 64), lambda: _stream_text(c, b, 64)])
    active = f'edgellm_active_sequences{{model="{DEFAULT_NAME}"}}'
    freed: dict = {}

    def on_stop():
        t0 = time.monotonic()
        while _metrics(url)[active] > 2 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        freed["seconds"] = time.monotonic() - t0
        freed["active"] = _metrics(url)[active]

    texts = _concurrently(
        [
            lambda: _stream_text(c, a, 64),
            lambda: _stream_text(c, b, 64),
            lambda: _stream_text(c, k, 200, stop_after=3, on_stop=on_stop),
        ]
    )
    assert freed["active"] <= 2 and freed["seconds"] < 2, freed  # the others were still running: freed at the next step
    assert texts[:2] == reference, (texts, reference)
    _wait_for(lambda: _metrics(url)[active] == 0, "every sequence to finish")


def _bad_requests(url: str) -> list[tuple[str, bytes, int]]:
    """(what, body, expected status) for each kind of bad request."""
    long_prompt = "word " * (PAR_CTX // PAR + 100)
    chat = lambda **kw: json.dumps({"model": DEFAULT_NAME, "messages": [{"role": "user", "content": "Hi"}], **kw}).encode()
    return [
        ("invalid JSON", b'{"model": "x", "messages": [', 400),
        ("unknown model", json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}).encode(), 404),
        ("max_tokens beyond the context", chat(max_tokens=PAR_CTX), 400),
        (
            "invalid schema",
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
            400,
        ),
        (
            "prompt longer than the context",
            json.dumps({"model": DEFAULT_NAME, "prompt": long_prompt, "max_tokens": 1}).encode(),
            400,
        ),
        ("10 MB body", b'{"prompt": "' + b"x" * (10 * 1024 * 1024) + b'"}', 413),
    ]


def _mixed_round(url: str, n: int, reference: dict) -> list[str]:
    """n requests, every third one bad, eight at a time; returns what went wrong."""
    bad = _bad_requests(url)
    jobs = []
    for i in range(n):
        if i % 3 == 2:
            what, body, status = bad[(i // 3) % len(bad)]
            path = "/v1/completions" if b'"prompt"' in body[:20] or b'"prompt":' in body else "/v1/chat/completions"
            jobs.append((what, path, body, status))
        else:
            q = QUESTIONS[i % 4]
            jobs.append(
                (
                    q,
                    "/v1/chat/completions",
                    json.dumps(
                        {"model": DEFAULT_NAME, "messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0}
                    ).encode(),
                    200,
                )
            )
    problems: list[str] = []

    def one(job):
        what, path, body, status = job
        try:
            got, _, reply = _raw(url, path, body)
        except Exception as e:
            problems.append(f"{what}: {type(e).__name__}: {e}")
            return
        if got != status:
            problems.append(f"{what}: status {got}, expected {status}: {reply}")
        elif status == 200:
            text = reply["choices"][0]["message"]["content"]
            if reference.setdefault(what, text) != text:
                problems.append(f"{what}: {text!r} != {reference[what]!r}")
        else:
            try:
                _assert_error_body(reply)
            except AssertionError as e:
                problems.append(f"{what}: {e}")

    for start in range(0, n, 8):
        _concurrently([lambda j=j: one(j) for j in jobs[start : start + 8]])
    return problems


def test_mixed_valid_and_bad_requests_keep_answers_and_memory(batching):
    """A bounded slice of the 200-request run (scripts/load_test_server.py --mixed 200 does the full one)."""
    import psutil

    proc, url = batching
    reference: dict = {}
    assert _mixed_round(url, 24, reference) == []  # warm-up: every kind once, the model loaded, caches filled
    rss0 = psutil.Process(proc.pid).memory_info().rss
    assert _mixed_round(url, 48, reference) == []
    rss1 = psutil.Process(proc.pid).memory_info().rss
    assert abs(rss1 - rss0) / rss0 <= 0.05, (rss0, rss1)


def test_each_sequence_in_a_batch_keeps_its_own_schema_and_stop_strings(batching):
    """Per-sequence sampler chains: a JSON schema, llama.cpp's JSON grammar and a stop string decoded in one batch."""
    _, url = batching
    c = _par_client(url)
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 20}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    r_schema, r_json, r_stop = _concurrently(
        [
            lambda: _ask(
                c,
                "Name a colour as JSON.",
                max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
            ),
            lambda: _ask(c, "Say hi as JSON.", max_tokens=12, response_format={"type": "json_object"}),
            lambda: _ask(c, "Write two sentences about the sea.", max_tokens=60, stop=["."]),
        ]
    )
    assert r_schema.choices[0].finish_reason == "stop", r_schema
    jsonschema.validate(json.loads(r_schema.choices[0].message.content), schema)
    assert r_json.choices[0].message.content.lstrip().startswith(("{", "["))
    text = r_stop.choices[0].message.content
    assert "." not in text and text.strip() and r_stop.choices[0].finish_reason == "stop", r_stop


def _short_reply(c: openai.OpenAI, **kw):
    return c.chat.completions.create(
        model=DEFAULT_NAME, messages=[{"role": "user", "content": "Say hello."}], max_tokens=40, temperature=0, **kw
    )


@pytest.mark.parametrize("which", ["one slot", "batched"])
def test_ignore_eos_runs_a_reply_to_max_tokens_and_keeps_its_start(which, request):
    # llama-server's `ignore_eos`: what load tests send so that every reply is the same length
    url = request.getfixturevalue("server") if which == "one slot" else request.getfixturevalue("batching")[1]
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    plain = _short_reply(c)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 40, plain
    full = _short_reply(c, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 40, full
    # the same greedy tokens up to where the plain reply ended
    assert full.choices[0].message.content.startswith(plain.choices[0].message.content), (full, plain)


def test_ignore_eos_bad_values_are_400(server):
    chat = lambda **kw: json.dumps({"model": DEFAULT_NAME, "messages": [{"role": "user", "content": "Hi"}], **kw}).encode()
    status, _, body = _raw(server, "/v1/chat/completions", chat(ignore_eos="yes"))
    assert status == 400 and body["error"]["param"] == "ignore_eos", body
    status, _, body = _raw(server, "/v1/chat/completions", chat(ignore_eos=True, response_format={"type": "json_object"}))
    assert status == 400 and "a finished grammar" in body["error"]["message"], body
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    status, _, body = _raw(server, "/v1/chat/completions", chat(ignore_eos=True, tools=[tool]))
    assert status == 400 and body["error"]["param"] == "ignore_eos", body
    status, _, body = _raw(server, "/v1/chat/completions", chat(ignore_eos=True, tools=[tool], tool_choice="none", max_tokens=2))
    assert status == 200, body  # no tool offered: no grammar
    status, _, body = _raw(
        server,
        "/v1/completions",
        json.dumps({"prompt": "Hi", "ignore_eos": True, "response_format": {"type": "json_object"}}).encode(),
    )
    assert status == 400 and body["error"]["param"] == "ignore_eos", body
