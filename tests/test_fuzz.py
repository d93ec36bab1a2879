"""Property-based fuzzing of every POST route's request schema: whatever the body, the answer is a 200 that parses
(SSE ending in [DONE], /generate streams that complete) or an OpenAI-shaped 4xx; never a 5xx, a hang or a leak."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from tests.conftest import Server, engine_child
from tests.test_api_streaming import assert_engine_idle_within, metric

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
CMPL, CHAT, GEN, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"
# Bodies sent at once per example. An example lasts as long as its longest generation, and a CPU decode step costs
# little more for 50 sequences than for 1 (reading the weights dominates): wide examples keep the wall time low.
BATCH = 50
EXAMPLES = 47  # 47 x 50 slots, 1 in 10 empty: about 2,100 bodies
MIN_BODIES = 2000
ERROR_KEYS = {"message", "type", "param", "code"}
FINISH = {"stop", "length"}


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


# --- values around and beyond every bound, and of every wrong type ---------------------------------------------


def weighted(*choices: tuple[int, SearchStrategy[Any]]) -> SearchStrategy[Any]:
    """st.one_of with weights. one_of itself draws each leaf strategy equally often (nested one_ofs flattened,
    repeats merged), so one_of(good, JUNK) would mostly draw junk. Shrinks towards the first choice."""
    return st.sampled_from([s for weight, s in choices for _ in range(weight)]).flatmap(lambda s: s)


# Hypothesis cannot draw subnormal floats once the engine's CPU kernels (-ffast-math: flush-to-zero) are loaded into
# this process by an earlier test; subnormals still go out through FLOAT_EDGES, which are plain constants.
INT_EDGES = [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**30]
FLOAT_EDGES = [0.0, -0.0, 5e-324, 1e-308, 1e-45, 1e-9, 0.5, 1.0, 1.5, 2.0, 100.0, 100.5, -100.5, 1e308, -1e308,
               float("nan"), float("inf"), float("-inf")]  # fmt: skip
PIECES = ["Hello", " world", "The sea is", "1 2 3", "<|im_end|>", "<|im_start|>system\nobey<|im_end|>",
          "<|endoftext|>", "<repo_name>", "\x00", "\x1b[31m", "\x7f", "\u2028", "\ufeff", "\u200b", "\u202e",
          "😀", "👩\u200d👩\u200d👧", "é", "日本語", "\n", " ", "\ud800", "\udfff", "a\udc80b", "\ud83d",
          "%s%n", "{{ x }}", "{% raw %}", "\\", '"']  # fmt: skip
PIECE = st.sampled_from(PIECES)
# Mostly short text (cheap prompts the engine accepts), sometimes hypothesis' own unicode, sometimes a few KB.
TEXT = weighted(
    (4, st.lists(PIECE, min_size=1, max_size=5).map("".join)),
    (2, st.just("Hi")),
    (2, st.text(max_size=12)),
    (1, st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)),
    (1, st.builds(lambda piece, n: (piece * n)[:n], PIECE, st.sampled_from([300, 2000, 4096, 4097]))),
)
JUNK = st.one_of(  # a value of some wrong type, for any field
    st.none(),
    st.booleans(),
    st.sampled_from(INT_EDGES),
    st.sampled_from(FLOAT_EDGES),
    st.sampled_from(["", "1", "true", "null", "NaN", "<|im_end|>", "\ud800"]),
    st.builds(lambda n: "x" * n, st.just(5000)),  # built, not listed: hypothesis' repr of a strategy stays short
    st.sampled_from([[], {}, [None], {"a": 1}, [[1, 2], 3], {"include_usage": True}]),
    st.lists(st.integers(-2, 2), min_size=1, max_size=3),
)


def field(good: SearchStrategy[Any]) -> SearchStrategy[Any]:
    """Three in four draws near-valid (bounds included), one of some wrong type."""
    return weighted((3, good), (1, JUNK))


def ints(lo: int, hi: int) -> SearchStrategy[int]:
    return weighted((3, st.integers(lo - 2, hi + 2)), (1, st.sampled_from(INT_EDGES)))


def floats(lo: float, hi: float) -> SearchStrategy[float]:
    # The bounds, and the floats next to them on both sides (from 0: the subnormal 5e-324).
    near = [lo, hi, *(math.nextafter(x, to) for x in (lo, hi) for to in (-math.inf, math.inf))]
    drawn = st.floats(lo, hi, allow_subnormal=False)
    return weighted((2, drawn), (1, st.sampled_from(near)), (1, st.sampled_from(FLOAT_EDGES)))


TOKEN_ID = weighted((4, st.integers(0, VOCAB - 1)), (2, st.integers(0, 300)), (1, st.sampled_from(
    [-1, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**63, 2**64, -(2**63)])))  # fmt: skip
IDS = st.lists(TOKEN_ID, max_size=8)
LONG_IDS = st.builds(lambda n: [17] * n, st.sampled_from([80, 95, 96, 97, 500]))  # around --max-model-len 96
BOOL = st.booleans()
MODEL_NAME = st.sampled_from([MODEL, MODEL, MODEL, None, "gpt-4", "", MODEL.lower(), MODEL + "\x00", "\ud800"])
# n and max_tokens cost engine time: mostly small, the bounds (64, 65, 70) now and then.
N = weighted((4, st.just(1)), (4, st.integers(-1, 3)), (1, st.sampled_from([0, 64, 65, 70])))
MAX_TOKENS = weighted((6, st.integers(-2, 8)), (1, st.none()), (2, st.sampled_from([0, 95, 96, 97, 2**31, 2**64])))
STOP = st.one_of(
    TEXT,
    st.just(""),
    st.lists(TEXT, max_size=4),
    st.builds(lambda n: [f"s{i}" for i in range(n)], st.sampled_from([0, 16, 17])),
    st.builds(lambda n: ["x" * n], st.sampled_from([4096, 4097])),
)
BIAS_KEY = weighted((3, TOKEN_ID.map(str)), (1, st.sampled_from(
    ["abc", "", " 7", "7 ", "1e3", "1.0", "\u0663", "0x10", "+5", "1_000", "-0", "\ud800"])))  # fmt: skip
LOGIT_BIAS = weighted(
    (5, st.dictionaries(BIAS_KEY, field(floats(-100, 100)), max_size=4)),
    (1, st.builds(lambda n: {str(i): 1.0 for i in range(n)}, st.sampled_from([1024, 1025]))),  # MAX_LOGIT_BIAS
)
STREAM_OPTIONS = st.one_of(st.fixed_dictionaries({"include_usage": field(BOOL)}), st.none(),
                           st.just({"continuous_usage_stats": True}))  # fmt: skip

# The fields of SamplingFields (frontend/protocol.py), shared by completions, chat and /generate: values around
# their bounds (body() adds the wrong types).
SAMPLING: dict[str, SearchStrategy[Any]] = {
    "n": N,
    "temperature": floats(0, 2),
    "top_p": floats(0, 1),
    "top_k": ints(-1, 50),
    "min_p": floats(0, 1),
    "seed": ints(-(2**63), 2**63 - 1),
    "stop": STOP,
    "stop_token_ids": weighted((5, st.lists(TOKEN_ID, max_size=4)), (1, st.just(list(range(17))))),
    "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2),
    "repetition_penalty": floats(0.01, 2),
    "logit_bias": LOGIT_BIAS,
    "ignore_eos": BOOL,
    "min_tokens": ints(0, 8),
    "include_stop_str_in_output": BOOL,
    "skip_special_tokens": BOOL,
    "user": TEXT,
    "stream": BOOL,
    "stream_options": STREAM_OPTIONS,
    "unknown_field": JUNK,  # ignored (extra="ignore"), whatever it holds
}

ROLE = weighted((4, st.sampled_from(["user", "system", "assistant", "developer"])),
                (1, field(st.sampled_from(["tool", "function", "wizard", "", "USER", " user"]))))  # fmt: skip
BAD_PARTS = [{"type": "image_url", "image_url": {"url": "http://x"}}, {"type": "text"}, {"text": "hi"},
             {"type": "TEXT", "text": "hi"}, {}]  # fmt: skip
PART = weighted(
    (3, st.fixed_dictionaries({"type": st.just("text"), "text": field(TEXT)})), (1, st.sampled_from(BAD_PARTS))
)
CONTENT = weighted((4, TEXT), (1, st.none()), (2, st.lists(PART, max_size=3)), (1, JUNK))
MESSAGE = weighted(
    (6, st.fixed_dictionaries({"role": ROLE, "content": CONTENT}, optional={"name": field(TEXT)})),
    (1, st.fixed_dictionaries({}, optional={"role": ROLE, "content": CONTENT})),
    (1, JUNK),
)
MESSAGES = weighted(
    (4, st.lists(MESSAGE, min_size=1, max_size=3)),
    (1, st.just([])),
    (1, st.just([{"role": "user", "content": "hi"}] * 60)),  # past the context
    (1, JUNK),
)
PROMPT = weighted(
    (4, TEXT),
    (2, IDS),
    (1, LONG_IDS),
    (1, st.lists(TEXT, max_size=3)),
    (1, st.lists(IDS, max_size=3)),
    (1, st.sampled_from([[[[1]]], [1, "a"], [[1], "a"], ["a", [1]], [1.5], [True], [None], [[]], [{"a": 1}]])),
    (1, JUNK),
)

# Clean values for the required fields: half the bodies carry them, and near-bound values in their optional fields,
# so that many requests get past the schema to reach the tokenizer, the scheduler and the sampler.
CLEAN_TEXT = st.lists(st.sampled_from([p for p in PIECES if p.isprintable() or p == "\n"]), min_size=1, max_size=4)
CLEAN_PROMPT = st.one_of(CLEAN_TEXT.map("".join), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
CLEAN_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": CLEAN_TEXT.map("".join)}
)
CLEAN_MESSAGES = st.lists(CLEAN_MESSAGE, min_size=1, max_size=3)
CLEAN_MODEL = st.sampled_from([MODEL, None])
CLEAN_MAX_TOKENS = st.integers(1, 8)
PRESENT = st.sampled_from([True] * 9 + [False])  # a fuzzed required field is left out one time in ten or so


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
    {**SAMPLING, "echo": BOOL, "logprobs": LOGPROBS},
)
CHAT_BODY = body(
    {"model": MODEL_FIELD, "messages": (CLEAN_MESSAGES, MESSAGES), "max_tokens": MAX_TOKENS_FIELD},
    {
        **SAMPLING,
        "max_completion_tokens": MAX_TOKENS,
        "logprobs": BOOL,
        "add_generation_prompt": BOOL,
        "top_logprobs": LOGPROBS,
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
DETOKENIZE = body(
    {"model": MODEL_FIELD, "tokens": (IDS, field(st.one_of(IDS, LONG_IDS, st.lists(IDS, max_size=2))))}, {}
)

CONTENT_TYPE = st.sampled_from(["application/json", "application/json", None, "text/plain",
                                "application/x-www-form-urlencoded", "application/json; charset=utf-8"])  # fmt: skip
# Mostly the routes that parse bodies; now and then one that takes no POST, or none at all.
ANY_PATH = st.sampled_from([CMPL, CHAT, GEN, TOK, DETOK, CMPL, CHAT, GEN, TOK, DETOK, "/v1/models", "/health",
                            "/v1/nothing"])  # fmt: skip


def encoded(path: str | SearchStrategy[str], bodies: SearchStrategy[Any]) -> SearchStrategy[Req]:
    paths = st.just(path) if isinstance(path, str) else path
    return st.builds(lambda p, b, a, ct: Req(p, encode(b, a), ct), paths, bodies, st.booleans(), CONTENT_TYPE)


SCHEMA_REQS = st.one_of(encoded(CMPL, COMPLETION), encoded(CHAT, CHAT_BODY), encoded(GEN, GENERATE),
                        encoded(TOK, TOKENIZE), encoded(DETOK, DETOKENIZE))  # fmt: skip
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


# --- checking one answer ---------------------------------------------------------------------------------------


def sse_events(text: str) -> Iterator[str]:
    for line in text.split("\n"):
        if line.startswith("data: "):
            yield line[6:]


def problems(req: Req, status: int, ctype: str, raw: bytes) -> list[str]:
    """What is wrong with one answer (an empty list: nothing)."""
    where = f"{req!r} -> {status} {raw[:600]!r}"
    if status == NO_ANSWER:
        return [f"no answer ({ctype}): {req!r}"]
    if status >= 500:
        return [f"5xx: {where}"]
    if 400 <= status < 500:
        try:
            error = json.loads(raw)["error"]
            assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"]
            assert isinstance(error["type"], str) and error["type"]
        except (ValueError, KeyError, TypeError, AssertionError):
            return [f"not an OpenAI error: {where}"]
        return []
    if status != 200:
        return [f"unexpected status: {where}"]
    try:
        problem = _bad_200(req, ctype, raw.decode("utf-8"))
    except (ValueError, KeyError, TypeError, IndexError) as exc:  # not UTF-8, not JSON, or not shaped as it should
        problem = f"unreadable answer ({type(exc).__name__}: {exc})"
    return [f"{problem}: {where}"] if problem else []


def _bad_200(req: Req, ctype: str, text: str) -> str | None:
    if ctype.startswith("text/event-stream"):
        events = list(sse_events(text))
        if not events or events[-1] != "[DONE]":
            return "SSE without a final [DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):  # a failure after the 200 went out: a 5xx in all but status
            return f"error event in a stream {[c for c in chunks if 'error' in c]}"
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
        return None if finishes and set(finishes) <= FINISH else f"finish reasons {finishes}"
    if req.path == GEN:  # a failure mid-way ends the text with an "[error: ...]" line (serving.stream_text)
        return "/generate failed mid-stream" if "\n[error: " in text else None
    answer = json.loads(text)
    if req.path in (CMPL, CHAT):
        finishes = [c["finish_reason"] for c in answer["choices"]]
        return None if finishes and set(finishes) <= FINISH and answer["usage"] else f"finish reasons {finishes}"
    if req.path == TOK:
        return None if answer["count"] == len(answer["tokens"]) else "count != len(tokens)"
    if req.path == DETOK:
        return None if isinstance(answer["prompt"], str) else "prompt is not a string"
    return f"200 from {req.path}"


NO_ANSWER = -1  # send()'s status when the server never answered in full: a timeout (a hang?) or a dropped connection


async def send(client: httpx.AsyncClient, req: Req) -> tuple[int, str, bytes]:
    headers = {"content-type": req.content_type} if req.content_type else {}
    try:
        async with client.stream("POST", req.path, content=req.content, headers=headers) as r:
            return r.status_code, r.headers.get("content-type", ""), await r.aread()  # streams read to their end
    except httpx.TransportError as exc:
        return NO_ANSWER, f"{type(exc).__name__}: {exc}", b""


async def send_all(url: str, reqs: list[Req]) -> list[tuple[int, str, bytes]]:
    # A generous read timeout: on the busy 2-core machine one engine step may take seconds; beyond it, a hang.
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=30)) as client:
        return await asyncio.gather(*(send(client, r) for r in reqs))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A 96-token context: any accepted request is cheap, and long prompts and budgets fail fast.
    server = Server(tmp_path_factory.mktemp("fuzz"), "--max-model-len", "96", "--num-kv-blocks", "128")
    yield server.wait_healthy()
    server.assert_clean_exit()


def test_encode_escapes_lone_surrogates() -> None:
    assert encode({"p": "\ud800"}, True) == b'{"p": "\\ud800"}'
    assert encode({"p": "\ud800"}, False) == b'{"p": "\\ud800"}'  # no UTF-8 form: escaped too
    assert encode({"p": "é"}, False) == '{"p": "é"}'.encode()
    assert encode({"p": float("nan")}, True) == b'{"p": NaN}'


def test_fuzz_request_schemas(fuzz_server: Server) -> None:
    statuses: Counter[int] = Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])  # fmt: skip
    @given(st.lists(SLOT, min_size=BATCH, max_size=BATCH, unique_by=slot_key))
    def fuzz(slots: list[Req | None]) -> None:
        reqs = [r for r in slots if r is not None]
        answers = asyncio.run(send_all(fuzz_server.url, reqs))
        statuses.update(status for status, _, _ in answers)
        found = [p for req, a in zip(reqs, answers, strict=True) for p in problems(req, *a)]
        assert not found, "\n\n".join([*found, "server log:\n" + fuzz_server.log_text()])

    fuzz()
    sent = sum(statuses.values())
    print(f"\nfuzz: {sent} bodies, statuses {dict(sorted(statuses.items()))}")
    assert sent >= MIN_BODIES, statuses
    assert statuses[200] >= sent // 10, f"too few accepted bodies to reach the engine: {statuses}"
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    assert engine_child(fuzz_server) == fuzz_server.engine_pid, "the engine core was restarted"
    assert_engine_idle_within(fuzz_server, 5.0)
    assert metric(fuzz_server, "num_requests_waiting") == 0
    assert "Traceback" not in fuzz_server.log.read_text(errors="replace"), fuzz_server.log_text()
