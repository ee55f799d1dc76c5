"""Issue 27: Ollama's API on `edgellm serve`, through the official `ollama` Python client
(OLLAMA_HOST pointing at the server on 127.0.0.1, the real default model), and its errors
in Ollama's shape."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import jsonschema
import ollama
import pytest

from support.helpers import DEFAULT_NAME, register_default
from support.serve_proc import start_serve, stop_process
from support.tool_schemas import function_tool

TAGGED = DEFAULT_NAME + ":latest"
WEATHER = function_tool(
    "get_weather", {"city": {"type": "string", "maxLength": 40}}, description="Get the current weather in a city", closed=True
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_gguf):
    home = tmp_path_factory.mktemp("ollama-home")
    register_default(default_gguf, home)
    proc, url = start_serve(DEFAULT_NAME, "--parallel", "2", "--threads", "1", env=dict(os.environ, EDGELLM_HOME=str(home)))
    yield url
    stop_process(proc, timeout=20)
    err = proc.stderr.read()
    assert proc.returncode == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def client(server, monkeypatch_module):
    monkeypatch_module.setenv("OLLAMA_HOST", server)
    return ollama.Client()  # reads OLLAMA_HOST, as every Ollama client does


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_list_show_version(client, server):
    names = [m.model for m in client.list().models]
    assert TAGGED in names
    m = next(m for m in client.list().models if m.model == TAGGED)
    assert m.size > 50_000_000 and m.details.format == "gguf" and m.details.quantization_level == "Q4_1"
    info = client.show(TAGGED)
    assert info.details.family == "llama" and "tools" in info.capabilities
    assert info.modelinfo["llama.context_length"] == 8192
    assert "im_start" in info.template
    with urllib.request.urlopen(server + "/api/version") as r:
        assert json.loads(r.read())["version"]


def test_chat_whole_and_streamed(client):
    msgs = [{"role": "user", "content": "Name a colour."}]
    opts = {"temperature": 0, "num_predict": 12, "seed": 1}
    r = client.chat(model=TAGGED, messages=msgs, options=opts, stream=False)
    assert r.done and r.done_reason in ("stop", "length") and r.message.role == "assistant" and r.message.content
    assert 1 <= r.eval_count <= 12 and r.prompt_eval_count > 0 and r.eval_duration > 0
    parts = list(client.chat(model=DEFAULT_NAME, messages=msgs, options=opts, stream=True))
    assert len(parts) >= 3 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == r.message.content  # temperature 0: the same reply
    assert parts[-1].eval_count == r.eval_count


def test_a_num_ctx_beyond_the_slot_is_said(server):
    body = {
        "model": TAGGED,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": False,
        "options": {"num_predict": 2, "num_ctx": 32768},
    }
    status, reply = _post(server, "/api/chat", json.dumps(body).encode())
    assert status == 200 and "num_ctx 32768" in reply["warnings"][0], reply  # not applied, and said so


def test_generate_and_format_schema(client):
    g = client.generate(model=TAGGED, prompt="What is the capital of France?", options={"temperature": 0, "num_predict": 16})
    assert g.done and g.response.strip() and g.eval_count <= 16  # through the chat template, as Ollama does
    raw = client.generate(model=TAGGED, prompt="The capital of France is", raw=True, options={"temperature": 0, "num_predict": 6})
    assert "Paris" in raw.response and raw.eval_count == 6 and raw.done_reason == "length"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
    c = client.chat(
        model=TAGGED,
        messages=[{"role": "user", "content": "Give a name as JSON."}],
        format=schema,
        options={"temperature": 0, "num_predict": 40},
    )
    jsonschema.validate(json.loads(c.message.content), schema)


def test_embed_and_ps(client):
    e = client.embed(model=TAGGED, input=["first text", "second text"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == 576
    assert abs(sum(x * x for x in e.embeddings[0]) - 1) < 1e-5 and e.prompt_eval_count > 2
    running = client.ps().models
    assert [m.model for m in running] == [TAGGED] and running[0].size > 0


def test_chat_with_tools_returns_parsed_calls_and_takes_the_result(client):
    msgs = [{"role": "user", "content": "Use the get_weather tool to get the weather in Rome."}]
    r = client.chat(model=TAGGED, messages=msgs, tools=[WEATHER], options={"temperature": 0, "num_predict": 80})
    calls = r.message.tool_calls
    assert calls and calls[0].function.name == "get_weather", r
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER["function"]["parameters"])
    history = msgs + [r.message, {"role": "tool", "content": '{"sky": "clear", "temperature": 21}', "tool_name": "get_weather"}]
    r2 = client.chat(model=TAGGED, messages=history, options={"temperature": 0, "num_predict": 40})
    assert r2.message.content and not r2.message.tool_calls


def _post(server: str, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(server + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_errors_in_ollamas_shape(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    status, body = _post(server, "/api/chat", b'{"model": "' + DEFAULT_NAME.encode() + b'", "messages": 5}')
    assert status == 400 and set(body) == {"error"}
    status, body = _post(server, "/api/generate", b"[" * 200_000 + b"]" * 200_000)
    assert status == 400 and "nested too deeply" in body["error"]
    assert client.generate(model=TAGGED, prompt="Hi", options={"num_predict": 2}).done  # still serving
