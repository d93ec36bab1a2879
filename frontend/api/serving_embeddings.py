"""POST /v1/embeddings (OpenAI's, with vLLM's extras) on a pooling server: inputs -> one engine request each, whose
result is its last position's hidden state -> cut to `dimensions` and normalized (common/pooling.py), as floats or
base64 (what OpenAI's Python client asks for unless told otherwise)."""

from __future__ import annotations

import base64
import time

import msgspec
from fastapi import Request
from fastapi.responses import Response

from common.messages import SamplingParams
from common.pooling import Pooling
from frontend.api.protocol_embeddings import EmbeddingRequest
from frontend.api.serving import ServingContext, collect, off_loop
from frontend.api.serving_completion import completion_prompts, num_prompts
from frontend.engine.fanout import FanOut
from frontend.errors import bad_request


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, raw: Request, request_id: str) -> Response:
    ctx.check_model(req.model)
    pooling = ctx.pooling
    if pooling is None:
        raise bad_request("this server generates text; embeddings need a server started with --runner pooling (an "
                          "embedding model such as Qwen3-Embedding starts so by itself)", "model")  # fmt: skip
    length = embedding_length(pooling, req.dimensions, ctx.model_name)
    await ctx.admit(num_prompts(req.input), ("one per input", "input"))
    prompts, _ = await off_loop(completion_prompts, ctx, req.input, req.truncate_prompt_tokens, req.add_special_tokens,
                                "input")  # fmt: skip
    if (longest := max(map(len, prompts))) > ctx.max_model_len:
        raise bad_request(f"This model's maximum context length is {ctx.max_model_len} tokens, but an input has "
                          f"{longest} tokens. Shorten it, or set truncate_prompt_tokens.", "input")  # fmt: skip
    shared = {**ctx.request_fields(req.model, req.priority, req.cache_salt), "pool": True}
    rid = f"embd-{request_id}"
    fan = await ctx.start(lambda: FanOut(ctx.client, rid, prompts, 1, SamplingParams(max_tokens=0), lambda _: None,
                                         shared=shared))  # fmt: skip
    choices = await collect(ctx, raw, fan)
    if choices is None:
        return Response(status_code=499)  # the client left; its requests were aborted
    data = []
    for choice in choices:
        assert choice.result.pooled is not None, "an embed request finished without its embedding"
        vector = pooling.embedding(choice.result.pooled, length)
        value = base64.b64encode(vector.tobytes()).decode() if req.encoding_format == "base64" else vector.tolist()
        data.append({"object": "embedding", "index": choice.index, "embedding": value})
    tokens = fan.num_prompt_tokens
    body = {"id": rid, "object": "list", "created": int(time.time()), "model": ctx.served_name(req.model),
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip
    # msgspec: 1000 embeddings of 1024 floats are 20 MB of JSON, written in 0.06 s where json.dumps takes 0.8
    return Response(msgspec.json.encode(body), media_type="application/json")


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
