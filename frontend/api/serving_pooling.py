"""What every pooling route (embeddings, score, rerank, classify) does once its prompts are token ids: one engine
request each (max_tokens 0, pooled), run to its end, and what each pooled to, in prompt order."""

from __future__ import annotations

import msgspec
from fastapi import Request
from fastapi.responses import Response

from common.messages import SamplingParams
from common.pooling import Pooling
from frontend.api.protocol_embeddings import EmbeddingRequest
from frontend.api.protocol_scores import ClassifyRequest
from frontend.api.serving import ServingContext, collect, off_loop
from frontend.api.serving_completion import completion_prompts, num_prompts
from frontend.engine.fanout import FanOut
from frontend.errors import bad_request

EMBEDDINGS_ROUTE = "POST /v1/embeddings"
SCORE_ROUTES = "POST /score, /rerank or /classify"


def serving_pooling(ctx: ServingContext, classifier: bool | None) -> Pooling:
    """The server's pooling, for a route that needs a classifier (True), an embedding model (False) or either."""
    pooling = ctx.pooling
    if pooling is None:
        raise bad_request("this server generates text; embeddings and scores need a server started with --runner "
                          "pooling (an embedding model or a classifier starts so by itself)", "model")  # fmt: skip
    if classifier is not None and pooling.classifies != classifier:
        has, route = ("a classifier", SCORE_ROUTES) if pooling.classifies else ("an embedding model", EMBEDDINGS_ROUTE)
        raise bad_request(f"this server serves {has}, which does not answer this route: {route}", "model")
    return pooling


async def pool_prompts(ctx: ServingContext, raw: Request, rid: str, prompts: list[list[int]], fields: dict,
                       param: str) -> tuple[list[bytes], int] | None:  # fmt: skip
    """What each prompt pooled to (EngineOutput.pooled), and the prompt tokens; None when the client left.
    `fields`: ServingContext.request_fields'; `param`: the field a prompt too long is blamed on."""
    if (longest := max(map(len, prompts))) > ctx.max_model_len:
        raise bad_request(f"This model's maximum context length is {ctx.max_model_len} tokens, but an input has "
                          f"{longest} tokens. Shorten it, or set truncate_prompt_tokens.", param)  # fmt: skip
    shared = {**fields, "pool": True}
    fan = await ctx.start(lambda: FanOut(ctx.client, rid, prompts, 1, SamplingParams(max_tokens=0), lambda _: None,
                                         shared=shared))  # fmt: skip
    choices = await collect(ctx, raw, fan)
    if choices is None:
        return None
    pooled = []
    for choice in sorted(choices, key=lambda c: c.index):
        assert choice.result.pooled is not None, "a pooling request finished without its result"
        pooled.append(choice.result.pooled)
    return pooled, fan.num_prompt_tokens


async def pool_inputs(ctx: ServingContext, raw: Request, rid: str,
                      req: EmbeddingRequest | ClassifyRequest) -> tuple[list[bytes], int] | None:  # fmt: skip
    """A request's `input` (texts, token ids, or lists of either) admitted, tokenized and pooled, one engine
    request per input: pool_prompts' answer."""
    await ctx.admit(num_prompts(req.input), ("one per input", "input"))
    prompts, _ = await off_loop(completion_prompts, ctx, req.input, req.truncate_prompt_tokens, req.add_special_tokens,
                                "input")  # fmt: skip
    fields = ctx.request_fields(req.model, req.priority, req.cache_salt)
    return await pool_prompts(ctx, raw, rid, prompts, fields, "input")


def json_response(body: dict) -> Response:
    # msgspec: 1000 embeddings of 1024 floats are 20 MB of JSON, written in 0.06 s where json.dumps takes 0.8
    return Response(msgspec.json.encode(body), media_type="application/json")
