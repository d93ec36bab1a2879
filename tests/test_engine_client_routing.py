"""AsyncEngineClient without engine processes (sends captured, outputs fed by hand): a reused request id never gets
another request's outputs, and a request refused by an engine that just died goes to a live one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import zmq

from common import ipc
from common.messages import (
    AbortRequest,
    EngineOutput,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    FinishReason,
    SamplingParams,
)
from frontend.engine.engine_client import AsyncEngineClient, EngineUnavailable
from frontend.engine.router import PrefixRouter

Sent = list[tuple[int, object]]  # (engine index, decoded message)


def run(scenario: Callable[[AsyncEngineClient, Sent], Awaitable[None]], engines: int = 1,
        unreachable: frozenset[int] = frozenset(), resumable: bool = True) -> None:  # fmt: skip
    """Runs `scenario` against a client of `engines` ready engines; sends to those in `unreachable` fail as a dead
    engine's do (ROUTER_MANDATORY: EHOSTUNREACH)."""

    async def main() -> None:
        client = AsyncEngineClient(ipc.Addresses.new_ipc(), [None] * engines)
        client.resumable = resumable
        sent: Sent = []
        for handle in client.handles:

            def send(identity: bytes, data: bytes, index: int = handle.index) -> None:
                if index in unreachable:
                    raise zmq.ZMQError(zmq.EHOSTUNREACH)
                sent.append((index, ipc.decode_input(data)))

            handle._send = send
            handle.on_message(EngineReady(0, "m", 100, 16, 10, 1000))
        if engines > 1:
            client.router = PrefixRouter(16)
        try:
            await scenario(client, sent)
        finally:
            await client.close()

    asyncio.run(main())


def request(rid: str, prompt: list[int]) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=50))


def test_a_retry_with_the_same_id_never_gets_the_aborted_requests_outputs():
    async def scenario(client: AsyncEngineClient, sent: Sent) -> None:
        engine = client.handles[0]
        first = client.add(request("chatcmpl-X-0", [1, 2, 3]))
        first_id = sent[-1][1].request_id
        engine.on_message(EngineOutputs(0, [EngineOutput(first_id, [11])]))
        client.abort([first.request_id])  # the client went away (or a stop string ended it)
        assert sent[-1][1] == AbortRequest([first_id])
        retry = client.add(request("chatcmpl-X-0", [7, 8, 9]))  # a gateway's retry: the same X-Request-Id
        retry_id = sent[-1][1].request_id
        assert retry_id != first_id and retry_id.startswith("chatcmpl-X-0")  # the client's id stays readable
        # The step the engine ran before it saw the abort, then the first request's end.
        engine.on_message(EngineOutputs(0, [EngineOutput(first_id, [12])]))
        engine.on_message(EngineOutputs(0, [EngineOutput(first_id, [13], FinishReason.LENGTH)]))
        assert retry.output_token_ids == [] and not retry.finished and client.engine_of(retry) is engine
        engine.on_message(EngineOutputs(0, [EngineOutput(retry_id, [21], FinishReason.LENGTH)]))
        assert retry.output_token_ids == [21] and retry.finish_reason == "length"
        assert [d.token_ids async for d in retry] == [[21]]

    run(scenario)


def test_two_requests_in_flight_with_one_client_id_each_get_their_own_outputs():
    async def scenario(client: AsyncEngineClient, sent: Sent) -> None:
        engine = client.handles[0]
        a, b = client.add(request("cmpl-dup-0", [1, 2])), client.add(request("cmpl-dup-0", [3, 4]))
        (_, sent_a), (_, sent_b) = sent
        assert sent_a.request_id != sent_b.request_id and client.num_in_flight == 2
        outputs = [EngineOutput(sent_b.request_id, [5]), EngineOutput(sent_a.request_id, [6])]
        engine.on_message(EngineOutputs(0, outputs))
        assert (a.output_token_ids, b.output_token_ids) == ([6], [5])
        client.abort([a.request_id])  # aborting one leaves the other running
        assert sent[-1][1] == AbortRequest([sent_a.request_id]) and client.engine_of(b) is engine

    run(scenario)


@pytest.mark.parametrize("resumable", [True, False])
def test_a_request_refused_by_a_dead_engine_goes_to_a_live_one(resumable: bool):
    async def scenario(client: AsyncEngineClient, sent: Sent) -> None:
        dead, live = client.handles
        stream = client.add(request("r-0", [1, 2, 3]))  # equal loads: the router picks engine 0 first
        assert client.engine_of(stream) is live and sent == [(1, stream.request)]
        assert stream.sent_at == 0  # in an engine: a crash of engine 1 would count against it
        assert live.healthy and dead.healthy is not resumable  # with restarts, engine 0 takes nothing new now

    run(scenario, engines=2, unreachable=frozenset({0}), resumable=resumable)


def test_with_no_engine_reachable_the_request_waits_for_a_restart_or_fails():
    async def waits(client: AsyncEngineClient, sent: Sent) -> None:
        stream = client.add(request("r-0", [1, 2, 3]))
        assert client.engine_of(stream) is client.handles[1] and stream.sent_at is None and sent == []
        assert not client.healthy

    run(waits, engines=2, unreachable=frozenset({0, 1}))

    async def fails(client: AsyncEngineClient, sent: Sent) -> None:
        with pytest.raises(EngineUnavailable, match="cannot reach"):
            client.add(request("r-0", [1, 2, 3]))

    run(fails, engines=2, unreachable=frozenset({0, 1}), resumable=False)
