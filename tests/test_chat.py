"""Chat on the real default model: KV reuse from llama.cpp's counters, structured
output, cancel, history, context overflow, sandboxed templates, and the CLI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.helpers import DEFAULT_NAME, assert_one_line_error

from edgellm.chat import history as chat_history
from edgellm.chat.session import ChatSession, Conversation
from edgellm.chat.template import ChatTemplate, TemplateError
from edgellm.errors import UsageError
from edgellm.progress import CancelToken
from edgellm.engine.runtime import Runtime, RuntimeOptions, SamplingParams
from edgellm.chat.structured import from_json_schema

T1 = ["--threads", "1"]  # the test machine's cores are shared; one thread is fastest there
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def _copy_gguf(src: Path, dst: Path, *, template: str | None) -> Path:
    """A copy of a GGUF with tokenizer.chat_template removed (None) or replaced; tensors copied raw."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if (
            field.name == gguf.Keys.General.ARCHITECTURE
            or field.name.startswith("GGUF.")
            or field.name == gguf.Keys.Tokenizer.CHAT_TEMPLATE
        ):
            continue
        vt = field.types[0]
        writer.add_key_value(
            field.name, field.contents(), vt, sub_type=field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        )
    if template is not None:
        writer.add_chat_template(template)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def _with_template(src: Path, dst: Path, template: str) -> Path:
    """A byte copy of a GGUF whose chat template is replaced in place, padded to the same length."""
    from edgellm.gguf.reader import read_gguf

    data = src.read_bytes()
    old = read_gguf(src).chat_template.encode("utf-8")
    new = template.encode("utf-8")
    assert len(new) + 4 <= len(old) and data.count(old) == 1
    new += b"{#" + b" " * (len(old) - len(new) - 4) + b"#}"
    dst.write_bytes(data.replace(old, new))
    assert read_gguf(dst).chat_template == new.decode()
    return dst


@pytest.fixture(scope="session")
def no_template_gguf(default_gguf, tmp_path_factory):
    return _copy_gguf(default_gguf, tmp_path_factory.mktemp("notpl") / "no-template.gguf", template=None)


@pytest.fixture(scope="module")
def rt(default_gguf):
    r = Runtime(default_gguf, RuntimeOptions(n_ctx=1024, n_threads=1))
    yield r
    r.close()


# -- multi-turn KV reuse -------------------------------------------------------


def test_three_turns_evaluate_only_new_tokens(rt):
    rt.reset()
    s = ChatSession(
        rt,
        Conversation(system="You answer in one short sentence."),
        SamplingParams(max_tokens=40, seed=7, temperature=0.3),
        history=False,
    )
    questions = ["What is the capital of France?", "And the capital of Italy?", "Which of the two is larger?"]
    evaluated, prompts, stops, generated = [], [], [], []
    try:
        for q in questions:
            reply = s.ask(q)
            assert reply
            n_p_eval, n_eval = rt.perf_counters()  # llama.cpp's own counters for this turn
            evaluated.append(n_p_eval)
            prompts.append(s.last_stats.prompt_tokens)
            stops.append(s.last_stats.stop_reason)
            generated.append(s.last_stats.generated_tokens)
    finally:
        s.close()
    assert evaluated[0] == prompts[0]  # turn 1 reads everything
    for i in (1, 2):
        # New since turn i-1: the previous reply's end-of-turn marker, the new user message, the assistant header.
        new_text = f"<|im_end|>\n<|im_start|>user\n{questions[i]}<|im_end|>\n<|im_start|>assistant\n"
        new = len(rt.tokenize(new_text, add_bos=False))
        # A reply cut by max-tokens leaves its last sampled token unevaluated; it is evaluated now.
        expected = new + (1 if stops[i - 1] == "length" else 0)
        assert evaluated[i] == expected, (i, evaluated, prompts, stops)
        assert prompts[i] == prompts[i - 1] + generated[i - 1] + new
    assert evaluated[2] < prompts[2] / 3


def test_reply_cut_by_stop_string_reuses_kv_up_to_the_cut(rt):
    s = ChatSession(
        rt,
        Conversation(system="You answer in one short sentence."),
        SamplingParams(max_tokens=60, temperature=0.0, stop=[" is "]),
        history=False,
    )
    try:
        first = s.ask("What is the capital of France?")  # greedy: "The capital of France is Paris."
        assert s.last_stats.stop_reason == "stop" and " is " not in first, first
        p1 = s.last_stats.prompt_tokens
        s.ask("Thanks.")
        st = s.last_stats
        # Only the text after the cut is new: end-of-turn, the user message, the assistant header.
        assert (
            st.evaluated_prompt_tokens
            <= len(rt.tokenize("<|im_end|>\n<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n", add_bos=False)) + 1
        )
        assert st.reused_tokens >= p1
    finally:
        s.close()


