"""A job's prompt for the batching engine: rendered (with the request's tool plan) and tokenized,
checked against a sequence slot's context, with its sampling, grammar and logprobs hook.
Runs on the model's worker thread; every refusal is a 400 `ApiError`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from edgellm.engine.runtime import Runtime, SamplingParams
from edgellm.errors import UsageError, one_line
from edgellm.serve.jobs import ApiError, Job, JobRequest


def prepare(rt: Runtime, template: Any, req: JobRequest, n_ctx: int) -> tuple[list[int], SamplingParams, Any]:
    """The prompt's tokens, the request's sampling and its tool plan, checked against a slot's `n_ctx`; 400s for what does not fit."""
    tokens, param, plan = _prompt_tokens(rt, template, req)
    n_prompt = len(tokens)
    if n_prompt >= n_ctx:
        raise ApiError(
            400,
            f"This model's maximum context length is {n_ctx} tokens. However, your "
            f"{'messages' if param == 'messages' else 'prompt'} resulted in {n_prompt} tokens. "
            "Please shorten it (or start the server with a larger --ctx).",
            param=param,
            code="context_length_exceeded",
        )
    if req.max_tokens is not None and n_prompt + req.max_tokens > n_ctx:
        raise ApiError(
            400,
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the {param}, {req.max_tokens} in the "
            "completion). Please reduce the length of the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    sampling = replace(req.sampling, max_tokens=req.max_tokens or (n_ctx - n_prompt))
    if req.kind == "chat" and template.stop_strings:  # the fallback template's turn marker
        sampling.stop = list(sampling.stop) + template.stop_strings
    constraint, param = req.constraint, "response_format"
    if plan is not None and plan.grammar is not None:
        from edgellm.chat.structured import from_gbnf

        constraint, param = from_gbnf(plan.grammar, source="the tools' grammar"), "tools"
    if constraint is not None:
        try:
            constraint.check(rt)  # llama.cpp's own parser, as `edgellm chat` checks it
        except UsageError as e:
            raise ApiError(400, f"{param}: {e}", param=param, code="invalid_schema") from None
        sampling.grammar = constraint.gbnf
    return tokens, sampling, plan


def logprob_hook(rt: Runtime, job: Job) -> Any:
    """The engine's per-token hook that posts ("logprob", TokenLogprob) events, when the request asks for them."""
    k = job.request.logprobs
    if k is None:
        return None
    from edgellm.engine.embed import token_logprobs  # lazy: numpy

    vocab, n_vocab = rt.llm._model.vocab, rt.llm.n_vocab()

    def hook(ctx: Any, row: int, tok: int) -> None:
        job.emit(("logprob", token_logprobs(ctx, vocab, n_vocab, row, tok, k)))

    return hook


def _prompt_tokens(rt: Runtime, template: Any, req: JobRequest) -> tuple[list[int], str, Any]:
    if req.kind == "chat":
        from edgellm.chat.session import template_tokens
        from edgellm.serve import tools

        plan = req.tool_plan
        try:
            if plan is None:
                return template_tokens(rt, template, req.messages or []), "messages", None
            toks = template_tokens(rt, template, plan.messages, **plan.extra)
            missing = [t.name for t in plan.request.offered() if plan.format != "generic" and t.name not in rt.detokenize(toks)]
            if missing:  # a template that takes `tools` and drops them: say so and use the generic format
                plan = tools.fallback_generic(
                    plan,
                    req.messages or [],
                    f"the chat template ignored the tools ({', '.join(missing)}); "
                    "used llama.cpp's generic JSON tool format instead",
                )
                toks = template_tokens(rt, template, plan.messages)
            return toks, "messages", plan
        except Exception as e:  # raise_exception() in the template, a Jinja error, or a render over its time limit
            raise ApiError(
                400, f"the model's chat template refused these messages: {one_line(e)}", param="messages", code="invalid_messages"
            ) from None
    if isinstance(req.prompt, list):
        n_vocab = rt.llm.n_vocab()
        if not req.prompt or any(t < 0 or t >= n_vocab for t in req.prompt):
            raise ApiError(400, f"prompt token ids must be non-empty and in [0, {n_vocab})", param="prompt")
        return list(req.prompt), "prompt", None
    return rt.tokenize(req.prompt or "", add_bos=True, special=True), "prompt", None


__all__ = ["prepare", "logprob_hook"]
