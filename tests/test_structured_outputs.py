"""Constrained decoding over HTTP: sampled JSON that validates against 20 schemas, regex, choice, json_object,
streaming, n > 1, /v1/completions, and a 400 for every invalid constraint."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest

from tests.conftest import Server

MODEL = "SmolLM2-135M-Instruct"
SAMPLES = 5
MAX_TOKENS = 400  # far above what any schema below allows: the grammar, not the length limit, ends each answer


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required}


# maxLength 20 or more: xgrammar masks strings bounded below about 16 characters token by token at run time
# (5-15 ms per row per step here), longer bounds come from its precomputed masks (under 0.1 ms).
NAME = {"type": "string", "maxLength": 20}
SCHEMAS: dict[str, dict] = {
    "a person": obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "a point on a plane": obj({"x": {"type": "number", "minimum": -100, "maximum": 100},
                               "y": {"type": "number", "minimum": -100, "maximum": 100}}),
    "a favourite colour": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "a postal address": obj({"street": {"type": "string", "maxLength": 30}, "city": NAME,
                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "some small numbers": obj({"values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "minItems": 1, "maxItems": 5}}),
    "a task's flags": obj({"done": {"type": "boolean"}, "urgent": {"type": "boolean"}}),
    "a user account": obj({"user": obj({"name": NAME, "email": {"type": "string",
                                                                  "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}}),
                           "active": {"type": "boolean"}}),
    "a shopping list": obj({"items": {"type": "array", "maxItems": 3, "items": obj({
        "name": {"type": "string", "maxLength": 24}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}})}}),
    "a product code": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    "a date": obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    "a book title, maybe with a subtitle": obj({"title": NAME, "subtitle": NAME}, ["title"]),
    "a configuration header": obj({"version": {"const": 1}, "kind": {"const": "config"}}),
    "a small matrix": obj({"matrix": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}}),
    "a level and a mode": obj({"level": {"enum": [1, 2, 3]}, "mode": {"enum": ["fast", "slow"]}}),
    "a value": obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000},
                                        {"type": "string", "maxLength": 24}]}}),
    "an optional note": obj({"note": {"type": ["string", "null"], "maxLength": 24}}),
    "a deeply nested number": obj({"a": obj({"b": obj({"c": obj({"d": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}})})})}),
    "a list of words": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
    "a product": obj({"id": {"type": "integer", "minimum": 1, "maximum": 10000},
                      "price": {"type": "number", "minimum": 0, "maximum": 1000},
                      "in_stock": {"type": "boolean"}}),
    "an event": obj({"name": NAME, "attendees": {"type": "array", "maxItems": 2, "items": obj({
        "first": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}})},
                     "location": obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}})}),
}
assert len(SCHEMAS) == 20


@pytest.fixture(scope="module")
def http(server: Server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


def chat(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, **kw}


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """Every body at once: the engine batches them, which keeps this test short."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))


def test_twenty_schemas_sampled_at_temperature_one_all_validate(server: Server):
    bodies, schemas = [], []
    for i, (what, schema) in enumerate(SCHEMAS.items()):
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        for j in range(SAMPLES):
            # Half through OpenAI's response_format, half through vLLM's guided_json: the same constraint.
            extra = {"response_format": fmt} if j % 2 == 0 else {"guided_json": schema}
            bodies.append(chat(f"Describe {what} as JSON.", temperature=1.0, seed=100 * i + j, **extra))
            schemas.append(schema)
    responses = asyncio.run(post_all(server.url, bodies))
    for body, schema, resp in zip(bodies, schemas, responses, strict=True):
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", (body["messages"], text)
        jsonschema.validate(json.loads(text), schema)
        assert "\n" not in text  # one line: the grammar allows no free whitespace (a raw newline is no string's)


def test_regex_choice_and_json_object(http: httpx.Client):
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    out = http.post("/v1/chat/completions", json=chat("Name a street and a number.", guided_regex=regex,
                                                      n=3, temperature=1.0, seed=1)).json()  # fmt: skip
    assert len(out["choices"]) == 3
    for c in out["choices"]:
        assert re.fullmatch(regex, c["message"]["content"]), c
        assert c["finish_reason"] == "stop"
    choices = ["yes", "no", "it depends"]
    for body in (chat("Is the sea blue?", guided_choice=choices, temperature=1.0, n=4, seed=2),
                 chat("Is the sea blue?", structured_outputs={"choice": choices}, temperature=0)):
        out = http.post("/v1/chat/completions", json=body).json()
        assert all(c["message"]["content"] in choices and c["finish_reason"] == "stop" for c in out["choices"]), out
    for extra in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        body = chat("Give me a JSON object with a cat's name and age.", temperature=0, max_tokens=200, **extra)
        out = http.post("/v1/chat/completions", json=body).json()
        assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict), out
    # response_format text is no constraint at all: the same greedy answer as without it.
    plain = chat("Hello!", max_tokens=12, temperature=0)
    texts = [http.post("/v1/chat/completions", json=b).json()["choices"][0]["message"]["content"]
             for b in (plain, {**plain, "response_format": {"type": "text"}})]  # fmt: skip
    assert texts[0] == texts[1]


def test_completions_endpoint_and_grammar(http: httpx.Client):
    out = http.post("/v1/completions", json={"model": MODEL, "prompt": "The year the war ended:", "max_tokens": 50,
                                             "temperature": 1.0, "seed": 4, "guided_regex": "1[89][0-9]{2}",
                                             "n": 2}).json()  # fmt: skip
    assert [bool(re.fullmatch("1[89][0-9]{2}", c["text"])) for c in out["choices"]] == [True, True], out
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    out = http.post("/v1/completions", json={"model": MODEL, "prompt": "Q: Is water wet?\nA:", "max_tokens": 50,
                                             "temperature": 1.0, "guided_grammar": grammar}).json()  # fmt: skip
    assert out["choices"][0]["text"] in ("The answer is yes.", "The answer is no."), out
    assert out["choices"][0]["finish_reason"] == "stop"


def test_streamed_json_concatenates_to_valid_json(http: httpx.Client):
    schema = SCHEMAS["an event"]
    body = chat("Describe an event as JSON.", temperature=1.0, seed=5, n=2, stream=True, guided_json=schema,
                logprobs=True, top_logprobs=2)  # fmt: skip
    texts, finish = ["", ""], [None, None]
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                texts[c["index"]] += c["delta"].get("content") or ""
                finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
    assert finish == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("extra", [
    {"guided_json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
    {"guided_json": "{not json"},
    {"guided_regex": "a(b"},
    {"guided_regex": "a{1000000}"},  # parsing alone would take xgrammar about 15 s
    {"structured_outputs": {"regex": "[z-a]"}},
    {"guided_grammar": 'root ::= undefined_rule'},
    {"guided_grammar": 'start ::= "a"'},
    {"guided_choice": []},
    {"response_format": {"type": "json_schema"}},
    {"guided_regex": "a", "guided_choice": ["a"]},
    {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
    {"response_format": {"type": "xml"}},
])  # fmt: skip
def test_invalid_constraints_are_400(http: httpx.Client, extra: dict):
    for url, body in (("/v1/chat/completions", chat("hi", max_tokens=5)),
                      ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5})):  # fmt: skip
        resp = http.post(url, json={**body, **extra})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
        assert error["param"] in ("guided_json", "response_format", "guided_regex", "structured_outputs",
                                  "guided_grammar", "guided_choice"), error  # fmt: skip
