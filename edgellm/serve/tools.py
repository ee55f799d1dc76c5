"""Tool calling for `/v1/chat/completions` and `/api/chat`: the request's tools checked, the
prompt prepared for the model's format, the reply constrained by a grammar and parsed back.

Formats, chosen from the model's chat template:

- `hermes` (Hermes, Qwen 2.5/3 and others): the template renders `tools`; the model writes
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- `llama3` (Llama 3.1+): the template renders `tools`; the model writes
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]` (ids of 9 characters).
- `generic` (every other template, the default model's among them): llama.cpp's generic
  format (common/chat.cpp): the tools go into the system prompt and the whole reply is one
  JSON object, `{"tool_call": {...}}` / `{"tool_calls": [...]}` or `{"response": "..."}`.

Whatever the format, the calls are constrained by a grammar built from each function's JSON
schema (the converter of `edgellm.chat.structured`), so a call the model finishes parses and
validates. A template that ignores the tools it is given falls back to the generic format with
a warning in the reply. Pure Python: the pool renders and decodes, this module only plans.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Optional

from edgellm.chat import structured
from edgellm.errors import UsageError
from edgellm.serve.tool_types import (
    GENERIC_INSTRUCTION,
    HERMES_CLOSE,
    HERMES_OPEN,
    MAX_PARALLEL_CALLS,
    Parsed,
    Tool,
    ToolCall,
    ToolError,
    ToolRequest,
)

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


# -- checking a request -----------------------------------------------------------


def parse_tools(body: dict[str, Any]) -> Optional[ToolRequest]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body; None without tools."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise ToolError(
            "'functions' and 'function_call' are deprecated: use 'tools' and 'tool_choice'", "functions", "unsupported_parameter"
        )
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise ToolError("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools", "invalid_type")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        tools.append(_tool(t, i))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ToolError(f"tools: the function name '{dup}' is given twice", "tools")
    req = ToolRequest(tools)
    if choice is None or choice in ("auto", "none", "required"):
        req.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ToolError(
                f"tool_choice names the function '{name}', which is not among the tools ({', '.join(names)})", "tool_choice"
            )
        req.choice, req.forced = "function", name
    else:
        raise ToolError(
            "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
            "invalid_type",
        )
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    req.parallel = ptc is not False
    return req


def _tool(t: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
        raise ToolError(
            f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}", where, "invalid_type"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'", f"{where}.function.name")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description", "invalid_type")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    try:
        structured.check_schema(params, source=f"{where}.function.parameters")
    except UsageError as e:
        raise ToolError(str(e), f"{where}.function.parameters", "invalid_schema") from None
    return Tool(name, desc, params)


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Every `tool` message answers a call of an earlier assistant message (by `tool_call_id`)."""
    calls: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            for tc in m.get("tool_calls") or []:
                calls[tc["id"]] = tc["function"]["name"]
        elif m["role"] == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or tid not in calls:
                raise ToolError(
                    f"messages[{i}]: a message with role 'tool' must answer a tool call of an earlier "
                    f"assistant message; no call has the id {tid!r}",
                    f"messages[{i}].tool_call_id",
                    "invalid_tool_message",
                )
            m.setdefault("name", calls[tid])


