"""OpenAI's routes: `/v1/chat/completions` (with tools and logprobs), `/v1/completions` and
`/v1/embeddings`, answered in OpenAI's shapes, streamed as its SSE chunks ending in `[DONE]`.

A reply with tools is held back until generation ends and then parsed (`edgellm.serve.tools`),
so a stream sends its `tool_calls` deltas (the name first, then the arguments) or its content
at the end; without tools the text streams as it is generated.
"""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from typing import Any, Optional

from edgellm.serve.common import FINISH, Running, ServeContext, json_response, read_json, submit, usage_and_timings
from edgellm.serve.jobs import ApiError, shutting_down
from edgellm.serve.requests import parse_chat, parse_completion, parse_embeddings


def _token_str(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: one item per token with its bytes and the top alternatives."""
    return {
        "content": [
            {
                "token": _token_str(e.text),
                "logprob": e.logprob,
                "bytes": list(e.text),
                "top_logprobs": [{"token": _token_str(b), "logprob": lp, "bytes": list(b)} for _, b, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[Any], offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs`: parallel lists, top alternatives as {token: logprob}."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        t = _token_str(e.text)
        tokens.append(t)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_str(b): lp for _, b, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def _message(run: Running, text: str, stats: Any) -> tuple[dict[str, Any], str, list[str]]:
    """The assistant message, finish reason and warnings of a finished chat."""
    plan = run.start.get("plan")
    finish = FINISH.get(stats.stop_reason, "stop")
    if plan is None:
        return {"role": "assistant", "content": text}, finish, []
    parsed = plan.parse(text, cut=stats.stop_reason == "length")
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        msg["tool_calls"] = [c.to_openai() for c in parsed.calls]
        finish = "tool_calls"
    return msg, finish, plan.warnings + parsed.warnings


def routes(ctx: ServeContext) -> list[Any]:
    from starlette.routing import Route  # lazy: the server extra

    async def completions(request: Any, kind: str):
        ctx.check_auth(request)
        body = await read_json(request)
        req = parse_chat(body) if kind == "chat" else parse_completion(body)
        spec = ctx.models.find(body.get("model"))
        stream = bool(body.get("stream"))
        opts = body.get("stream_options")
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        run = await submit(ctx, request, spec, req, stream=stream)
        meta = {
            "id": ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24],
            "created": int(time.time()),
            "model": spec.name,
            "system_fingerprint": ctx.fingerprint,
        }
        if stream:
            return _sse(ctx, run, kind, meta, include_usage)
        got = await run.collect()
        assert got.stats is not None  # a generation ends with its stats (an error raises instead)
        usage, timings = usage_and_timings(run.start, got.stats)
        text = "".join(got.text)
        extra: dict[str, Any] = {}
        if kind == "chat":
            msg, finish, warnings = _message(run, text, got.stats)
            ctx.metrics.count_tool_calls(len(msg.get("tool_calls", [])))
            lp = chat_logprobs(got.logprobs) if req.logprobs is not None else None
            choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish}
            if warnings:
                extra["warnings"] = warnings
        else:
            lp = completion_logprobs(got.logprobs) if req.logprobs is not None else None
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": FINISH.get(got.stats.stop_reason, "stop")}
        return json_response(
            {
                **meta,
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "choices": [choice],
                "usage": usage,
                "timings": timings,
                **extra,
            }
        )

    async def chat_route(request: Any):
        return await completions(request, "chat")

    async def completion_route(request: Any):
        return await completions(request, "completion")

    async def embeddings_route(request: Any):
        ctx.check_auth(request)
        body = await read_json(request)
        req, fmt = parse_embeddings(body)
        spec = ctx.models.find(body.get("model"))
        got = await (await submit(ctx, request, spec, req)).collect()
        return json_response(embeddings_body(got.embeddings, spec.name, fmt))

    return [
        Route("/v1/chat/completions", chat_route, methods=["POST"]),
        Route("/v1/completions", completion_route, methods=["POST"]),
        Route("/v1/embeddings", embeddings_route, methods=["POST"]),
    ]


def embeddings_body(res: Any, model: str, fmt: str) -> dict[str, Any]:
    def enc(v: list[float]) -> Any:
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii") if fmt == "base64" else v

    body = {
        "object": "list",
        "model": model,
        "pooling": res.pooling,
        "data": [{"object": "embedding", "index": i, "embedding": enc(v)} for i, v in enumerate(res.vectors)],
        "usage": {"prompt_tokens": res.prompt_tokens, "total_tokens": res.prompt_tokens},
    }
    if res.warnings:
        body["warnings"] = res.warnings
    return body


# long: one generator per stream; the chunk shapes of chat and completions, tools and logprobs side by side
def _sse(ctx: ServeContext, run: Running, kind: str, meta: dict[str, Any], include_usage: bool):
    from sse_starlette.sse import EventSourceResponse  # lazy: the server extra

    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    req = run.job.request
    plan = run.start.get("plan")
    hold = plan is not None and bool(plan.request.offered())  # tool replies are parsed whole, then sent

    def chunk(
        delta: Optional[dict[str, Any]] = None,
        finish: Optional[str] = None,
        lps: Optional[list[Any]] = None,
        text: str = "",
        **extra: Any,
    ) -> dict:
        lp = None
        if lps is not None and req.logprobs is not None:
            lp = chat_logprobs(lps) if kind == "chat" else completion_logprobs(lps)
        if kind == "chat":
            choice = {"index": 0, "delta": delta or {}, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return {"data": json.dumps({**meta, "object": obj, "choices": [choice], **extra})}

    async def events():
        if kind == "chat":
            yield chunk({"role": "assistant", "content": ""})
        text, pending, stats = [], [], None
        try:
            async for ev, val in run.events():
                if ev == "logprob":
                    pending.append(val)
                elif ev == "text":
                    text.append(val)
                    if not hold:
                        yield chunk({"content": val}, lps=pending, text=val)
                        pending = []
                else:
                    stats = val
        except ApiError as e:  # a stream that fails after it started ends with one error event
            yield {"data": json.dumps(e.body())}
            return
        if stats.stop_reason == "cancelled":
            yield {"data": json.dumps(shutting_down().body())}
            return
        finish = FINISH.get(stats.stop_reason, "stop")
        extra: dict[str, Any] = {}
        if hold:
            msg, finish, warnings = _message(run, "".join(text), stats)
            ctx.metrics.count_tool_calls(len(msg.get("tool_calls", [])))
            if warnings:
                extra["warnings"] = warnings
            for i, call in enumerate(msg.get("tool_calls", [])):
                head = {
                    "index": i,
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""},
                }
                yield chunk({"tool_calls": [head]}, lps=pending if i == 0 else None)
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
                pending = []
            if msg.get("content"):
                yield chunk({"content": msg["content"]}, lps=pending)
                pending = []
        elif pending:  # logprobs of tokens whose text was held back (a stop string's start)
            yield chunk({}, lps=pending)
        usage, timings = usage_and_timings(run.start, stats)
        # usage and timings ride on the last chunk always; the separate usage chunk is OpenAI's opt-in.
        yield chunk({}, finish, usage=usage, timings=timings, **extra)
        if include_usage:
            yield {"data": json.dumps({**meta, "object": obj, "choices": [], "usage": usage})}
        yield {"data": "[DONE]"}

    return EventSourceResponse(events(), sep="\n", ping=15, shutdown_grace_period=2.0)


__all__ = ["routes", "chat_logprobs", "completion_logprobs", "embeddings_body"]
