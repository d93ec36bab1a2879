"""JSON schemas the API refuses before the engine pays for them (no server): schema patterns xgrammar cannot
compile, keywords it would silently ignore, schemas nested too deeply; and an engine-side compile failure that
still reaches the client as a 400."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

import common.json_schema_check as checks
from common.messages import EngineOutput, EngineRequest, FinishReason, SamplingParams, StructuredOutput
from common.structured import INVALID_CONSTRAINT, grammar_of, spec_error
from frontend.api.protocol import ChatCompletionRequest
from frontend.api.serving import ServingContext
from frontend.api.structured_request import requested
from frontend.engine.request_stream import Delta, RequestStream
from frontend.errors import ApiError


def schema(value: Any) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(value))


def compact(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))  # the layout the grammar generates


def engine_compile(so: StructuredOutput) -> None:
    """As the engine compiles (its compiler's cache on), over a small vocabulary."""
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["</s>"], stop_token_ids=[95])
    xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar_of(so))


LONG_REPEATS = ["a{129}", "[0-9a-f]{512}", "^.{1,256}$", "^[a-z]+(-[a-z]+){0,200}$", "a{129,}"]


@pytest.mark.parametrize("pattern", LONG_REPEATS)
def test_schema_patterns_the_engine_cannot_compile_are_refused(pattern: str):
    so = schema({"type": "object", "properties": {"id": {"type": "string", "pattern": pattern}}})
    with pytest.raises(RuntimeError):
        engine_compile(so)  # what the engine would have run into: a 500 after the request was accepted
    error = spec_error(so)
    assert error is not None and "repetition count" in error and "/properties/id" in error


def test_a_huge_repeat_count_is_refused_before_xgrammar_parses_it():
    start = time.perf_counter()
    error = spec_error(schema({"type": "string", "pattern": "a{20000}"}))
    assert error is not None and "20000" in error
    assert time.perf_counter() - start < 1  # xgrammar alone took 21 s over it


def test_the_api_check_compiles_what_it_does_not_scan(monkeypatch: pytest.MonkeyPatch):
    """A grammar that builds but does not compile is a 400 even where no scan knows the reason."""
    monkeypatch.setattr(checks, "MAX_PATTERN_REPEAT", 10**6)
    error = spec_error(schema({"type": "string", "pattern": "a{129}"}))
    assert error is not None and "compile" in error
    assert spec_error(schema({"type": "string", "pattern": "a{128}"})) is None


# (schema, an instance the schema rejects that xgrammar's grammar of it would let the model write, the keyword)
IGNORED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1], "contains"),
    ({"type": "integer", "not": {"const": 3}}, 3, "not"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, {"a": 1}, "if"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, {"a": 1}, "dependentRequired"),
    ({"type": "string", "pattern": "^(?!x).*$"}, "xy", "lookaround"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 3, "allOf"),
    ({"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
      "allOf": [{"required": ["y"]}]}, {"x": 1}, "allOf"),
    ({"$defs": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}}}, "$ref": "#/$defs/a",
      "required": ["x"]}, {}, "required"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf"),
    ({"$defs": {"a": {"$anchor": "a", "type": "integer"}}, "$ref": "#a"}, "x", "not a local reference"),
]  # fmt: skip


@pytest.mark.parametrize(("value", "invalid", "keyword"), IGNORED, ids=[c[2] for c in IGNORED])
def test_keywords_xgrammar_ignores_are_refused(value: Any, invalid: Any, keyword: str):
    assert not jsonschema.Draft202012Validator(value).is_valid(invalid)
    assert _is_grammar_accept_string(grammar_of(schema(value)), compact(invalid))  # why it must be refused
    error = spec_error(schema(value))
    assert error is not None and keyword in error


