"""OpenAI `tools` entries for the server and tool-format tests: the envelope
({"type": "function", "function": {...}}) written once, so a test states only
the function's name, description and arguments."""

from __future__ import annotations

from typing import Any


def function_tool(name: str, properties: dict[str, Any], *, description: str | None = None, closed: bool = False) -> dict:
    """A function tool whose arguments are `properties`, all required; `closed` forbids any other
    (additionalProperties: false). Keys stay in the order clients send them: a template renders them so."""
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": list(properties)}
    if closed:
        parameters["additionalProperties"] = False
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}
