"""Hypothesis strategies for whole fuzzed requests: a body per route's schema (clean or fuzzed), malformed, truncated,
non-UTF-8 and random JSON bodies, encoded with a content type; an example's slots."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from tests.fuzz_field_strategies import (
    ANTHROPIC_MESSAGES,
    BOOL,
    CLEAN_ANTHROPIC_MESSAGES,
    CLEAN_INPUT,
    CLEAN_MAX_TOKENS,
    CLEAN_MESSAGES,
    CLEAN_MODEL,
    CLEAN_PROMPT,
    CONVERSATION_FIELDS,
    IDS,
    INPUT,
    JUNK,
    LEGACY_FUNCTION,
    LONG_IDS,
    MAX_TOKENS,
    MESSAGES,
    MESSAGES_FIELDS,
    MODEL,
    MODEL_NAME,
    PRESENT,
    PROMPT,
    RESPONSES_FIELDS,
    SAMPLING,
    TEMPLATE_KWARGS,
    TEXT,
    field,
    weighted,
)

CMPL, CHAT, GEN, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"
RESP, MSGS, CONV = "/v1/responses", "/v1/messages", "/v1/conversations"


@dataclass(frozen=True)
class Req:
    path: str
    content: bytes
    content_type: str | None  # None: no header (HttpGuard treats every POST body as JSON)

    def __repr__(self) -> str:  # what a failure report shows: short enough to read, exact enough to replay
        body = self.content if len(self.content) <= 600 else self.content[:600] + b"...(%d bytes)" % len(self.content)
        return f"Req({self.path!r}, {body!r}, content_type={self.content_type!r})"


def encode(body: Any, ascii_only: bool) -> bytes:
    """ensure_ascii=True writes lone surrogates as "\\ud800" escapes (httpx's json= would raise on them) and NaN or
    Infinity as bare words (invalid JSON the server must refuse); without it non-ASCII text goes out as UTF-8."""
    if not ascii_only:
        try:
            return json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate has no UTF-8 form: fall back to the escape
            pass
    return json.dumps(body).encode("ascii")


def body(required: dict[str, tuple[SearchStrategy[Any], SearchStrategy[Any]]],
         extra: dict[str, SearchStrategy[Any]]) -> SearchStrategy[dict[str, Any]]:  # fmt: skip
    """required: name -> (clean, fuzzed) values; extra: optional name -> near-bound values. A body is clean (clean
    required values, near-bound optional ones) or fuzzed (required ones fuzzed or left out, optional ones of any
    type); either way at most four optional fields, so that one bad value decides."""
    names = sorted(extra)
    fuzzed_extra = {key: field(values) for key, values in extra.items()}

    @st.composite
    def draw_body(draw: st.DrawFn) -> dict[str, Any]:
        clean = draw(st.booleans())
        out: dict[str, Any] = {}
        for key, (good, fuzzed) in required.items():
            if clean:
                out[key] = draw(good)
            elif draw(PRESENT):
                out[key] = draw(fuzzed)
        for key in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)) if names else []:
            out[key] = draw((extra if clean else fuzzed_extra)[key])
        return out

    return draw_body()


MODEL_FIELD = (CLEAN_MODEL, MODEL_NAME)
MAX_TOKENS_FIELD = (CLEAN_MAX_TOKENS, field(MAX_TOKENS))
LOGPROBS = weighted((4, st.integers(-1, 25)), (1, st.none()))
COMPLETION = body(
    {"model": MODEL_FIELD, "prompt": (CLEAN_PROMPT, PROMPT), "max_tokens": MAX_TOKENS_FIELD},
    {**SAMPLING, "echo": BOOL, "logprobs": LOGPROBS, "prompt_logprobs": LOGPROBS, "add_special_tokens": BOOL},
)
CHAT_BODY = body(
    {"model": MODEL_FIELD, "messages": (CLEAN_MESSAGES, MESSAGES), "max_tokens": MAX_TOKENS_FIELD},
    {
        **SAMPLING,
        "max_completion_tokens": MAX_TOKENS,
        "logprobs": BOOL,
        "add_generation_prompt": BOOL,
        "add_special_tokens": BOOL,
        "top_logprobs": LOGPROBS,
        "prompt_logprobs": LOGPROBS,
        "echo": BOOL,
        "chat_template_kwargs": TEMPLATE_KWARGS,
        "functions": st.lists(LEGACY_FUNCTION, max_size=2),
        "function_call": st.sampled_from(["auto", "none", "required", {"name": "get_weather"}, {"name": "nope"}]),
    },
)
GENERATE = body(
    {
        "model": MODEL_FIELD,
        "prompt": (CLEAN_PROMPT, weighted((4, TEXT), (2, IDS), (1, LONG_IDS), (1, JUNK))),
        "max_tokens": MAX_TOKENS_FIELD,
    },
    SAMPLING,
)
TOKENIZE = body(
    {"model": MODEL_FIELD},
    {
        "prompt": TEXT,
        "messages": st.one_of(CLEAN_MESSAGES, MESSAGES),
        "add_special_tokens": BOOL,
        "add_generation_prompt": BOOL,
    },
)
RESPONSES = body(
    {"model": MODEL_FIELD, "input": (CLEAN_INPUT, INPUT), "max_output_tokens": MAX_TOKENS_FIELD}, RESPONSES_FIELDS
)
ANTHROPIC = body(  # model and max_tokens are required here
    {"model": (st.just(MODEL), MODEL_NAME), "messages": (CLEAN_ANTHROPIC_MESSAGES, ANTHROPIC_MESSAGES),
     "max_tokens": MAX_TOKENS_FIELD},
    MESSAGES_FIELDS,
)  # fmt: skip
CONVERSATION = body({}, CONVERSATION_FIELDS)
DETOKENIZE = body(
    {"model": MODEL_FIELD, "tokens": (IDS, field(st.one_of(IDS, LONG_IDS, st.lists(IDS, max_size=2))))}, {}
)

CONTENT_TYPE = st.sampled_from(["application/json", "application/json", None, "text/plain",
                                "application/x-www-form-urlencoded", "application/json; charset=utf-8"])  # fmt: skip
# Mostly the routes that parse bodies; now and then one that takes no POST, or none at all.
ANY_PATH = st.sampled_from([CMPL, CHAT, GEN, TOK, DETOK, RESP, MSGS, CMPL, CHAT, GEN, TOK, DETOK, RESP, MSGS,
                            "/v1/models", "/health", "/v1/nothing"])  # fmt: skip


def encoded(path: str | SearchStrategy[str], bodies: SearchStrategy[Any]) -> SearchStrategy[Req]:
    paths = st.just(path) if isinstance(path, str) else path
    return st.builds(lambda p, b, a, ct: Req(p, encode(b, a), ct), paths, bodies, st.booleans(), CONTENT_TYPE)


SCHEMA_REQS = st.one_of(encoded(CMPL, COMPLETION), encoded(CHAT, CHAT_BODY), encoded(GEN, GENERATE),
                        encoded(TOK, TOKENIZE), encoded(DETOK, DETOKENIZE), encoded(RESP, RESPONSES),
                        encoded(MSGS, ANTHROPIC), encoded(CONV, CONVERSATION))  # fmt: skip
RANDOM_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_subnormal=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
MALFORMED = [
    b"", b"null", b"[]", b"[1, 2]", b"123", b'"x"', b"{", b"}", b'{"prompt": "x",}', b'{"prompt": "x"} trailing',
    b'{"prompt": "\xff\xfe", "max_tokens": 2}', b"\xff\xfe\x00\x00", b"\xc3\x28", b'{"prompt": "\\ud800"}',
    b'\xef\xbb\xbf{"prompt": "Hi", "max_tokens": 1}', '{"prompt": "Hi", "max_tokens": 1}'.encode("utf-16"),
    b'{"prompt": NaN}', b'{"prompt": "Hi", "max_tokens": 1e999}', b'{"prompt": "Hi", "max_tokens": 1, "max_tokens": 2}',
    b'{"prompt": "\\u0000", "max_tokens": 1}', b'{"prompt": "x", "stop": "\\udfff"}',
]  # fmt: skip
DEEP = [  # built on demand: listed, they would make hypothesis' repr of the strategy megabytes long
    lambda: b"[" * 20_000,  # far past any parser's recursion limit
    lambda: b'{"a":' * 20_000,
    lambda: b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}",
    lambda: b'{"prompt": "Hi"' + b" " * 5000,
]
TRUNCATED = st.builds(lambda r, cut: Req(r.path, r.content[: cut % max(len(r.content), 1)], r.content_type),
                      SCHEMA_REQS, st.integers(0, 10**6))  # fmt: skip
NOT_UTF8 = st.builds(lambda r, at: Req(r.path, r.content[:at] + b"\xff" + r.content[at:], r.content_type),
                     SCHEMA_REQS, st.integers(0, 40))  # fmt: skip
RAW_REQS = st.one_of(
    st.builds(Req, ANY_PATH, st.sampled_from(MALFORMED), CONTENT_TYPE),
    st.builds(lambda path, make, ct: Req(path, make(), ct), ANY_PATH, st.sampled_from(DEEP), CONTENT_TYPE),
    TRUNCATED,
    NOT_UTF8,
    encoded(ANY_PATH, RANDOM_JSON),
)


@st.composite
def request(draw: st.DrawFn) -> Req:
    """Three in four bodies for a route's schema, one malformed or random. A composite for its short repr: hypothesis
    renders the strategy it filters for unique_by, and this one spelled out is hundreds of KB."""
    return draw(weighted((3, SCHEMA_REQS), (1, RAW_REQS)))


# A slot of an example holds a body, or (one time in ten) None: nothing sent. The shrinker empties the slots that do
# not matter, so that a failing example comes down to its failing bodies.
SLOT = weighted((1, st.none()), (9, request()))


def slot_key(slot: Req | None) -> object:
    return object() if slot is None else (slot.path, slot.content)  # no body twice in one example; None any number