def parse_tool_calls(raw: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked; arguments stay JSON text."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise ToolError(f"{where} must be a list", where, "invalid_type")
    out = []
    for j, tc in enumerate(raw):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not (
            isinstance(tc, dict)
            and isinstance(tc.get("id"), str)
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments", ""), (str, dict))
        ):
            raise ToolError(
                f"{where}[{j}] must be {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}",
                f"{where}[{j}]",
                "invalid_type",
            )
        args = fn.get("arguments", "")
        out.append(
            {
                "id": tc["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    return out


# -- formats -----------------------------------------------------------------------


def detect_format(template_source: Optional[str]) -> str:
    """The tool format a chat template speaks, from its source; `generic` when it renders no tools."""
    src = template_source or ""
    if "tools" not in src:
        return "generic"
    if HERMES_OPEN in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or "ipython" in src:
        return "llama3"
    return "generic"


@dataclass
class ToolPlan:
    """How one request's tools meet one model: the messages and template variables to render, the grammar, the parser."""

    request: ToolRequest
    format: str
    messages: list[dict[str, Any]]
    extra: dict[str, Any]  # template variables (`tools`)
    grammar: Optional[str]  # GBNF, None when the model may answer freely
    schemas: dict[str, dict[str, Any]]  # function name → parameters, to validate parsed calls
    warnings: list[str] = field(default_factory=list)

    def parse(self, text: str, *, cut: bool = False) -> Parsed:
        """The reply as content and tool calls; `cut`: generation stopped at max_tokens."""
        if not self.request.offered():
            return Parsed(text)
        try:
            parsed = _PARSERS[self.format](text)
        except (ValueError, KeyError, TypeError, AttributeError):
            why = "was cut at max_tokens before the tool call was complete" if cut else "is not in the tool-call format"
            return Parsed(text, [], [f"the reply {why}; returned as content"])
        for c in parsed.calls:
            schema = self.schemas.get(c.name)
            if schema is None:
                parsed.warnings.append(f"the model called '{c.name}', which is not an offered tool")
                continue
            err = structured.validation_error(json.loads(c.arguments), schema)
            if err:
                parsed.warnings.append(f"the arguments of '{c.name}' do not match its schema: {err}")
        for c in parsed.calls:
            c.id = new_call_id(self.format)
        return parsed


def new_call_id(fmt: str = "generic") -> str:
    if fmt == "mistral":  # Mistral's templates refuse ids that are not 9 letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def plan(req: ToolRequest, messages: list[dict[str, Any]], template_source: Optional[str]) -> ToolPlan:
    """The plan for `req` on a model whose chat template is `template_source`."""
    fmt = detect_format(template_source)
    offered = req.offered()
    schemas = {t.name: t.parameters for t in offered}
    if fmt == "generic":
        msgs = _generic_messages(messages, req, offered)
        return ToolPlan(req, fmt, msgs, {}, _generic_grammar(req, offered) if offered else None, schemas)
    msgs = [_native_message(m) for m in messages]
    extra = {"tools": [t.to_openai() for t in offered]} if offered else {}
    return ToolPlan(req, fmt, msgs, extra, _native_grammar(fmt, req, offered) if offered else None, schemas)


def fallback_generic(p: ToolPlan, messages: list[dict[str, Any]], why: str) -> ToolPlan:
    """The generic plan, for a template that turned out to ignore the tools it was given."""
    g = plan(p.request, messages, None)
    g.warnings.append(why)
    return g


# -- the generic format (llama.cpp's common_chat_params_init_generic) ----------------


def _call_schema(t: Tool, args_key: str = "arguments") -> dict[str, Any]:
    s: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": t.name}, args_key: t.parameters},
        "required": ["name", args_key],
    }
    if t.description:
        s["description"] = t.description
    return s


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _generic_schema(req: ToolRequest, offered: list[Tool]) -> dict[str, Any]:
    call = _one_of([_call_schema(t) for t in offered])
    if req.parallel:
        calls = {
            "type": "object",
            "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}},
            "required": ["tool_calls"],
        }
    else:
        calls = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"]}
    if req.choice in ("required", "function"):
        return calls
    return {"anyOf": [calls, {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}]}


def _generic_grammar(req: ToolRequest, offered: list[Tool]) -> str:
    return _gbnf(_generic_schema(req, offered))


def _gbnf(schema: dict[str, Any], *, rules: Optional[dict[str, str]] = None, name: str = "") -> str:
    """GBNF for `schema` (as rule `name`, root by default) plus literal `rules`, keys in the order name, arguments."""
    from llama_cpp.llama_grammar import SchemaConverter  # lazy: llama_cpp is heavy

    conv = SchemaConverter(
        prop_order={"tool_calls": 0, "tool_call": 0, "name": 1, "arguments": 2, "parameters": 2},
        allow_fetch=False,
        dotall=False,
        raw_pattern=False,
    )
    conv.visit(conv.resolve_refs(schema, "tools"), name)
    for k, v in (rules or {}).items():
        conv._add_rule(k, v)
    return conv.format_grammar()


def _generic_messages(messages: list[dict[str, Any]], req: ToolRequest, offered: list[Tool]) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: the tools in the system prompt, calls and results as JSON."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            if offered:  # the JSON the grammar asks for, so that the format stays the one the model sees
                calls = [
                    {"name": tc["function"]["name"], "arguments": _loads(tc["function"]["arguments"]), "id": tc["id"]}
                    for tc in m["tool_calls"]
                ]
                body = {"tool_calls": calls} if req.parallel or len(calls) > 1 else {"tool_call": calls[0]}
                text = json.dumps(body, ensure_ascii=False)
            else:  # tool_choice none: in words, which a small model does not copy back as JSON
                text = (
                    "; ".join(f"I called {tc['function']['name']}({tc['function']['arguments']})" for tc in m["tool_calls"]) + "."
                )
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).strip()})
        elif m["role"] == "tool":
            # As a user turn in words: a template without a tool role has nowhere else to put it, and a small
            # model answers plain words where it copies a JSON envelope back.
            out.append({"role": "user", "content": f"The tool {m.get('name', '')} returned: {m.get('content', '')}"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if offered:
        note = (
            "You can call any of the following tools to satisfy the user's requests: "
            + json.dumps([t.to_openai() for t in offered], indent=2, ensure_ascii=False)
            + "\n\n"
            + GENERIC_INSTRUCTION
        )
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": (out[0]["content"] + "\n\n" + note).strip()}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def _parse_generic(text: str) -> Parsed:
    obj = json.loads(text)
    if "response" in obj:
        r = obj["response"]
        return Parsed(r if isinstance(r, str) else json.dumps(r))
    raw = obj["tool_calls"] if "tool_calls" in obj else [obj["tool_call"]]
    return Parsed(None, [_call(c, "arguments") for c in raw])


# -- native formats ----------------------------------------------------------------


def _native_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that renders tools itself: arguments as objects, as these templates expect."""
    out = dict(m)
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {**tc, "function": {"name": tc["function"]["name"], "arguments": _loads(tc["function"]["arguments"])}}
            for tc in m["tool_calls"]
        ]
        out.setdefault("content", "")
    return out


def _not_prefix_rule(prefix: str) -> str:
    """GBNF: any text (also empty) that does not start with `prefix` (so the model either calls or talks)."""
    alts = ['""']
    for i, ch in enumerate(prefix):
        head = json.dumps(prefix[:i]) + " " if i else ""
        alts.append(f"{head}[^{_class_char(ch)}] any-char*")
        if i:
            alts.append(json.dumps(prefix[:i]))
    return " | ".join(alts)


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "]\\^-[" else ch


def _native_grammar(fmt: str, req: ToolRequest, offered: list[Tool]) -> str:
    args_key = "parameters" if fmt == "llama3" else "arguments"
    call = _one_of([_call_schema(t, args_key) for t in offered])
    more = f"{{0,{MAX_PARALLEL_CALLS - 1}}}" if req.parallel else ""
    if fmt == "hermes":
        rules = {
            "calls": f'"{HERMES_OPEN}\\n" tool-call "\\n{HERMES_CLOSE}" ("\\n" "{HERMES_OPEN}\\n" tool-call "\\n{HERMES_CLOSE}"){more}'
        }
        trigger = HERMES_OPEN
    elif fmt == "mistral":
        rules = {"calls": f'"[TOOL_CALLS]" "[" tool-call ("," " "? tool-call){more} "]"'}
        trigger = "[TOOL_CALLS]"
    else:  # llama3
        rules = {"calls": f'tool-call (";" " "? tool-call){more}'}
        trigger = "{"
    if req.choice in ("required", "function"):
        rules["root"] = "calls"
    else:
        rules["any-char"] = "[^\\x00]"
        rules["free-text"] = _not_prefix_rule(trigger)
        rules["root"] = "calls | free-text"
    return _gbnf(call, rules=rules, name="tool-call")


def _parse_hermes(text: str) -> Parsed:
    blocks = re.findall(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", text, re.S)
    if not blocks:
        return Parsed(text)
    content = text.split(HERMES_OPEN, 1)[0].strip()
    return Parsed(content or None, [_call(json.loads(b), "arguments") for b in blocks])


def _parse_llama3(text: str) -> Parsed:
    t = text.replace("<|python_tag|>", "").strip()
    if not t.startswith("{"):
        return Parsed(text)
    dec, calls, i = json.JSONDecoder(), [], 0
    while i < len(t):
        obj, i = dec.raw_decode(t, i)
        calls.append(_call(obj, "parameters" if "parameters" in obj else "arguments"))
        while i < len(t) and t[i] in "; \n":
            i += 1
    return Parsed(None, calls)


def _parse_mistral(text: str) -> Parsed:
    t = text.replace("[TOOL_CALLS]", "").strip()
    if not t.startswith("["):
        return Parsed(text)
    return Parsed(None, [_call(c, "arguments") for c in json.loads(t)])


_PARSERS = {"generic": _parse_generic, "hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral}


def _call(obj: dict[str, Any], args_key: str) -> ToolCall:
    args = obj.get(args_key, obj.get("arguments", {}))
    if not isinstance(obj["name"], str):
        raise TypeError("a tool call's name must be a string")
    return ToolCall("", obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _loads(args: str) -> Any:
    try:
        return json.loads(args)
    except ValueError:
        return args


__all__ = [
    "Tool",
    "ToolCall",
    "ToolRequest",
    "ToolPlan",
    "ToolError",
    "Parsed",
    "parse_tools",
    "check_messages",
    "parse_tool_calls",
    "detect_format",
    "plan",
    "fallback_generic",
    "new_call_id",
]
