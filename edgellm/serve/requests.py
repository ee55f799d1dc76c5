"""Requests to `edgellm serve`: which models a client may name, and the request bodies parsed and checked.

Everything here runs on the HTTP side before a job is queued, so a bad
request is a 4xx at once and never takes a place in a model's queue.
Structured output reuses the chat core's converter and checks
(`edgellm.chat.structured`), as `edgellm chat --json-schema` does.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Optional

from edgellm.chat import structured
from edgellm.engine.runtime import SamplingParams
from edgellm.engine.speculative import DRAFT_MAX_LIMIT
from edgellm.errors import EdgeLLMError, UsageError
from edgellm.models.store import Store
from edgellm.serve import tools
from edgellm.serve.jobs import ApiError, JobRequest, ModelSpec

MAX_TOP_LOGPROBS = 20  # OpenAI's limit

_SAFE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+:-]{0,160}$")  # store names and catalog refs, never paths


# -- the model names clients may ask for -----------------------------------------


class _Models:
    def __init__(self, default_ref: Optional[str]) -> None:
        self.default: Optional[ModelSpec] = None
        self._templates: dict[tuple[str, int], Optional[str]] = {}
        if default_ref:
            from edgellm.gguf.reader import read_gguf
            from edgellm.models.resolve import resolve

            res = resolve(default_ref)
            info = read_gguf(res.path)  # a broken file fails now, in one line, not at the first request
            name = res.record.name if res.record else res.path.stem
            self.default = ModelSpec(name, res.path, info.context_length)

    def template_source(self, spec: ModelSpec) -> Optional[str]:
        """The GGUF's chat template, read once per file (the tool format is chosen from it before the job is queued)."""
        from edgellm.gguf.reader import read_gguf

        key = (str(spec.path), spec.path.stat().st_mtime_ns)
        if key not in self._templates:
            self._templates = {key: read_gguf(spec.path).chat_template}  # one model at a time is the common case
        return self._templates[key]

    def find(self, requested: Optional[str]) -> ModelSpec:
        if requested and requested.endswith(":latest"):  # Ollama's default tag: the model itself
            requested = requested[: -len(":latest")]
        if not requested:
            if self.default is None:
                raise ApiError(
                    400, "you must give a model (this server has no default model)", param="model", code="model_required"
                )
            return self.default
        if self.default is not None and requested == self.default.name:
            return self.default
        rec = None
        if _SAFE_REF.match(requested) and ".." not in requested:
            from edgellm.models.resolve import resolve
            from edgellm.models.store import Store

            rec = Store().find(requested)
            if rec is None:
                try:
                    rec = resolve(requested).record  # catalog refs: `name`, `name:level`
                except EdgeLLMError:
                    rec = None
        if rec is None or not rec.path.is_file():
            raise ApiError(
                404,
                f"The model '{requested}' does not exist in the edgellm store (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return ModelSpec(rec.name, rec.path, rec.context_length)

    def listing(self, loaded: list[str]) -> list[dict[str, Any]]:
        out = []
        for rec in Store().list():
            out.append(
                _model_obj(
                    rec.name,
                    int(rec.added),
                    loaded,
                    level=rec.level,
                    size_bytes=rec.size_bytes,
                    context_length=rec.context_length,
                    architecture=rec.architecture,
                )
            )
        if self.default is not None and all(m["id"] != self.default.name for m in out):
            out.append(_model_obj(self.default.name, int(time.time()), loaded, context_length=self.default.context_length))
        return out


def _model_obj(name: str, created: int, loaded: list[str], **extra: Any) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "edgellm", "loaded": name in loaded, **extra}


# -- request parsing -----------------------------------------------------------


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(body: dict, key: str, lo: float, hi: float, *, integer: bool = False) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _bad(f"'{key}' must be {'an integer' if integer else 'a number'}", key, "invalid_type")
    if not lo <= v <= hi:
        raise _bad(f"'{key}' must be between {lo:g} and {hi:g}, not {v}", key, "invalid_value")
    return v


