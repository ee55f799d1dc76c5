"""Issue 27, bad input: every case a 4xx JSON error in OpenAI's shape, the server still serving,
other clients' streams not stalled, and memory flat over 1,000 mixed requests; /metrics counts
tool calls, embeddings and endpoints. One real server (default model, --parallel 4) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from support.helpers import DEFAULT_NAME, register_default
from support.serve_proc import start_serve, stop_process
from support.tool_schemas import function_tool

ADD = function_tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}})
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_gguf):
    home = tmp_path_factory.mktemp("limits-home")
    register_default(default_gguf, home)
    proc, url = start_serve(
        DEFAULT_NAME, "--parallel", "4", "--threads", "1", "--queue", "64", env=dict(os.environ, EDGELLM_HOME=str(home))
    )
    yield proc, url
    stop_process(proc, timeout=20)
    err = proc.stderr.read()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "RecursionError" not in err, err


def _post(url: str, path: str, body, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _openai_error(status: int, body: dict, *, code: str | None = None, param: str | None = None) -> None:
    assert 400 <= status < 500, (status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if code:
        assert body["error"]["code"] == code, body
    if param:
        assert body["error"]["param"] == param, body


BAD = {
    "tool schema is not JSON Schema": (
        {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]},
        "invalid_schema",
        "tools[0].function.parameters",
    ),
    "tool_choice names no tool": (
        {"messages": HI, "tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
        "invalid_value",
        "tool_choice",
    ),
    "tool message without a call": (
        {"messages": HI + [{"role": "tool", "tool_call_id": "call_x", "content": "3"}]},
        "invalid_tool_message",
        "messages[1].tool_call_id",
    ),
    "top_logprobs over 20": ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "invalid_value", "top_logprobs"),
    "50,000-value enum": (
        {
            "messages": HI,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "enum": [f"v{i}" for i in range(50_000)]}},
            },
        },
        "invalid_schema",
        "response_format",
    ),
    "50,000-value enum in a tool": (
        {
            "messages": HI,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"enum": list(range(50_000))}}},
                    },
                }
            ],
        },
        "invalid_schema",
        "tools[0].function.parameters",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_chat_requests_are_400s(served, case):
    _, url = served
    body, code, param = BAD[case]
    status, reply = _post(url, "/v1/chat/completions", body)
    _openai_error(status, reply, code=code, param=param)


def test_embedding_input_over_the_context_names_the_limit(served):
    _, url = served
    status, body = _post(url, "/v1/embeddings", {"input": ["ok", "word " * 1200]})
    _openai_error(status, body, code="context_length_exceeded", param="input")
    assert "1024" in body["error"]["message"] and "input[1]" in body["error"]["message"]
    for empty in ("", [], [""], [[]]):
        _openai_error(*_post(url, "/v1/embeddings", {"input": empty}), param="input")


def test_a_body_nested_200000_deep_is_a_400(served):
    _, url = served
    status, body = _post(url, "/v1/chat/completions", b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    _openai_error(status, body, code="invalid_json")
    assert "nested too deeply" in body["error"]["message"]
    assert _post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})[0] == 200


def test_a_huge_schema_neither_stalls_streams_nor_takes_long(served):
    _, url = served
    gaps: list[float] = []

    def stream() -> None:
        req = urllib.request.Request(
            url + "/v1/completions",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "stream": True}).encode(),
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            last = time.monotonic()
            for line in r:
                if line.startswith(b"data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    body, _, _ = BAD["50,000-value enum"]
    t0 = time.monotonic()
    for _ in range(3):
        status, reply = _post(url, "/v1/chat/completions", body)
        assert status == 400 and "the limit is 1024" in reply["error"]["message"], reply
    refused_in = (time.monotonic() - t0) / 3
    t.join()
    print(
        f"50,000-value enum refused in {refused_in * 1000:.0f} ms; longest gap in the other stream {max(gaps[1:]) * 1000:.0f} ms"
    )
    assert refused_in < 2.0
    assert len(gaps) > 10 and max(gaps[1:]) < 2.0


def _mixed(i: int) -> tuple[str, object, bool]:
    """Request i of the mixed run: (path, body, valid); one in ten valid, every bad kind above among the rest."""
    k = i % 20
    if k < 4 and (i // 20) % 2:
        k = 4 + (i // 40) % 10
    if k == 0:
        return "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "temperature": 0}, True
    if k == 1:
        return "/v1/completions", {"prompt": "One, two,", "max_tokens": 2, "logprobs": 2, "temperature": 0}, True
    if k == 2:
        return "/v1/embeddings", {"input": [f"text {i}", "another"]}, True
    if k == 3:
        return "/api/chat", {"model": DEFAULT_NAME, "messages": HI, "stream": False, "options": {"num_predict": 2}}, True
    bad = [b for b, _, _ in BAD.values()] + [
        b"[" * 5000,
        b"{not json",
        {"messages": HI, "model": "no-such-model"},
        {"messages": HI, "max_tokens": 10_000},
    ]
    if k - 4 < len(bad):
        return "/v1/chat/completions", bad[k - 4], False
    if k == 14:
        return "/v1/embeddings", {"input": "word " * 1200}, False
    return "/api/chat", {"model": "no-such-model", "messages": HI}, False


def test_1000_mixed_requests_keep_memory_flat_and_metrics_count(served):
    proc, url = served
    ps = psutil.Process(proc.pid)

    def run(i: int) -> None:
        path, body, valid = _mixed(i)
        status, reply = _post(url, path, body)
        if valid:
            assert status == 200, (path, reply)
        else:
            assert 400 <= status < 500 and "error" in reply, (path, status, reply)

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(run, range(120)))  # warm-up: model, embedding context, template worker, allocator
    before = ps.memory_info().rss
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(run, range(1000)))
    after = ps.memory_info().rss
    print(
        f"1000 mixed requests in {time.monotonic() - t0:.1f} s; RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB "
        f"({(after - before) / before * 100:+.2f}%)"
    )
    assert after <= before * 1.05
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    assert 'edgellm_endpoint_requests_total{endpoint="/v1/embeddings",status="200"}' in text
    assert 'edgellm_endpoint_requests_total{endpoint="/api/chat",status="404"}' in text
    embedded = [ln for ln in text.splitlines() if ln.startswith("edgellm_embedded_inputs_total{")]
    assert embedded and float(embedded[0].split()[-1]) >= 2 * 1120 // 40
    assert "edgellm_tool_calls_total" in text
