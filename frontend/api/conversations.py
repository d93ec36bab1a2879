"""OpenAI's Conversations API: a conversation is a list of items (messages, function calls and their outputs) that a
client builds up with /v1/conversations and its items, and that a /v1/responses request names as its `conversation`:
the items come before its input, and once the response ends its input and output are added to them (what the
OpenAI Agents SDK's OpenAIConversationsSession relies on). Kept in the API process's memory, beside the stored
responses and with a budget of the same size (--responses-store-mib): past it the least recently used conversation
goes first."""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

from frontend.api.protocol import ApiModel
from frontend.api.protocol_responses import MAX_METADATA, InputItem, MetadataKey, MetadataValue, item_dumps
from frontend.api.responses_store import with_id
from frontend.errors import ApiError

MAX_NEW_ITEMS = 20  # OpenAI's bound on the items one call adds
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)]


class CreateConversation(ApiModel):
    items: list[InputItem] | None = Field(None, max_length=MAX_NEW_ITEMS)
    metadata: Metadata | None = None


class UpdateConversation(ApiModel):
    metadata: Metadata | None = None  # null clears it


class AddItems(ApiModel):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_NEW_ITEMS)


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)  # oldest first, each with its id
    size: int = 0  # bytes of its items as JSON: what counts against the budget

    def card(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class ConversationStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Conversation] = OrderedDict()

    def create(self, req: CreateConversation) -> Conversation:
        if self.max_bytes <= 0:
            raise ApiError(400, "conversations are not kept by this server (--responses-store-mib 0)", None,
                           "unsupported_parameter")  # fmt: skip
        conv = Conversation(f"conv_{secrets.token_hex(24)}", int(time.time()), req.metadata or {})
        self._entries[conv.id] = conv
        self.add(conv.id, item_dumps(req.items or []))
        return conv

    def __contains__(self, cid: str) -> bool:
        return cid in self._entries

    def get(self, cid: str) -> Conversation:
        conv = self._entries.get(cid)
        if conv is None:
            raise ApiError(404, f"Conversation with id '{cid}' not found.", "conversation_id", "not_found")
        self._entries.move_to_end(cid)
        return conv

    def delete(self, cid: str) -> dict[str, Any]:
        conv = self.get(cid)
        del self._entries[cid]
        self.bytes -= conv.size
        return {"id": cid, "object": "conversation.deleted", "deleted": True}

    def add(self, cid: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Adds items (output items keep their ids, input items get theirs); returns them as stored."""
        conv = self.get(cid)
        added = [item if isinstance(item.get("id"), str) else with_id(item) for item in items]
        grown = sum(len(json.dumps(item)) for item in added)
        conv.items += added
        conv.size += grown
        self.bytes += grown
        while self.bytes > self.max_bytes and self._entries:  # the least recently used first, this one last
            self.bytes -= self._entries.popitem(last=False)[1].size
        return added

    def item(self, cid: str, item_id: str) -> dict[str, Any]:
        item = next((i for i in self.get(cid).items if i["id"] == item_id), None)
        if item is None:
            raise ApiError(404, f"Item with id '{item_id}' not found in conversation '{cid}'.", "item_id", "not_found")
        return item

    def remove_item(self, cid: str, item_id: str) -> dict[str, Any]:
        item, conv = self.item(cid, item_id), self._entries[cid]
        conv.items.remove(item)
        size = len(json.dumps(item))
        conv.size -= size
        self.bytes -= size
        return conv.card()


def page(items: list[dict[str, Any]], after: str | None, limit: int, order: str) -> dict[str, Any]:
    """A page of items (oldest first as given) as OpenAI lists them: newest first unless order is asc, from the item
    after `after`."""
    items = items[::-1] if order == "desc" else list(items)
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"No item with id '{after}' in this list.", "after", "invalid_value")
        items = items[ids.index(after) + 1 :]
    chunk = items[:limit]
    return {"object": "list", "data": chunk, "first_id": chunk[0]["id"] if chunk else None,
            "last_id": chunk[-1]["id"] if chunk else None, "has_more": len(items) > limit}  # fmt: skip
