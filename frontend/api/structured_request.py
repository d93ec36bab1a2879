"""A request's output constraint: OpenAI's response_format, vLLM's guided_* fields and structured_outputs object ->
one StructuredOutput, checked here (an invalid schema, regex or grammar is a 400) before the engine compiles it."""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec

from common.json_schema_check import MAX_SCHEMA_DEPTH, depth_exceeds
from common.messages import SamplingParams, StructuredOutput
from common.structured import MAX_SPEC_CHARS, spec_error
from frontend.api.protocol import StructuredFields
from frontend.api.serving import off_loop
from frontend.errors import bad_request


def _json_text(value: Any, param: str) -> str:
    """A schema given as an object, a boolean or JSON text -> JSON text (the engine's spec)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError) as exc:  # nested past Python's recursion limit
        raise bad_request(f"{param} cannot be encoded as JSON: {exc}", param) from None


def _too_deep(value: Any) -> bool:
    if isinstance(value, str):  # the text form is parsed to count its levels
        if len(value) > MAX_SPEC_CHARS:
            return False  # refused for its length
        try:
            value = json.loads(value)
        except RecursionError:
            return True
        except ValueError:
            return False  # not JSON: the check says where
    return depth_exceeds(value, MAX_SCHEMA_DEPTH)


def _schema(value: Any, param: str) -> StructuredOutput:
    """A JSON schema nested at most MAX_SCHEMA_DEPTH levels, as tools' parameters: xgrammar's conversion takes
    seconds over a few hundred, in the API's check and again in the engine."""
    if _too_deep(value):
        raise bad_request(f"{param} holds a schema nested deeper than {MAX_SCHEMA_DEPTH} levels", param)
    return StructuredOutput("json_schema", _json_text(value, param))


def _specs(schema: Any, regex: str | None, choice: list[str] | None, grammar: str | None,
           params: tuple[str, str, str, str]) -> list[tuple[StructuredOutput, str]]:  # fmt: skip
    """The json / regex / choice / grammar constraints given (vLLM's guided_* fields and structured_outputs hold
    the same four), each with the field that asked."""
    found: list[tuple[StructuredOutput, str]] = []
    if schema is not None:
        found.append((_schema(schema, params[0]), params[0]))
    if regex is not None:
        found.append((StructuredOutput("regex", regex), params[1]))
    if choice is not None:
        found.append((StructuredOutput("choice", json.dumps(choice)), params[2]))
    if grammar is not None:
        found.append((StructuredOutput("grammar", grammar), params[3]))
    return found


def requested(req: StructuredFields) -> tuple[StructuredOutput, str] | None:
    """The constraint the request asks for and the field that asked, or None; more than one is a 400."""
    found: list[tuple[StructuredOutput, str]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append((StructuredOutput("json_object"), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema object", "response_format")
        schema = fmt.json_schema.schema_
        found.append((StructuredOutput("json_object") if schema is None else _schema(schema, "response_format"),
                      "response_format"))  # fmt: skip
    found += _specs(req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar,
                    ("guided_json", "guided_regex", "guided_choice", "guided_grammar"))  # fmt: skip
    so = req.structured_outputs
    if so is not None:
        found += _specs(so.json_, so.regex, so.choice, so.grammar, ("structured_outputs",) * 4)
        if so.json_object:
            found.append((StructuredOutput("json_object"), "structured_outputs"))
    if len(found) > 1:
        names = ", ".join(f"{p} ({s.kind})" for s, p in found)
        raise bad_request(f"at most one output constraint may be given; this request has {names}", found[1][1])
    return found[0] if found else None


@functools.lru_cache(maxsize=256)
def _cached_error(so: StructuredOutput) -> str | None:
    return spec_error(so)  # tool schemas and response formats repeat: check each once


async def check(so: StructuredOutput, param: str) -> None:
    """400 unless xgrammar can build the constraint's grammar. Off the event loop: a large schema takes a while,
    and the first call imports xgrammar (and torch with it)."""
    error = await off_loop(_cached_error, so)
    if error is not None:
        raise bad_request(f"invalid {so.kind} constraint in {param}: {error}", param)


async def with_structured_output(req: StructuredFields, params: SamplingParams) -> SamplingParams:
    """params with the request's constraint, checked; unchanged (and no thread hop) when there is none."""
    found = requested(req)
    if found is None:
        return params
    so, param = found
    await check(so, param)
    return msgspec.structs.replace(params, structured=so)
