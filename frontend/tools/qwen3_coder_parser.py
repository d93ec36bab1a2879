"""Qwen3-Coder's tool calls (--tool-call-parser qwen3_coder, vLLM's name; Qwen3-Coder-30B-A3B and -480B-A35B): each
call is XML-like, between the hermes tags, and its values are written bare, one parameter a block:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags less the newline after the opening tag and the one before the closing tag
(so code spans lines as written), typed by its parameter's schema in the request's tools: strings stay text,
integers, numbers and booleans are read as such, objects and arrays (and values of schemas without a type) as
JSON; a value that does not read as its type stays text, as vLLM's parser leaves it, and so does a parameter the
schema does not name; `null` is null (but for a string). A call is held
until </tool_call> and emitted whole, as hermes calls are (`HermesParser`); a body that is not a function block
stays content, exactly as written. The model may leave out </parameter> or </function> where the next tag or the
end makes them plain, as vLLM's parser allows.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from frontend.tools.tool_parsers import HermesParser, call_of, no_constant

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_INTEGER = re.compile(r"-?\d+\Z")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?\Z")
STRING_TYPES = ("string", "str", "text")


def _kind(schema: Any) -> str | None:
    """A parameter's JSON type: its schema's `type` (the first other than null where it lists several), an enum's
    members' kind taken as text; None where the schema says neither."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind is None and "enum" in schema:
        return "string"
    return kind if isinstance(kind, str) else None


def typed_value(text: str, schema: Any) -> Any:
    """A bare value as its parameter's type (text where it does not read as one)."""
    kind = _kind(schema)
    if text.strip().lower() == "null" and kind not in STRING_TYPES:
        return None
    if kind in STRING_TYPES:
        return text
    bare = text.strip()
    if kind in ("integer", "int"):
        return int(bare) if _INTEGER.match(bare) and len(bare) < 400 else text
    if kind in ("number", "float"):
        if not _NUMBER.match(bare) or len(bare) >= 400:
            return text
        number = float(bare)
        if not math.isfinite(number):
            return text
        return int(bare) if _INTEGER.match(bare) else number
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(bare.lower(), text)
    try:  # object, array, or a schema without a type: JSON
        value = json.loads(bare, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return text
    if kind == "object" and not isinstance(value, dict) or kind == "array" and not isinstance(value, list):
        return text
    return value


def _unwrap(value: str) -> str:
    """The value as the template writes it, less the newline that follows its opening tag and precedes its end."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderParser(HermesParser):
    """`parameters`: each function's parameters schema, by name (from the request's tools)."""

    def __init__(self, max_calls: int | None = None, parameters: dict[str, Any] | None = None) -> None:
        super().__init__(max_calls)
        self.parameters = parameters or {}

    def parse(self, inner: str) -> tuple[str, str] | None:  # type: ignore[override]
        function = _FUNCTION.match(inner)
        if function is None:
            return None
        name, body = function.group(1).strip(), function.group(2)
        properties = (self.parameters.get(name) or {}).get("properties")
        properties = properties if isinstance(properties, dict) else {}
        arguments: dict[str, Any] = {}
        at = 0
        for parameter in _PARAMETER.finditer(body):
            if body[at : parameter.start()].strip():  # text between the blocks: not this format
                return None
            key = parameter.group(1).strip()
            value = _unwrap(parameter.group(2))
            arguments[key] = typed_value(value, properties[key]) if key in properties else value  # unknown: text
            at = parameter.end()
        if body[at:].strip():
            return None
        return call_of({"name": name}, arguments)
