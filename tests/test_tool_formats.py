"""Issue 27: the tool formats edgellm.serve.tools speaks besides the generic one (Hermes/Qwen,
Llama 3.x, Mistral): the format detected from a template, a Qwen-style template rendered with the
tools and a call history in the sandboxed renderer, each grammar accepted by llama.cpp's own parser
(the default model's vocabulary), and what such models write parsed back into calls."""

from __future__ import annotations

import json

import pytest

from edgellm.serve import tools
from support.tool_schemas import function_tool

ADD = function_tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, description="Add two integers")

# The tool part of Qwen 2.5's template, as it ships (trimmed to what renders tools and calls).
QWEN = """{%- if tools %}<|im_start|>system
# Tools
<tools>{%- for tool in tools %}
{{ tool | tojson }}{%- endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{%- endfor %}<|im_end|>
{%- elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- endif %}"""


def _req(choice="auto", parallel=True):
    return tools.parse_tools({"tools": [ADD], "tool_choice": choice, "parallel_tool_calls": parallel})


def test_formats_are_detected_from_the_template():
    assert tools.detect_format(QWEN) == "hermes"
    assert tools.detect_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == "mistral"
    assert tools.detect_format("{% if tools %}<|python_tag|>{% endif %} ipython") == "llama3"
    assert tools.detect_format("{{ messages }} <tool_call>") == "generic"  # mentions no tools: cannot render them
    assert tools.detect_format(None) == "generic"


def test_a_hermes_template_renders_the_tools_and_the_call_history():
    from edgellm.chat.template import ChatTemplate

    history = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    tools.check_messages(history)
    plan = tools.plan(_req(), history, QWEN)
    with ChatTemplate(QWEN) as tpl:
        text = tpl.render(plan.messages, **plan.extra)
    assert '"name": "add"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text  # arguments as an object
    assert "<tool_response>\n5\n</tool_response>" in text


@pytest.mark.parametrize(
    "fmt_src", [QWEN, "{% if tools %}{% endif %}[TOOL_CALLS]", "{% if tools %}{% endif %}<|python_tag|>", None]
)
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_every_grammar_parses_in_llama_cpp(default_gguf, fmt_src, choice):
    import llama_cpp

    from edgellm.engine.decode import check_grammar

    plan = tools.plan(_req(choice), [{"role": "user", "content": "hi"}], fmt_src)
    llm = llama_cpp.Llama(model_path=str(default_gguf), vocab_only=True, verbose=False)
    try:
        check_grammar(llm._model.vocab, plan.grammar)
    finally:
        llm.close()


@pytest.mark.parametrize(
    "src,text",
    [
        (QWEN, 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'),
        ("{% if tools %}{% endif %}<|python_tag|>", '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}'),
        ("{% if tools %}{% endif %}[TOOL_CALLS]", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]'),
        (None, '{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}'),
    ],
)
def test_what_each_format_writes_parses_into_calls(src, text):
    parsed = tools.plan(_req(), [{"role": "user", "content": "2+3?"}], src).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("add", {"a": 2, "b": 3})]
    assert parsed.warnings == [] and all(c.id for c in parsed.calls)


def test_a_cut_or_wrong_call_is_content_with_a_warning():
    plan = tools.plan(_req("required"), [{"role": "user", "content": "x"}], None)
    cut = plan.parse('{"tool_calls": [{"name": "add", "argu', cut=True)
    assert cut.calls == [] and cut.content.startswith("{") and "max_tokens" in cut.warnings[0]
    wrong = plan.parse('{"tool_calls": [{"name": "add", "arguments": {"a": "two"}}]}')
    assert wrong.calls and "do not match its schema" in wrong.warnings[0]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [ADD, ADD]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [{}]}, "functions"),
    ],
)
def test_bad_tool_fields_name_the_field(body, param):
    with pytest.raises(tools.ToolError) as e:
        tools.parse_tools(body)
    assert e.value.param == param
