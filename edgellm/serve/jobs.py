"""The units of work of `edgellm serve`: a parsed request, the job that carries it to a model's
worker, and the error type every route turns into an OpenAI- or Ollama-shaped body."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from edgellm.engine.runtime import SamplingParams
from edgellm.progress import CancelToken


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "server_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: Optional[str] = None,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or self.TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code="server_shutting_down")


def client_gone() -> ApiError:
    return ApiError(
        499,
        "the request was cancelled before it ran (the client went away)",
        type="invalid_request_error",
        code="request_cancelled",
    )


@dataclass(frozen=True)
class ModelSpec:
    """A store model the server may load."""

    name: str
    path: Path
    context_length: int = 0


@dataclass
class JobRequest:
    """One completion to run: what the HTTP layer parsed and validated."""

    kind: str  # "chat", "completion" or "embed"
    messages: Optional[list[dict[str, Any]]] = None
    prompt: Union[str, list[int], None] = None
    inputs: Optional[list[Union[str, list[int]]]] = None  # embed: texts or token lists
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: Optional[int] = None  # None: the rest of the context
    constraint: Any = None  # an edgellm.chat.structured.Constraint from response_format
    tools: Any = None  # an edgellm.serve.tools.ToolRequest
    tool_plan: Any = None  # its edgellm.serve.tools.ToolPlan for the model, made on the HTTP side
    logprobs: Optional[int] = None  # None: off; k: the chosen token's log-probability and the top k


class Job:
    def __init__(self, request: JobRequest, emit: Callable[[tuple[str, Any]], None]) -> None:
        self.request = request
        self.emit = emit
        self.cancel = CancelToken()
        self.enqueued = time.perf_counter()


__all__ = ["ApiError", "Job", "JobRequest", "ModelSpec", "client_gone", "shutting_down"]