def test_cancel_mid_reply_keeps_session_usable(rt):
    s = ChatSession(rt, Conversation(), SamplingParams(max_tokens=200, seed=2, temperature=0.8), history=False)
    try:
        cancel = CancelToken()
        got = []
        for piece in s.send("Tell me a long story about a dragon.", cancel=cancel):
            got.append(piece)
            if len(got) == 4:
                cancel.cancel()
        assert s.last_stats.stop_reason == "cancelled"
        assert [m["role"] for m in s.conversation.messages] == ["user", "assistant"]
        assert s.conversation.messages[1]["content"] == "".join(got)
        reply = s.ask("Now say hello.")
        assert reply and s.last_stats.stop_reason in ("eos", "length")
        assert len(s.conversation.messages) == 4
        assert s.last_stats.reused_tokens > s.last_stats.evaluated_prompt_tokens  # the cancelled turn stayed in the KV cache
    finally:
        s.close()


def test_context_full_drops_oldest_turns_keeps_system(default_gguf):
    warnings = []
    r = Runtime(default_gguf, RuntimeOptions(n_ctx=256, n_threads=1))
    s = ChatSession(
        r,
        Conversation(system="SYSTEM-MARKER: be brief."),
        SamplingParams(max_tokens=12, seed=1),
        history=False,
        warn=warnings.append,
    )
    try:
        dropped = 0
        for i in range(8):
            s.ask(f"Message number {i}: " + "please remember these words " * 6)
            dropped += s.last_stats.dropped_turns
            assert s.last_stats.prompt_tokens + 12 <= 256
        assert dropped > 0
        assert any("dropped the" in w and "kept the system prompt" in w for w in warnings)
        window = s.conversation.window(s._window_start)
        assert window[0] == {"role": "system", "content": "SYSTEM-MARKER: be brief."}
        assert window[1]["role"] == "user" and "Message number 0" not in window[1]["content"]
        assert len(s.conversation.messages) == 16  # history keeps everything
        assert s.info()["totals"]["dropped_turns"] == dropped
    finally:
        s.close()
        r.close()


# -- structured output ---------------------------------------------------------


def test_json_schema_extraction_ten_seeds(rt):
    import jsonschema

    c = from_json_schema(json.dumps(PERSON_SCHEMA))
    values = []
    for seed in range(10):
        s = ChatSession(
            rt,
            Conversation(system="Extract the person as JSON."),
            SamplingParams(max_tokens=80, seed=seed, temperature=0.9),
            constraint=c,
            history=False,
        )
        try:
            reply = s.ask("Marie Curie, 36 years old, lives in Paris.")
        finally:
            s.close()
        value = json.loads(reply)
        jsonschema.validate(value, PERSON_SCHEMA)
        assert s.last_value == value
        values.append(value)
    assert len(values) == 10


def test_bad_schema_and_grammar_are_usage_errors(rt):
    with pytest.raises(UsageError, match="not valid JSON"):
        from_json_schema("{nope")
    with pytest.raises(UsageError, match="invalid JSON schema"):
        from_json_schema('{"type": "objekt"}')
    from edgellm.chat.structured import from_gbnf

    with pytest.raises(UsageError, match="invalid grammar"):
        ChatSession(rt, constraint=from_gbnf("root ::= [a-"), history=False)


# -- history -------------------------------------------------------------------


def test_save_load_continue(rt, edgellm_home):
    s = ChatSession(rt, Conversation(system="Be brief."), SamplingParams(max_tokens=20, seed=4), model_name=DEFAULT_NAME)
    s.ask("My name is Ada.")
    sid, path = s.session_id, s.history.path
    s.close()
    assert path.parent == edgellm_home / "history" and path.name == f"{sid}.jsonl"
    saved = chat_history.load(sid)
    assert saved.system == "Be brief." and [m["role"] for m in saved.messages] == ["user", "assistant"]
    # a crash mid-append tears the last line: tolerated on load, cut before appending
    with open(path, "ab") as f:
        f.write(b'{"type": "message", "role": "user", "cont')
    assert chat_history.load(sid).torn_tail
    s2 = ChatSession.resume(rt, sid, sampling=SamplingParams(max_tokens=20, seed=4))
    try:
        assert s2.conversation.messages == saved.messages
        s2.ask("What is my name?")
        assert s2.session_id == sid
    finally:
        s2.close()
    again = chat_history.load(sid)
    assert not again.torn_tail and len(again.messages) == 4
    assert again.messages[2]["content"] == "What is my name?"
    assert all(json.loads(line) for line in path.read_text().splitlines())
    md = chat_history.to_markdown(again)
    assert "## User" in md and "What is my name?" in md and "Be brief." in md


