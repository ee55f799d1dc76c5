"""The tool-calling vocabulary shared by the request checks, the format planners and the
routes: what a tool, a call and a parsed reply are, and the bounds on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from edgellm.errors import UsageError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8  # calls per reply: a bound, so that a small model cannot loop on "," until max_tokens
GENERIC_INSTRUCTION = (
    "Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` reply to the user's request"
)


class ToolError(UsageError):
    """A request's tools, tool_choice or tool messages are wrong; `param` names the field."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    def to_openai(self, index: Optional[int] = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d = {"index": index, **d}
        return d


@dataclass
class ToolRequest:
    """The tools of one request: what the client asked for, checked."""

    tools: list[Tool]
    choice: str = "auto"  # auto | none | required | function
    forced: Optional[str] = None  # the function's name when choice == "function"
    parallel: bool = True

    def offered(self) -> list[Tool]:
        """The tools the model may call under `tool_choice`."""
        if self.choice == "none":
            return []
        if self.choice == "function":
            return [t for t in self.tools if t.name == self.forced]
        return list(self.tools)


@dataclass
class Parsed:
    content: Optional[str]
    calls: list[ToolCall] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
