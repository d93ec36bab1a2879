"""Hypothesis strategies for the fuzzer's field values: around and beyond every bound of the request schemas
(frontend/api/protocol.py), and of every wrong type."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152


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

# The fields of SamplingFields (frontend/api/protocol.py), shared by completions, chat and /generate: values around
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
    "allowed_token_ids": weighted((4, st.lists(TOKEN_ID, max_size=4)), (1, st.just(list(range(40))))),
    "bad_words": st.lists(TEXT, max_size=3),
    "priority": ints(-1, 1),  # the fuzzed server schedules fcfs: any but 0 is a 400
    "truncate_prompt_tokens": ints(-1, 4),
    "unknown_field": JUNK,  # ignored (extra="ignore"), whatever it holds
}
TEMPLATE_KWARGS = st.sampled_from([{}, {"enable_thinking": True}, {"x": [1, "<|im_end|>"]}, {"messages": []},
                                   {"bos_token": "x"}, {"deep": {"a": {"b": 1}}}, {"x": float("nan")}])  # fmt: skip

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

# /v1/responses (frontend/api/protocol_responses.py): input items and the fields a chat request does not have.
INPUT_PART = weighted(
    (3, st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": field(TEXT)})),
    (1, st.sampled_from([{"type": "input_image", "image_url": "http://x"}, {"type": "input_text"}, {"text": "hi"}])),
)
INPUT_ITEM = weighted(
    (5, st.fixed_dictionaries({"role": ROLE, "content": weighted((3, TEXT), (2, st.lists(INPUT_PART, max_size=3)),
                                                                 (1, JUNK))}, optional={"type": st.just("message")})),
    (1, st.fixed_dictionaries({"type": st.just("function_call"), "call_id": field(TEXT), "name": field(TEXT),
                               "arguments": field(st.sampled_from(['{"x": 1}', "{", "", "[]"]))})),
    (1, st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": field(TEXT),
                               "output": field(TEXT)})),
    (1, st.sampled_from([{"type": "reasoning", "summary": []}, {"type": "input_file"}, {"type": None}, {}])),
    (1, JUNK),
)
INPUT = weighted((4, TEXT), (4, st.lists(INPUT_ITEM, min_size=1, max_size=3)), (1, st.just([])), (1, JUNK))
CLEAN_INPUT = st.one_of(CLEAN_TEXT.map("".join), CLEAN_MESSAGES)
FUNCTION_TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "name": field(st.sampled_from(["get_weather", "f", "bad name", "", "x" * 65]))},
    optional={"parameters": field(st.sampled_from([{"type": "object", "properties": {"city": {"type": "string"}}},
                                                   {"type": "string"}, {"type": "object"}, {}]))},
)
LEGACY_FUNCTION = FUNCTION_TOOL.map(lambda tool: {k: v for k, v in tool.items() if k != "type"})  # chat `functions`
RESPONSES_FIELDS: dict[str, SearchStrategy[Any]] = {
    "instructions": TEXT,
    "temperature": floats(0, 2),
    "top_p": floats(0, 1),
    "seed": ints(-(2**63), 2**63 - 1),
    "tools": weighted((4, st.lists(FUNCTION_TOOL, max_size=2)), (1, st.just([{"type": "web_search"}]))),
    "tool_choice": st.sampled_from(["auto", "none", "required", "any", {"type": "function", "name": "get_weather"},
                                    {"type": "function", "name": "nope"}, {"type": "web_search"}]),
    "parallel_tool_calls": BOOL,
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"format": {}},
                             {"format": {"type": "json_schema", "name": "r", "schema": {"type": "object"}}},
                             {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}]),
    "stream": BOOL,
    "metadata": weighted((3, st.dictionaries(TEXT, TEXT, max_size=3)),
                         (1, st.builds(lambda n: {f"k{i}": "v" for i in range(n)}, st.sampled_from([16, 17])))),
    "store": BOOL,
    "user": TEXT,
    "previous_response_id": TEXT,
    "conversation": weighted((3, TEXT), (1, st.fixed_dictionaries({"id": field(TEXT)}))),
    "truncation": st.sampled_from(["auto", "disabled", "middle"]),
    "top_logprobs": ints(0, 20),
    "include": st.lists(st.sampled_from(["reasoning.encrypted_content", "message.output_text.logprobs", "x"]),
                        max_size=2),
    "prompt": st.sampled_from([{"id": "pmpt_1"}, {}]),
    "unknown_field": JUNK,
}
# /v1/conversations (frontend/api/conversations.py): a conversation's first items and metadata.
CONVERSATION_FIELDS: dict[str, SearchStrategy[Any]] = {
    "items": weighted((4, st.lists(INPUT_ITEM, max_size=3)), (1, st.lists(INPUT_ITEM, min_size=21, max_size=21))),
    "metadata": st.dictionaries(TEXT, TEXT, max_size=3),
}

# /v1/messages (frontend/api/protocol_messages.py): Anthropic's content blocks and the fields chat does not have.
BLOCK = weighted(
    (4, PART),  # text blocks are chat's text parts
    (1, st.fixed_dictionaries({"type": st.just("tool_use"), "id": field(TEXT), "name": field(TEXT),
                               "input": field(st.sampled_from([{"city": "Paris"}, {}, [], "x"]))})),
    (1, st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": field(TEXT)},
                              optional={"content": weighted((3, TEXT), (1, st.lists(PART, max_size=2))),
                                        "is_error": BOOL})),
    (1, st.sampled_from([{"type": "image", "source": {}}, {"type": "thinking", "thinking": "x", "signature": ""},
                         {"type": "redacted_thinking", "data": "x"}, {"type": "document"}, {}])),
)  # fmt: skip
ANTHROPIC_MESSAGE = st.fixed_dictionaries({"role": weighted((4, st.sampled_from(["user", "assistant"])), (1, ROLE)),
                                           "content": weighted((3, TEXT), (3, st.lists(BLOCK, max_size=3)),
                                                               (1, JUNK))})  # fmt: skip
ANTHROPIC_MESSAGES = weighted((4, st.lists(ANTHROPIC_MESSAGE, min_size=1, max_size=3)), (1, st.just([])), (1, JUNK))
CLEAN_ANTHROPIC_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                           "content": CLEAN_TEXT.map("".join)}), min_size=1, max_size=3)
ANTHROPIC_TOOL = st.fixed_dictionaries(
    {"name": field(st.sampled_from(["get_weather", "bad name", ""])),
     "input_schema": field(st.sampled_from([{"type": "object", "properties": {"city": {"type": "string"}}},
                                            {"type": "string"}, {}]))},
    optional={"type": st.sampled_from(["custom", "web_search_20250305"]), "description": TEXT},
)  # fmt: skip
MESSAGES_FIELDS: dict[str, SearchStrategy[Any]] = {
    "system": weighted((3, TEXT), (1, st.lists(PART, max_size=2))),
    "stop_sequences": st.lists(TEXT, max_size=3),
    "temperature": floats(0, 2),
    "top_p": floats(0, 1),
    "top_k": ints(-1, 50),
    "tools": st.lists(ANTHROPIC_TOOL, max_size=2),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool"},
                                    {"type": "tool", "name": "get_weather"}, {"type": "tool", "name": "nope"},
                                    {"type": "function"}, {"type": "any", "disable_parallel_tool_use": True}]),
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, {"type": "x"}]),
    "output_config": st.sampled_from([{"format": {"type": "json_schema", "schema": {"type": "object"}}},
                                      {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
                                      {"format": {"type": "text"}}, {"effort": "high"}]),
    "metadata": st.sampled_from([{"user_id": "u"}, {}, {"user_id": 5}]),
    "stream": BOOL,
    "chat_template_kwargs": st.sampled_from([{}, {"enable_thinking": False}, {"messages": []}]),
}  # fmt: skip
