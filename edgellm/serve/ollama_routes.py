"""Ollama's API on the same port and models: `/api/chat`, `/api/generate`, `/api/embed`
(and the older `/api/embeddings`), `/api/tags`, `/api/show`, `/api/ps`, `/api/version`.

Each body is translated into the OpenAI request the other routes parse (`messages`,
`options.temperature/top_p/top_k/min_p/seed/stop/repeat_penalty`, `num_predict` as
`max_tokens`, `format` as `response_format`, `tools`), so both doors share one set of checks
and one pool. Replies use Ollama's names (`message`, `response`, `done`, `done_reason`,
`prompt_eval_count`, `eval_count`, durations in nanoseconds), streamed as NDJSON by default
as Ollama does. Errors are Ollama's `{"error": "..."}` with the same status codes.
Models are named as in `/v1/models`, with or without Ollama's `:latest` tag.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Optional

from edgellm.serve import tools
from edgellm.serve.common import FINISH, Running, ServeContext, json_response, read_json, submit
from edgellm.serve.jobs import ApiError, ModelSpec
from edgellm.serve.requests import parse_chat, parse_completion, parse_embeddings

API_VERSION = "0.12.0"  # the Ollama API whose shapes these routes speak


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _openai_body(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling and format fields of an Ollama body, in OpenAI's names."""
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'options' must be an object", param="options", code="invalid_type")
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "repeat_penalty"):
        if opts.get(key) is not None:
            out[key] = opts[key]
    n = opts.get("num_predict")
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        out["max_tokens"] = n  # -1 (unbounded) and -2 (fill the context) both mean: the rest of the context
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise ApiError(400, "'format' must be \"json\" or a JSON schema object", param="format", code="invalid_value")
    return out


def _chat_messages(msgs: Any) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: tool calls get ids (Ollama's have none) that the tool results after them answer."""
    if not isinstance(msgs, list):
        raise ApiError(400, "'messages' must be a list", param="messages", code="invalid_type")
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, Optional[str]]] = []  # (id, name) of calls not answered yet, oldest first
    for m in msgs:
        if not isinstance(m, dict):
            raise ApiError(400, "each message must be an object", param="messages", code="invalid_type")
        if m.get("images"):
            raise ApiError(400, "images are not supported by this server", param="messages", code="unsupported_content")
        msg = {k: m[k] for k in ("role", "content") if k in m}
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = (tc or {}).get("function") or {}
                cid = tools.new_call_id()
                args = fn.get("arguments", {})
                calls.append(
                    {
                        "id": cid,
                        "type": "function",
                        "function": {"name": fn.get("name"), "arguments": args if isinstance(args, str) else json.dumps(args)},
                    }
                )
                open_calls.append((cid, fn.get("name")))
            msg["tool_calls"] = calls
        elif m.get("role") == "tool":
            name = m.get("tool_name") or m.get("name")
            pick = next((c for c in open_calls if c[1] == name), open_calls[0] if open_calls else None)
            if pick is not None:
                open_calls.remove(pick)
            msg["tool_call_id"] = pick[0] if pick else None
        out.append(msg)
    return out


def _durations(run: Running, stats: Any) -> dict[str, Any]:
    ns = 1_000_000_000
    load = run.start.get("load_ms", 0.0) * 1e6
    total = run.start.get("queue_ms", 0.0) * 1e6 + load + (stats.prompt_seconds + stats.generation_seconds) * ns
    return {
        "total_duration": int(total),
        "load_duration": int(load),
        "prompt_eval_count": stats.prompt_tokens,
        "prompt_eval_duration": int(stats.prompt_seconds * ns),
        "eval_count": stats.generated_tokens,
        "eval_duration": int(stats.generation_seconds * ns),
    }


def _details(ctx: ServeContext, m: dict[str, Any]) -> dict[str, Any]:
    arch = m.get("architecture") or ""
    return {
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": m.get("parameter_size", ""),
        "quantization_level": (m.get("level") or "").upper(),
    }


