"""Stored responses: what `store: true` (the Responses API's default) keeps, so that a later request can continue
one by its `previous_response_id` and a client can read one back (GET /v1/responses/{id}, its input_items) or
delete it. Kept in the API process's memory, which outlives engine crashes, up to --responses-store-mib: past it
the least recently used response goes first. A response links to the one it continued, so a conversation of n turns
is stored once, not n times; using a response refreshes its whole chain after it, so that an ancestor never leaves
before the responses that continue it."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from frontend.api.responses_output import item_id
from frontend.errors import ApiError

ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_id(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as stored and listed, with an id of its own."""
    return {"id": item_id(ID_PREFIXES.get(item["type"], "item")), **item}


class Replay:
    """A streamed background response's events while it runs: the client that started it reads them from the
    first, one that resumes (GET ?stream=true&starting_after=N) from N + 1, each then waiting for the next."""

    def __init__(self) -> None:
        self.events: list[bytes] = []  # the event with sequence number i at i
        self.done = False
        self._changed = asyncio.Event()

    def add(self, event: bytes) -> None:
        self.events.append(event)
        self._wake()

    def finish(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        at = max(after + 1, 0)
        while True:
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.done:
                return
            await self._changed.wait()


def _turns(chain: list[Stored]) -> list[dict[str, Any]]:
    """A chain's items, turn by turn: each response's input items, then its output."""
    return [item for stored in chain for item in (*stored.items, *stored.response["output"])]


@dataclass
class Stored:
    response: dict[str, Any]  # the response object, as it was returned
    items: list[dict[str, Any]]  # the request's own input items (not those of the responses it continued)
    previous: str | None  # the response it continued
    size: int  # bytes of both as JSON: what counts against the limit


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.running: dict[str, Callable[[], dict[str, Any]]] = {}  # background responses: how to cancel each
        self.replays: dict[str, Replay] = {}  # those streamed: their events so far, for clients that resume

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, response: dict[str, Any], items: list[dict[str, Any]], previous: str | None) -> None:
        size = len(json.dumps(response)) + len(json.dumps(items))
        self.delete(rid)
        if size > self.max_bytes:  # larger than the whole store: kept nowhere, rather than emptying it for nothing
            return
        self._entries[rid] = Stored(response, items, previous, size)
        self.bytes += size
        self._refresh(rid)
        while self.bytes > self.max_bytes and self._entries:
            self.bytes -= self._entries.popitem(last=False)[1].size

    def get(self, rid: str) -> Stored:
        stored = self._entries.get(rid)
        if stored is None:
            raise ApiError(404, f"Response with id '{rid}' not found.", "response_id", "not_found")
        return stored

    def delete(self, rid: str) -> bool:
        stored = self._entries.pop(rid, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None

    def conversation(self, rid: str) -> list[dict[str, Any]]:
        """The items a response continuing `rid` starts from, oldest first: each response's input items and then its
        output, along the chain that ends at `rid`. A 400 if any of them is gone (never stored, deleted, evicted)."""
        chain, missing = self._chain(rid)
        if missing is not None:
            raise ApiError(400, f"Previous response with id '{missing}' not found.", "previous_response_id",
                           "previous_response_not_found")  # fmt: skip
        self._refresh(rid)
        return _turns(chain)

    def input_items(self, rid: str) -> list[dict[str, Any]]:
        """What GET /v1/responses/{rid}/input_items lists, oldest first: the conversation it continued, from the
        first of its responses still stored (a client may have deleted one), then its own input."""
        stored = self.get(rid)
        chain, _ = self._chain(stored.previous)
        return [*_turns(chain), *stored.items]

    def _chain(self, rid: str | None) -> tuple[list[Stored], str | None]:
        """The stored responses that end at `rid`, oldest first, and the id of the first one missing (or None)."""
        chain: list[Stored] = []
        while rid is not None:
            stored = self._entries.get(rid)
            if stored is None:
                return chain[::-1], rid
            chain.append(stored)
            rid = stored.previous
        return chain[::-1], None

    def _refresh(self, rid: str) -> None:
        """Marks `rid` used, then each response before it in its chain, so that they are the last to go."""
        at: str | None = rid
        while at is not None and at in self._entries:
            self._entries.move_to_end(at)
            at = self._entries[at].previous
