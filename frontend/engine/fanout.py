"""FanOut: the engine requests behind one API request (prompts x n), merged into one stream of (choice, delta)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from common.messages import EngineRequest, SamplingParams
from frontend.engine.engine_client import AsyncEngineClient
from frontend.engine.request_stream import Delta, RequestStream
from frontend.text.detokenizer import IncrementalDetokenizer


@dataclass
class Choice:
    """One choice's accumulated result (non-streaming responses)."""

    index: int
    prompt_index: int
    stream: RequestStream
    result: Delta = field(default_factory=Delta)


class FanOut:
    def __init__(self, client: AsyncEngineClient, request_id: str, prompts: list[list[int]], n: int,
                 params: SamplingParams, make_detokenizer: Callable[[list[int]], IncrementalDetokenizer | None],
                 include_stop_token: bool = False, shared: dict[str, Any] | None = None) -> None:  # fmt: skip
        """shared: EngineRequest fields every choice takes (priority, lora, cache_salt, embed). make_detokenizer
        may give None where no text comes back (embeddings)."""
        client.check_capacity(len(prompts) * n)  # all or nothing: no half-admitted request
        self.client = client
        self.prompts = prompts
        self.params = params  # what every choice was sent with (each with its own seed)
        self.choices: list[Choice] = []
        self.count_reasoning: Callable[[list[int]], int] | None = None  # a choice's thinking tokens, for usage
        self.prompt_tokens_details = False  # usage says how many prompt tokens the prefix cache held
        arrival = time.time()
        try:
            for prompt_index, prompt in enumerate(prompts):
                for j in range(n):
                    index = prompt_index * n + j
                    # The same seed for every choice would make n identical samples; seed + j keeps them
                    # reproducible and distinct.
                    p = params if j == 0 or params.seed is None else msgspec.structs.replace(
                        params, seed=(params.seed + j) % 2**63)  # fmt: skip
                    req = EngineRequest(f"{request_id}-{index}", prompt, p, arrival_time=arrival, **(shared or {}))
                    stream = client.add(req, make_detokenizer(prompt), include_stop_token)
                    self.choices.append(Choice(index, prompt_index, stream))
        except BaseException:
            self.abort()
            raise

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held."""
        return sum(c.stream.num_cached_tokens for c in self.choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.stream.output_token_ids) for c in self.choices)

    def usage(self) -> dict[str, Any]:
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}  # fmt: skip
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        if self.count_reasoning is not None:
            reasoning = sum(self.count_reasoning(c.stream.output_token_ids) for c in self.choices)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def abort(self) -> None:
        """Aborts every choice still running (a disconnect, an error in a sibling, a cancelled handler)."""
        unfinished = [c.stream.request_id for c in self.choices if not c.stream.finished]
        if unfinished:
            self.client.abort(unfinished)

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) as they come, until every choice has finished."""
        if len(self.choices) == 1:  # the common case needs no task per stream
            async for delta in self.choices[0].stream:
                yield 0, delta
            return
        waiting = {asyncio.ensure_future(c.stream.get()): c.index for c in self.choices}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=waiting.__getitem__):
                    index = waiting.pop(task)
                    try:
                        delta = task.result()
                    except StopAsyncIteration:
                        continue
                    waiting[asyncio.ensure_future(self.choices[index].stream.get())] = index
                    yield index, delta
        finally:
            for task in waiting:
                task.cancel()

    async def collect(self) -> list[Choice]:
        """Runs every choice to its end, merging its deltas (non-streaming responses)."""
        for choice in self.choices:  # nothing is shown before the end: no consumer wakeup per token
            choice.stream.hold_to_end = True
        async for index, delta in self.deltas():
            self.choices[index].result.merge(delta)
        return self.choices