# long: the seven routes are closures over the shared context; each is a short translation
def routes(ctx: ServeContext) -> list[Any]:
    from starlette.responses import StreamingResponse  # lazy: the server extra
    from starlette.routing import Route

    def ollama_errors(handler):
        async def wrapped(request: Any):
            try:
                return await handler(request)
            except ApiError as e:
                msg = e.message
                if e.code == "model_not_found":
                    msg = f"model '{(getattr(request.state, 'model', None) or '')}' not found"
                return json_response({"error": msg}, e.status, e.headers)

        return wrapped

    async def body_and_model(request: Any) -> tuple[dict[str, Any], ModelSpec]:
        ctx.check_auth(request)
        body = await read_json(request)
        request.state.model = body.get("model") or body.get("name")
        return body, ctx.models.find(request.state.model)

    def ndjson(lines):
        async def gen():
            async for obj in lines:
                yield json.dumps(obj) + "\n"

        return StreamingResponse(gen(), media_type="application/x-ndjson")

    async def reply(request: Any, body: dict[str, Any], spec: ModelSpec, req: Any, key: str):
        """/api/chat (`key` "message") and /api/generate (`key` "response"), streamed or whole."""
        stream = body.get("stream") is not False  # Ollama streams unless told not to
        run = await submit(ctx, request, spec, req, stream=stream)
        plan = run.start.get("plan")
        # with tools offered, the reply is held back whole and parsed for calls by its plan
        held = plan if plan is not None and plan.request.offered() else None
        hold = held is not None
        name = body.get("model")
        notes = _num_ctx_note(ctx, spec, body)

        def piece(text: str) -> dict[str, Any]:
            part: Any = {"role": "assistant", "content": text} if key == "message" else text
            return {"model": name, "created_at": _now(), key: part, "done": False}

        def last(text: str, stats: Any) -> dict[str, Any]:
            done = piece("" if not hold else text)
            reason = FINISH.get(stats.stop_reason, "stop")
            if held is not None:
                parsed = held.parse(text, cut=stats.stop_reason == "length")
                ctx.metrics.count_tool_calls(len(parsed.calls))
                done[key]["content"] = parsed.content or ""
                if parsed.calls:
                    done[key]["tool_calls"] = [
                        {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in parsed.calls
                    ]
                notes.extend(held.warnings + parsed.warnings)
            if notes:
                done["warnings"] = notes
            done.update(done=True, done_reason=reason, **_durations(run, stats))
            return done

        if not stream:
            got = await run.collect()
            text = "".join(got.text)
            out = last(text, got.stats)
            if not hold:
                out[key] = piece(text)[key]
            return json_response(out)

        async def lines():
            text = []
            async for ev, val in run.events():
                if ev == "text":
                    text.append(val)
                    if not hold:
                        yield piece(val)
                elif ev == "end":
                    yield last("".join(text), val)

        return ndjson(lines())

    async def chat(request: Any):
        body, spec = await body_and_model(request)
        oa = {"messages": _chat_messages(body.get("messages")), **_openai_body(body)}
        if body.get("tools"):
            oa["tools"] = body["tools"]
        req = parse_chat(oa)
        if not body.get("messages"):  # Ollama loads the model for an empty chat and answers done
            return json_response(
                {
                    "model": body.get("model"),
                    "created_at": _now(),
                    "message": {"role": "assistant", "content": ""},
                    "done_reason": "load",
                    "done": True,
                }
            )
        return await reply(request, body, spec, req, "message")

    async def generate(request: Any):
        body, spec = await body_and_model(request)
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string", param="prompt", code="invalid_type")
        if not prompt:
            return json_response(
                {"model": body.get("model"), "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
            )
        if body.get("raw"):  # the prompt as it is, no template
            oa = _openai_body(body)
            req = parse_completion({"prompt": prompt, **oa})
            req.max_tokens = oa.get("max_tokens")  # Ollama's default: no limit but the context
        else:
            msgs = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + [
                {"role": "user", "content": prompt}
            ]
            req = parse_chat({"messages": msgs, **_openai_body(body)})
        return await reply(request, body, spec, req, "response")

    async def embed(request: Any):
        body, spec = await body_and_model(request)
        legacy = request.url.path == "/api/embeddings"
        req, _ = parse_embeddings(body, "prompt" if legacy else "input")
        run = await submit(ctx, request, spec, req)
        got = await run.collect()
        res = got.embeddings
        if legacy:
            return json_response({"embedding": res.vectors[0]})
        load = run.start.get("load_ms", 0.0) * 1e6
        return json_response(
            {
                "model": body.get("model"),
                "embeddings": res.vectors,
                "total_duration": int(load),
                "load_duration": int(load),
                "prompt_eval_count": res.prompt_tokens,
            }
        )

    def listing(loaded_only: bool = False) -> list[dict[str, Any]]:
        loaded = ctx.pool.loaded()
        out = []
        for m in ctx.models.listing(loaded):
            if loaded_only and not m["loaded"]:
                continue
            entry = {
                "name": m["id"] + ":latest",
                "model": m["id"] + ":latest",
                "modified_at": _iso(m["created"]),
                "size": m.get("size_bytes") or 0,
                "digest": m.get("sha256") or "",
                "details": _details(ctx, m),
            }
            if loaded_only:
                entry.update(
                    expires_at=_iso(2**31 - 1),
                    size_vram=0,
                    context_length=ctx.pool.model_ctx(ctx.models.find(m["id"])) // ctx.pool.parallel,
                )
            out.append(entry)
        return out

    async def tags(request: Any):
        ctx.check_auth(request)
        return json_response({"models": listing()})

    async def ps(request: Any):
        ctx.check_auth(request)
        return json_response({"models": listing(loaded_only=True)})

    async def show(request: Any):
        body, spec = await body_and_model(request)
        from edgellm.gguf.reader import read_gguf

        info = read_gguf(spec.path)
        m = next((m for m in ctx.models.listing(ctx.pool.loaded()) if m["id"] == spec.name), {"architecture": info.architecture})
        m.setdefault("level", info.level)
        caps = ["completion", "tools", "embedding"]
        model_info = {
            "general.architecture": info.architecture,
            "general.name": info.name,
            "general.parameter_count": info.parameters,
            f"{info.architecture}.context_length": info.context_length,
            f"{info.architecture}.embedding_length": info.embedding_length,
            f"{info.architecture}.block_count": info.block_count,
        }
        return json_response(
            {
                "modelfile": f"FROM {spec.path}\n",
                "parameters": "",
                "template": info.chat_template or "",
                "details": _details(ctx, {**m, "parameter_size": _params(info.parameters)}),
                "model_info": model_info,
                "capabilities": caps,
                "modified_at": _iso(spec.path.stat().st_mtime),
            }
        )

    async def version(request: Any):
        return json_response({"version": API_VERSION})

    return [
        Route("/api/chat", ollama_errors(chat), methods=["POST"]),
        Route("/api/generate", ollama_errors(generate), methods=["POST"]),
        Route("/api/embed", ollama_errors(embed), methods=["POST"]),
        Route("/api/embeddings", ollama_errors(embed), methods=["POST"]),
        Route("/api/tags", ollama_errors(tags), methods=["GET"]),
        Route("/api/ps", ollama_errors(ps), methods=["GET"]),
        Route("/api/show", ollama_errors(show), methods=["POST"]),
        Route("/api/version", ollama_errors(version), methods=["GET"]),
    ]


def _num_ctx_note(ctx: ServeContext, spec: ModelSpec, body: dict[str, Any]) -> list[str]:
    """A warning for an `options.num_ctx` above what a request gets here (slots are sized at load, not per request)."""
    n = (body.get("options") or {}).get("num_ctx")
    limit = ctx.pool.model_ctx(spec) // ctx.pool.parallel
    if isinstance(n, int) and not isinstance(n, bool) and n > limit:
        return [
            f"options.num_ctx {n} is more than a request gets on this server ({limit} tokens: --ctx / --parallel); "
            f"it runs with {limit}"
        ]
    return []


def _params(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}".rstrip("0").rstrip(".") + unit
    return str(n)


__all__ = ["routes", "API_VERSION"]