def test_history_cli_list_export_delete(cli, default_model, tmp_path):
    res = cli("chat", DEFAULT_NAME, "-p", "Hello there", "--max-tokens", "8", "--seed", "1", *T1)
    assert res.exit_code == 0, res
    rows = cli("chat", "--list", "--json").json()
    assert len(rows) == 1 and rows[0]["title"] == "Hello there" and rows[0]["messages"] == 2
    sid = rows[0]["id"]
    out = tmp_path / "chat.md"
    assert cli("chat", "--export", sid, "-o", out).exit_code == 0
    assert "Hello there" in out.read_text()
    assert cli("chat", "--delete", sid).exit_code == 0
    assert cli("chat", "--list", "--json").json() == []
    assert_one_line_error(cli("chat", "--export", sid))


# -- templates -----------------------------------------------------------------


@pytest.mark.parametrize(
    "source, needle",
    [
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{{ cycler.__init__.__globals__ }}", "unsafe"),
        ("{% include '/etc/passwd' %}", "no loader"),
        ("{{ messages.append(1) }}", "unsafe"),
        ("{{ 'x' * 10**10 }}", "too large"),
        ("{{ raise_exception('no system role') }}", "no system role"),
    ],
)
def test_hostile_templates_are_contained(source, needle):
    with ChatTemplate(source, timeout=5) as t, pytest.raises(TemplateError, match=needle) as e:
        t.render([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value)


def test_endless_template_is_stopped():
    # range() is capped at 100k in the sandbox, but nested loops are not: 10^10 iterations.
    src = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    with ChatTemplate(src, timeout=1.0) as t:
        t0 = time.monotonic()
        with pytest.raises(TemplateError, match="did not finish rendering within 1 s"):
            t.render([])
        assert time.monotonic() - t0 < 10
    with ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", timeout=1.0) as ok:
        assert ok.render([{"role": "user", "content": "fine"}]) == "fine"


def test_hostile_template_in_a_model_through_the_cli(cli, default_gguf, tmp_path, monkeypatch):
    evil = _with_template(default_gguf, tmp_path / "evil.gguf", "{{ cycler.__init__.__globals__.os.popen('id').read() }}")
    res = cli("chat", evil, "-p", "hi", *T1)
    assert_one_line_error(res)
    assert "chat template error" in res.stderr and "unsafe" in res.stderr
    monkeypatch.setenv("EDGELLM_TEMPLATE_TIMEOUT", "1")
    loop = _with_template(
        default_gguf, tmp_path / "loop.gguf", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    res = cli("chat", loop, "-p", "hi", *T1)
    assert_one_line_error(res)
    assert "did not finish rendering" in res.stderr


def test_model_without_template_falls_back_with_one_warning(cli, no_template_gguf):
    res = cli("chat", no_template_gguf, "-p", "Hello", "--max-tokens", "8", "--seed", "1", "--no-history", *T1)
    assert res.exit_code == 0, res
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "no chat template" in warnings[0], res
    assert res.stdout.strip()
    assert "Traceback" not in res.stderr


# -- CLI ------------------------------------------------------------------------


def test_one_shot_streams_reply_and_reports_tokens_per_second(cli, default_model):
    res = cli("chat", DEFAULT_NAME, "-p", "Name a colour.", "--max-tokens", "12", "--seed", "3", "--no-history", *T1)
    assert res.exit_code == 0, res
    assert res.stdout.strip() and "tokens/s" not in res.stdout
    assert "tokens/s" in res.stderr
    again = cli("chat", DEFAULT_NAME, "-p", "Name a colour.", "--max-tokens", "12", "--seed", "3", "--no-history", *T1)
    assert again.stdout == res.stdout  # same seed and settings, same reply


def test_one_shot_json(cli, default_model, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    res = cli(
        "chat",
        DEFAULT_NAME,
        "-p",
        "Bob is 40 and lives in Nice.",
        "--json-schema",
        schema,
        "--json",
        "--seed",
        "1",
        "--max-tokens",
        "80",
        *T1,
    )
    assert res.exit_code == 0, res
    d = res.json()
    assert d["messages"][-1]["role"] == "assistant" and d["reply"] == d["messages"][-1]["content"]
    assert json.loads(d["reply"]) == d["json"]
    st = d["stats"]
    assert st["prompt_tokens"] > 0 and st["generated_tokens"] > 0 and st["tokens_per_second"] > 0 and st["ttft_seconds"] > 0
    assert d["session_id"] and d["constraint"] == "json-schema"


def test_cli_errors_are_one_line(cli, default_model, tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    bad_schema = tmp_path / "schema.json"
    bad_schema.write_text('{"type": 12}')
    bad_gbnf = tmp_path / "bad.gbnf"
    bad_gbnf.write_text('root ::= "a" undefined-rule')
    cases = [
        (["-p", "word " * 400, "--ctx", "256"], "context holds 256"),
        (["-p", "hi", "--json-schema", bad_json], "not valid JSON"),
        (["-p", "hi", "--json-schema", bad_schema], "invalid JSON schema"),
        (["-p", "hi", "--grammar", bad_gbnf], "Undefined rule identifier 'undefined-rule'"),
        (["-p", "hi", "--grammar", tmp_path / "missing.gbnf"], "no such file"),
        (["-p", "hi", "--gpu-layers", "lots"], "--gpu-layers takes"),
    ]
    for args, needle in cases:
        res = cli("chat", DEFAULT_NAME, *args, *T1)
        assert_one_line_error(res)
        assert needle in res.stderr, (args, res)
    assert_one_line_error(cli("chat", "no-such-model", "-p", "hi"))
    assert not list((Path(os.environ["EDGELLM_HOME"]) / "history").glob("*.jsonl"))  # failed turns leave no history


def test_gpu_layers_on_cpu_only_build_warns_once_and_runs(cli, default_model):
    res = cli("chat", DEFAULT_NAME, "-p", "Hi", "--gpu-layers", "99", "--max-tokens", "4", "--no-history", *T1)
    assert res.exit_code == 0, res
    assert res.stderr.count("no GPU backend") == 1 and "Traceback" not in res.stderr
    assert res.stdout.strip()


def test_grammar_file_constrains_reply(cli, default_model, tmp_path):
    g = tmp_path / "yn.gbnf"
    g.write_text('root ::= ("yes" | "no") "."\n')
    for seed in ("1", "2"):
        res = cli("chat", DEFAULT_NAME, "-p", "Is the sky green?", "--grammar", g, "--seed", seed, "--no-history", *T1)
        assert res.exit_code == 0, res
        assert res.stdout.strip() in ("yes.", "no.")


def test_kv_type_shown_in_stats(cli, default_model):
    script = "Hi\n/stats\n/system Answer in French.\n/system\n/reset\n/help\n/bogus\n/quit\n"
    res = cli("chat", DEFAULT_NAME, "--kv-type", "q8_0", "--ctx", "1024", "--max-tokens", "6", "--seed", "1", *T1, input=script)
    assert res.exit_code == 0, res
    assert "KV cache     q8_0:" in res.stderr and "(f16 would be" in res.stderr
    assert "tokens/s" in res.stderr and "RSS" in res.stderr
    assert "Answer in French." in res.stderr and "conversation reset" in res.stderr and "unknown command /bogus" in res.stderr


def test_interactive_save_and_load(cli, default_model, tmp_path):
    md = tmp_path / "copy.md"
    res = cli("chat", DEFAULT_NAME, "--max-tokens", "6", "--seed", "1", *T1, input=f"First question\n/save {md}\n/quit\n")
    assert res.exit_code == 0, res
    assert "First question" in md.read_text()
    sid = cli("chat", "--list", "--json").json()[0]["id"]
    res = cli("chat", DEFAULT_NAME, "--max-tokens", "6", "--seed", "1", *T1, input=f"/load {sid}\nSecond question\n/quit\n")
    assert res.exit_code == 0, res
    assert "loaded" in res.stderr
    msgs = chat_history.load(sid).messages
    assert [m["content"] for m in msgs if m["role"] == "user"] == ["First question", "Second question"]


def test_ctrl_c_stops_the_reply_not_the_program(default_model):
    """A real SIGINT to a real `edgellm chat` process in the middle of a reply."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgellm.cli",
            "chat",
            DEFAULT_NAME,
            "--max-tokens",
            "400",
            "--seed",
            "1",
            "--temperature",
            "1.0",
            *T1,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        proc.stdin.write(b"Write a very long story about the sea.\n")
        proc.stdin.flush()
        first = proc.stdout.read(1)  # the reply has started streaming
        assert first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(b"/stats\n/quit\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 0, err
    assert "[reply stopped]" in err and "KV cache" in err, err
    assert "Traceback" not in err
