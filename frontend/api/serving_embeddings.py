"""POST /v1/embeddings (OpenAI's, with vLLM's extras) on a pooling server: inputs -> one engine request each, whose
result is its last position's hidden state -> cut to `dimensions` and normalized (common/pooling.py), as floats or
base64 (what OpenAI's Python client asks for unless told otherwise)."""

from __future__ import annotations

import base64
import time

from fastapi import Request
from fastapi.responses import Response

from common.pooling import Pooling
from frontend.api.protocol_embeddings import EmbeddingRequest
from frontend.api.serving import ServingContext
from frontend.api.serving_pooling import json_response, pool_inputs, serving_pooling
from frontend.errors import bad_request


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, raw: Request, request_id: str) -> Response:
    ctx.check_model(req.model)
    pooling = serving_pooling(ctx, classifier=False)
    length = embedding_length(pooling, req.dimensions, ctx.model_name)
    rid = f"embd-{request_id}"
    result = await pool_inputs(ctx, raw, rid, req)
    if result is None:
        return Response(status_code=499)  # the client left; its requests were aborted
    pooled, tokens = result
    data = []
    for index, hidden in enumerate(pooled):
        vector = pooling.embedding(hidden, length)
        value = base64.b64encode(vector.tobytes()).decode() if req.encoding_format == "base64" else vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": value})
    return json_response({"id": rid, "object": "list", "created": int(time.time()), "model": ctx.served_name(req.model),
                          "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


def embedding_length(pooling: Pooling, dimensions: int | None, model: str) -> int:
    """How many of the hidden state's values an embedding keeps: all, or `dimensions` where the model allows it."""
    if dimensions is None or dimensions == pooling.size:
        return pooling.size
    if pooling.dimensions is None:
        raise bad_request(f"the model {model!r} is not a Matryoshka model: its embeddings cannot be cut to "
                          f"dimensions={dimensions} (their length is {pooling.size})", "dimensions")  # fmt: skip
    allowed = pooling.dimensions or range(1, pooling.size + 1)
    if dimensions not in allowed:
        shown = list(allowed) if pooling.dimensions else f"1 to {pooling.size}"
        raise bad_request(f"dimensions must be one of {shown} for this model, not {dimensions}", "dimensions")
    return dimensions