ACCEPTED = [
    # Annotations, and data that only looks like keywords (const, enum, default, examples, property names).
    {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/s", "title": "T",
     "description": "d", "$comment": "c", "type": "object", "examples": [{"not": 1}], "default": {"if": 2},
     "properties": {"not": {"type": "integer", "deprecated": True}, "uniqueItems": {"const": {"contains": 1}},
                    "tags": {"type": "array", "items": {"enum": [{"allOf": []}]}, "uniqueItems": False},
                    "n": {"type": "integer", "multipleOf": 3}, "when": {"type": "string", "format": "date-time"}}},
    # What pydantic writes for nested models, optionals, defaults and a discriminated union.
    {"$defs": {"Addr": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^\\d{5}$"}},
                        "required": ["zip"], "title": "Addr"},
               "Cat": {"type": "object", "properties": {"kind": {"const": "cat", "type": "string"}}},
               "Dog": {"type": "object", "properties": {"kind": {"const": "dog", "type": "string"}}}},
     "type": "object", "properties": {
         "home": {"$ref": "#/$defs/Addr", "description": "where", "default": {"zip": "12345"}},
         "work": {"anyOf": [{"$ref": "#/$defs/Addr"}, {"type": "null"}], "default": None},
         "legacy": {"allOf": [{"$ref": "#/$defs/Addr"}], "title": "Legacy"},
         "pet": {"discriminator": {"propertyName": "kind", "mapping": {"cat": "#/$defs/Cat"}},
                 "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}}},
    # What zod-to-json-schema writes for a reused sub-schema and for recursion.
    {"type": "object", "properties": {"home": {"type": "string"}, "work": {"$ref": "#/properties/home"},
                                      "children": {"type": "array", "items": {"$ref": "#"}}},
     "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
    {"type": "string", "pattern": "^[a-z]{1,128}$"},
]  # fmt: skip


@pytest.mark.parametrize("value", ACCEPTED)
def test_common_schemas_are_accepted(value: dict):
    assert spec_error(schema(value)) is None


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def nested(depth: int) -> dict:
    value: dict = {"type": "integer"}
    for _ in range(depth):
        value = {"type": "array", "items": value}
    return value


@pytest.mark.parametrize(("field", "wrap"), [
    ("response_format", lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
    ("guided_json", lambda s: s),
    ("guided_json", json.dumps),  # the text form is parsed to count its levels
    ("structured_outputs", lambda s: {"json": s}),
])  # fmt: skip
def test_schemas_nested_too_deeply_are_400s(field: str, wrap: Any):
    assert requested(chat(**{field: wrap(nested(31))})) is not None  # 32 levels, the innermost "integer" included
    start = time.perf_counter()
    with pytest.raises(ApiError) as info:
        requested(chat(**{field: wrap(nested(400))}))
    assert info.value.status == 400 and info.value.param == field and "32 levels" in info.value.message
    assert time.perf_counter() - start < 1  # spec_error took 3.5 s over it
    with pytest.raises(ApiError):
        requested(chat(**{field: wrap(nested(32))}))


def test_an_engine_compile_failure_is_the_requests_400():
    """The engine's answer when a grammar the API let through does not compile: a code the API maps to a 400."""

    async def engine_says() -> Delta:
        params = SamplingParams(structured=StructuredOutput("regex", "a"))
        stream = RequestStream(EngineRequest("r", [1], params), None)
        stream.on_output(EngineOutput("r", [], FinishReason.ERROR, error="could not be compiled",
                                      error_code=INVALID_CONSTRAINT))  # fmt: skip
        return await anext(stream)

    delta = asyncio.run(engine_says())
    assert delta.finish_reason == "error" and delta.error_code == INVALID_CONSTRAINT
    ctx = ServingContext(SimpleNamespace(dead=None), None, "m", 8, 8)  # type: ignore[arg-type]
    error = ctx.failure(delta.error, delta.error_code)
    assert error.status == 400 and error.body()["error"]["type"] == "invalid_request_error"
    assert ctx.failure("boom", None).status == 500  # any other engine failure stays a 500
