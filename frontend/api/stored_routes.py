"""The routes of what the server keeps between requests: stored responses (read back, their input items, cancelled,
deleted) and conversations with their items. Creating a response is /v1/responses (api_server.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from frontend.api.conversations import AddItems, CreateConversation, UpdateConversation, page
from frontend.api.protocol_responses import item_dumps
from frontend.api.serving import ServingContext
from frontend.api.serving_responses import cancel_response, delete_response
from frontend.errors import bad_request

Limit = Annotated[int, Query(ge=1, le=100)]
Order = Literal["asc", "desc"]


def stored_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    conversations = ctx.conversations

    @router.get("/v1/responses/{response_id}", response_model=None)
    async def retrieve_response(response_id: str, stream: bool = False,
                                starting_after: int = -1) -> dict[str, Any] | StreamingResponse:  # fmt: skip
        """The stored response; with stream, a streamed background response's events after `starting_after`."""
        stored = ctx.responses.get(response_id)
        replay = ctx.responses.replays.get(response_id)
        if not stream:
            return stored.response
        if replay is None:
            raise bad_request(f"Response '{response_id}' is not a streamed background response in progress (it is "
                              f"{stored.response['status']}): GET it without stream", "stream")  # fmt: skip
        return StreamingResponse(replay.follow(starting_after), media_type="text/event-stream")

    @router.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str) -> dict[str, Any]:
        return delete_response(ctx, response_id)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict[str, Any]:
        return cancel_response(ctx, response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, after: str | None = None, limit: Limit = 20,
                                   order: Order = "desc") -> dict[str, Any]:  # fmt: skip
        return page(ctx.responses.input_items(response_id), after, limit, order)

    @router.post("/v1/conversations")
    async def create_conversation(req: CreateConversation) -> dict[str, Any]:
        return conversations.create(req).card()

    @router.get("/v1/conversations/{conversation_id}")
    async def retrieve_conversation(conversation_id: str) -> dict[str, Any]:
        return conversations.get(conversation_id).card()

    @router.post("/v1/conversations/{conversation_id}")
    async def update_conversation(conversation_id: str, req: UpdateConversation) -> dict[str, Any]:
        conv = conversations.get(conversation_id)
        conv.metadata = req.metadata or {}
        return conv.card()

    @router.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(conversation_id: str) -> dict[str, Any]:
        return conversations.delete(conversation_id)

    @router.post("/v1/conversations/{conversation_id}/items")
    async def add_items(conversation_id: str, req: AddItems) -> dict[str, Any]:
        added = conversations.add(conversation_id, item_dumps(req.items))
        return page(added, None, len(added), "asc")

    @router.get("/v1/conversations/{conversation_id}/items")
    async def list_items(conversation_id: str, after: str | None = None, limit: Limit = 20,
                         order: Order = "desc") -> dict[str, Any]:  # fmt: skip
        return page(conversations.get(conversation_id).items, after, limit, order)

    @router.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def retrieve_item(conversation_id: str, item_id: str) -> dict[str, Any]:
        return conversations.item(conversation_id, item_id)

    @router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: str, item_id: str) -> dict[str, Any]:
        return conversations.remove_item(conversation_id, item_id)

    return router
