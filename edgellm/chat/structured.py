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

from edgellm.errors import UsageError
from edgellm.fsutil import unreadable

log = logging.getLogger(__name__)


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
        from llama_cpp.llama_grammar import LlamaGrammar

        return LlamaGrammar.from_string(self.gbnf, verbose=False)

    def check(self, runtime) -> "Constraint":
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
    import jsonschema

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
    if not isinstance(schema, dict):
        raise UsageError(f"the JSON schema{_of(source)} must be a JSON object")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise UsageError(f"invalid JSON schema{_of(source)}: {where + ': ' if where else ''}{e.message}"[:300]) from None
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises assorted types for unsupported features
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"cannot turn the JSON schema{_of(source)} into a grammar: {msg}"[:300]) from None
    return Constraint(gbnf=gbnf, schema=schema, source=source)


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
