"""Structured output: constrain decoding with a JSON schema or a GBNF grammar.

A JSON schema is converted to GBNF with llama-cpp-python's converter (the
port of llama.cpp's json-schema-to-grammar), the grammar is parsed once by
llama.cpp up front (its parser prints to stderr and returns NULL, which would
crash the sampler later), and every reply is checked afterwards: JSON parsed
and validated against the schema with `jsonschema`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from edgellm.errors import UsageError, one_line
from edgellm.fsutil import unreadable

log = logging.getLogger(__name__)

# Limits on a schema turned into a grammar (docs/server.md states them): the converter and
# llama.cpp's grammar parser take time that grows with the schema, and a server builds grammars
# for anyone who asks. 50,000 enum values took 15 s; these take well under a second.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 64
MAX_ENUM_VALUES = 1024  # enum and const values in the whole schema


@dataclass
class Constraint:
    """A grammar for the sampler and, for a JSON schema, the schema to validate replies against."""

    gbnf: str
    schema: Optional[dict[str, Any]] = None
    source: str = ""

    @property
    def kind(self) -> str:
        return "json-schema" if self.schema is not None else "grammar"

    def grammar(self):
        from llama_cpp.llama_grammar import LlamaGrammar  # llama_cpp loads libllama: only where llama.cpp runs

        return LlamaGrammar.from_string(self.gbnf, verbose=False)

    def check(self, runtime) -> Constraint:
        """Have llama.cpp parse the grammar now; a bad one is a one-line UsageError."""
        try:
            runtime.check_grammar(self.gbnf)
        except UsageError as e:
            where = f" ({self.source})" if self.source else ""
            raise UsageError(f"{e}{where}") from None
        return self

    def validate(self, reply: str, *, stop_reason: str = "") -> Any:
        """Parse and validate a reply; returns the JSON value (None for a plain grammar)."""
        if self.schema is None:
            return None
        cut = " (the reply was cut at --max-tokens; raise it)" if stop_reason == "length" else ""
        try:
            value = json.loads(reply)
        except ValueError as e:
            raise UsageError(f"the reply is not valid JSON: {e}{cut}") from None
        err = validation_error(value, self.schema)
        if err:
            raise UsageError(f"the reply does not match the schema: {err}{cut}")
        return value


def validation_error(value: Any, schema: dict[str, Any]) -> Optional[str]:
    import jsonschema  # jsonschema is slow to import; only with a schema

    cls = jsonschema.validators.validator_for(schema)
    best = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    if best is None:
        return None
    where = "/".join(str(p) for p in best.absolute_path)
    return f"{where + ': ' if where else ''}{best.message}"[:300]


def from_json_schema(text: str, *, source: str = "") -> Constraint:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise UsageError(f"the JSON schema{_of(source)} is not valid JSON: {e}") from None
    check_schema(schema, source=source)
    from llama_cpp.llama_grammar import json_schema_to_gbnf  # llama_cpp loads libllama: only where llama.cpp runs

    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises assorted types for unsupported features
        raise UsageError(f"cannot turn the JSON schema{_of(source)} into a grammar: {one_line(e)}"[:300]) from None
    return Constraint(gbnf=gbnf, schema=schema, source=source)


def check_schema(schema: Any, *, source: str = "") -> None:
    """A JSON Schema object within the size limits and valid against its meta-schema, or a one-line UsageError."""
    if not isinstance(schema, dict):
        raise UsageError(f"the JSON schema{_of(source)} must be a JSON object")
    depth, values = _shape(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise UsageError(f"the JSON schema{_of(source)} is nested {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    if values > MAX_ENUM_VALUES:
        raise UsageError(f"the JSON schema{_of(source)} has {values} enum/const values; the limit is {MAX_ENUM_VALUES}")
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise UsageError(f"the JSON schema{_of(source)} is {size} bytes; the limit is {MAX_SCHEMA_BYTES}")
    import jsonschema  # jsonschema is slow to import; only with a schema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise UsageError(f"invalid JSON schema{_of(source)}: {where + ': ' if where else ''}{e.message}"[:300]) from None


def _shape(schema: Any) -> tuple[int, int]:
    """(nesting depth, enum/const values), walked without recursion so a deep schema cannot overflow the stack."""
    depth, values = 0, 0
    stack = [(schema, 1)]
    while stack:
        node, d = stack.pop()
        if d > depth:
            depth = d
        if d > MAX_SCHEMA_DEPTH:
            break
        if values > MAX_ENUM_VALUES:
            break
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                values += len(node["enum"])
            if "const" in node:
                values += 1
            # enum and const hold values, not schemas: nothing to walk there
            stack.extend((v, d + 1) for k, v in node.items() if isinstance(v, (dict, list)) and k not in ("enum", "const"))
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node if isinstance(v, (dict, list)))
    return depth, values


def from_gbnf(text: str, *, source: str = "") -> Constraint:
    if not text.strip():
        raise UsageError(f"the grammar{_of(source)} is empty")
    return Constraint(gbnf=text, schema=None, source=source)


def load_file(path: Path | str, *, kind: str) -> Constraint:
    """`kind` is "json-schema" or "grammar"."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(unreadable(p, e)) from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{p}: not UTF-8 text (bad byte at offset {e.start})") from None
    return from_json_schema(text, source=p.name) if kind == "json-schema" else from_gbnf(text, source=p.name)


def _of(source: str) -> str:
    return f" {source}" if source else ""
