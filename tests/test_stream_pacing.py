"""The streaming path with no server: RequestStream's merging (a lagging consumer, StreamPacing under many streams,
a non-streaming consumer) on the real tokenizer, and the SSE writer's text chunks against the general chunk path."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from common.messages import EngineOutput, EngineRequest, FinishReason, Logprobs, SamplingParams
from common.model_source import resolve_model
from frontend.api.protocol import ChatCompletionRequest, CompletionRequest
from frontend.api.serving_chat import ChatFormat
from frontend.api.serving_completion import CompletionFormat
from frontend.api.sse import ChunkWriter
from frontend.engine.request_stream import Delta, RequestStream
from frontend.engine.stream_pacing import StreamPacing
from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.text.tokenizer import Tokenizer

TEXT = "Streams merge tokens: café, 北京, 🍕 and \"quotes\"\nover several lines.\tDone."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None).path)


def make_stream(tok: Tokenizer, pacing: StreamPacing | None) -> RequestStream:
    request = EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=1000))
    return RequestStream(request, IncrementalDetokenizer(tok, [1, 2, 3]), pacing=pacing)


def output(token: int, logprob: float, last: bool) -> EngineOutput:
    return EngineOutput("r", [token], FinishReason.LENGTH if last else None, new_logprobs=Logprobs([logprob]))


async def produce_and_consume(stream: RequestStream, ids: list[int], steps_per_read: int = 1) -> list[Delta]:
    """One engine output per token; the consumer runs once every `steps_per_read` outputs (1: it keeps up)."""
    got: list[Delta] = []

    async def consume() -> None:
        async for delta in stream:
            got.append(delta)

    consumer = asyncio.ensure_future(consume())
    for i, token in enumerate(ids):
        stream.on_output(output(token, -float(i), i == len(ids) - 1))
        if (i + 1) % steps_per_read == 0:
            for _ in range(3):  # the consumer's wakeup, its get(), its next wait
                await asyncio.sleep(0)
    await asyncio.wait_for(consumer, 10)
    return got


def check_exact(tok: Tokenizer, ids: list[int], deltas: list[Delta]) -> None:
    """Merged or not: the text concatenates to the whole decode, logprobs align with tokens, the end comes last."""
    assert "".join(d.text for d in deltas) == tok.decode(ids)
    assert [t for d in deltas for t in d.token_ids] == ids
    assert [x for d in deltas for x in d.logprobs] == [-float(i) for i in range(len(ids))]
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]


@pytest.mark.parametrize("streams", [1, 16])
def test_few_streams_get_every_token_at_once(tok, streams):
    ids = tok.encode(TEXT)
    stream = make_stream(tok, StreamPacing(lambda: streams))
    deltas = asyncio.run(produce_and_consume(stream, ids))
    assert [len(d.token_ids) for d in deltas] == [1] * len(ids)
    check_exact(tok, ids, deltas)


def test_many_streams_merge_tokens_per_wakeup(tok):
    ids = tok.encode(TEXT)
    stream = make_stream(tok, StreamPacing(lambda: 64, max_hold_s=60.0))  # 64 streams: 4 tokens per wakeup
    deltas = asyncio.run(produce_and_consume(stream, ids))
    sizes = [len(d.token_ids) for d in deltas]
    assert sizes[0] == 1  # the first token is not held: time to first token stays
    assert all(n == 4 for n in sizes[1:-1]) and 1 <= sizes[-1] <= 4, sizes
    check_exact(tok, ids, deltas)


def test_a_lagging_consumer_takes_everything_that_arrived(tok):
    ids = tok.encode(TEXT)
    stream = make_stream(tok, None)  # no pacing: merging comes only from the consumer's lag
    deltas = asyncio.run(produce_and_consume(stream, ids, steps_per_read=5))
    assert len(deltas) < len(ids) / 3 and max(len(d.token_ids) for d in deltas) >= 5
    check_exact(tok, ids, deltas)


def test_held_tokens_go_out_after_max_hold_without_more_output(tok):
    ids = tok.encode(TEXT)[:3]

    async def run() -> list[Delta]:
        stream = make_stream(tok, StreamPacing(lambda: 64, max_hold_s=0.05))
        for i, token in enumerate(ids):  # no end: the engine has nothing more for a while (preempted, say)
            stream.on_output(output(token, -float(i), False))
        first = await asyncio.wait_for(stream.get(), 10)
        stream.on_output(output(ids[0], -1.0, False))
        return [first, await asyncio.wait_for(stream.get(), 10)]  # held: only the timer can wake it

    first, held = asyncio.run(run())
    assert first.token_ids == ids and held.token_ids == [ids[0]] and held.finish_reason is None


def test_a_non_streaming_consumer_is_woken_once(tok):
    ids = tok.encode(TEXT)
    stream = make_stream(tok, None)
    stream.hold_to_end = True
    deltas = asyncio.run(produce_and_consume(stream, ids))
    assert len(deltas) == 1
    check_exact(tok, ids, deltas)


TRICKY = ["plain", 'a "quoted" \\ back\nslash\t\r\x00\x1f\x7f', "é中文😀\u2028\u2029</script>", "\x08\x0c"]


@pytest.mark.parametrize("chat", [False, True])
def test_text_chunks_are_byte_identical_to_the_general_path(tok, chat):
    ctx = SimpleNamespace(tokenizer=tok, reasoning_parser=None, tokens_as_ids=False)  # the fields ChatFormat reads
    if chat:
        fmt = ChatFormat(ctx, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))  # type: ignore
    else:
        fmt = CompletionFormat(ctx, CompletionRequest(prompt="hi", n=2), [[1], [1]], ["hi"])  # type: ignore
    head = {"id": "cmpl-x", "created": 123, "model": "m"}
    for include_usage in (False, True):
        writer = ChunkWriter(fmt, head, include_usage, 2)
        assert all(a is not None for a in writer.affixes)  # the fast path is the one under test
        for index in (0, 1):
            for text in TRICKY:
                general = b"".join(writer.chunk(c) for c in fmt.content(index, Delta([5], text)))
                assert writer.delta(index, Delta([5], text)) == general
                body = json.loads(general.decode()[len("data: ") :])
                assert list(body) == ["id", "created", "model", "object", "choices"] + ["usage"] * include_usage
            assert writer.delta(index, Delta([5], "")) == b""  # a token that completes no character yet


def test_logprobs_keep_the_general_path(tok):
    ctx = SimpleNamespace(tokenizer=tok, tokens_as_ids=False)
    fmt = CompletionFormat(ctx, CompletionRequest(prompt="hi", logprobs=1), [[1]], ["hi"])  # type: ignore
    writer = ChunkWriter(fmt, {"id": "cmpl-x", "created": 1, "model": "m"}, False, 1)
    assert writer.affixes == [None]
    chunk = json.loads(writer.delta(0, Delta([5, 6], "ab", [-0.5, -1.0], [[5], [6]], [[-0.5], [-1.0]]))[6:])
    assert chunk["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -1.0]