def _sampling(body: dict) -> tuple[SamplingParams, Optional[int]]:
    if body.get("n") not in (None, 1):
        raise _bad("only n=1 is supported", "n", "unsupported_value")
    if body.get("echo"):
        raise _bad("'echo' is not supported by this server", "echo", "unsupported_parameter")
    max_tokens = _number(body, "max_completion_tokens", 1, 1 << 31, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, 1 << 31, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    # presence/frequency penalties and logit_bias are accepted for compatibility and ignored.
    sp = SamplingParams(stop=[s for s in stop if s])
    for key, attr, lo, hi in (
        ("temperature", "temperature", 0, 2),
        ("top_p", "top_p", 0, 1),
        ("min_p", "min_p", 0, 1),
        ("repeat_penalty", "repeat_penalty", 0, 10),
    ):
        v = _number(body, key, lo, hi)
        if v is not None:
            setattr(sp, attr, float(v))
    top_k = _number(body, "top_k", 0, 1 << 20, integer=True)
    if top_k is not None:
        sp.top_k = top_k
    sp.seed = _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    ignore_eos = body.get("ignore_eos", False)  # llama-server's field: replies of exactly max_tokens (benchmarks)
    if not isinstance(ignore_eos, bool):
        raise _bad("'ignore_eos' must be a boolean", "ignore_eos", "invalid_type")
    sp.ignore_eos = ignore_eos
    # speculative decoding (issue 26): "draft": "ngram"|"off", absent: the server's --draft
    draft = body.get("draft", "")
    if draft not in ("", "off", "ngram"):
        raise _bad("'draft' must be 'ngram' or 'off'", "draft", "invalid_value")
    sp.draft = draft
    sp.draft_max = (
        _number(body, "draft_max", 0, DRAFT_MAX_LIMIT, integer=True)
        or _number(body, "speculative.n_max", 0, DRAFT_MAX_LIMIT, integer=True)
        or 0
    )
    return sp, max_tokens


def _grammar_ends(sp: SamplingParams, constrained: bool) -> None:
    # A finished grammar allows only the end of the reply, which ignore_eos takes away: nothing would be left to sample.
    if sp.ignore_eos and constrained:
        raise _bad(
            "'ignore_eos' cannot be combined with 'response_format' or 'tools': a finished grammar can only end the reply",
            "ignore_eos",
            "unsupported_value",
        )


def _constraint(body: dict) -> Any:
    """response_format as a chat-core Constraint: json_object → llama.cpp's JSON grammar; json_schema → from the schema."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'", "response_format", "invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None

    if kind == "json_object":
        from llama_cpp.llama_grammar import JSON_GBNF

        return structured.from_gbnf(JSON_GBNF, source="response_format")
    if kind != "json_schema":
        raise _bad(
            f"unknown response_format type '{kind}' (expected text, json_object or json_schema)",
            "response_format",
            "invalid_value",
        )
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be a JSON Schema object", "response_format", "invalid_schema")
    try:
        return structured.from_json_schema(json.dumps(schema), source="in response_format")
    except UsageError as e:
        raise _bad(str(e), "response_format", "invalid_schema") from None


def _content_text(content: Any, i: int) -> Optional[str]:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(
                    f"messages[{i}].content: only text parts are supported", f"messages[{i}].content", "unsupported_content"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content", "invalid_type")


def _chat_logprobs(body: dict) -> Optional[int]:
    lp, top = body.get("logprobs"), _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if lp is not None and not isinstance(lp, bool):
        raise _bad("'logprobs' must be a boolean", "logprobs", "invalid_type")
    if top is not None and not lp:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    return (top or 0) if lp else None


def parse_chat(body: dict) -> JobRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    try:
        tool_req = tools.parse_tools(body)
        messages = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]", "invalid_type")
            role = "system" if m["role"] == "developer" else m["role"]
            if role not in ("system", "user", "assistant", "tool"):
                raise _bad(
                    f"messages[{i}].role '{m['role']}' is not one of system, developer, user, assistant, tool",
                    f"messages[{i}].role",
                    "invalid_value",
                )
            msg: dict[str, Any] = {"role": role, "content": _content_text(m.get("content"), i) or ""}
            if role == "assistant" and m.get("tool_calls"):
                msg["tool_calls"] = tools.parse_tool_calls(m["tool_calls"], i)
            if role == "tool":
                msg["tool_call_id"] = m.get("tool_call_id")
            messages.append(msg)
        tools.check_messages(messages)
    except tools.ToolError as e:
        raise _bad(str(e), e.param, e.code) from None
    sp, max_tokens = _sampling(body)
    constraint = _constraint(body)
    if tool_req is not None and tool_req.offered() and constraint is not None:
        raise _bad(
            "'response_format' together with 'tools' is not supported by this server; send one of them",
            "response_format",
            "unsupported_parameter",
        )
    _grammar_ends(sp, constraint is not None or (tool_req is not None and bool(tool_req.offered())))
    return JobRequest(
        "chat",
        messages=messages,
        sampling=sp,
        max_tokens=max_tokens,
        constraint=constraint,
        tools=tool_req,
        logprobs=_chat_logprobs(body),
    )


def parse_completion(body: dict) -> JobRequest:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, list) and p and not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        raise _bad("'prompt' must be a string, a list with one string, or a list of token ids", "prompt", "invalid_type")
    if not isinstance(p, (str, list)) or (isinstance(p, list) and not p):
        raise _bad("'prompt' must be a string, a list with one string, or a list of token ids", "prompt", "invalid_type")
    if body.get("suffix"):
        raise _bad("'suffix' is not supported by this server", "suffix", "unsupported_parameter")
    sp, max_tokens = _sampling(body)
    lp = _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    constraint = _constraint(body)
    _grammar_ends(sp, constraint is not None)
    return JobRequest(
        "completion",
        prompt=p,
        sampling=sp,
        max_tokens=16 if max_tokens is None else max_tokens,
        constraint=constraint,
        logprobs=lp,
    )


MAX_EMBED_INPUTS = 2048  # OpenAI's limit per request


def parse_embeddings(body: dict, key: str = "input") -> tuple[JobRequest, str]:
    """An embeddings body (`input`: a string, strings, token ids or lists of them) and its `encoding_format`."""
    x = body.get(key)
    if isinstance(x, str) or (isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)):
        x = [x]
    if not isinstance(x, list) or not x:
        raise _bad(f"'{key}' must be a non-empty string, a list of strings, or token ids", key, "invalid_type")
    if len(x) > MAX_EMBED_INPUTS:
        raise _bad(f"'{key}' has {len(x)} items; the limit is {MAX_EMBED_INPUTS}", key, "invalid_value")
    for i, item in enumerate(x):
        ok = (isinstance(item, str) and item) or (
            isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        )
        if not ok:
            raise _bad(f"{key}[{i}] must be a non-empty string or a non-empty list of token ids", key, "invalid_value")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise _bad("'encoding_format' must be 'float' or 'base64'", "encoding_format", "invalid_value")
    if body.get("dimensions") is not None:
        raise _bad(
            "'dimensions' is not supported: this server returns the model's own embedding size",
            "dimensions",
            "unsupported_parameter",
        )
    return JobRequest("embed", inputs=x), fmt


__all__ = ["parse_chat", "parse_completion", "parse_embeddings", "_Models", "_bad", "MAX_TOP_LOGPROBS"]
