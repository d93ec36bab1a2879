"""vLLM's score, rerank and classify routes on a pooling server.

A classifier (common/pooling.py) scores a (query, document) pair as one prompt: rendered by --chat-template where one
was given (messages of roles "query" and "document", vLLM's score template: Qwen3-Reranker's prompt, say), else the
two texts joined, as vLLM joins them for a decoder; the score is its one logit's sigmoid. An embedding model scores
a pair as the cosine of the two texts' embeddings. Rerank is score with one query, best first.
"""

from __future__ import annotations

import time

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from common.pooling import unit_length
from frontend.api.protocol_scores import ClassifyRequest, RerankRequest, ScoreRequest
from frontend.api.serving import ServingContext, off_loop
from frontend.api.serving_completion import completion_prompts
from frontend.api.serving_pooling import json_response, pool_inputs, pool_prompts, serving_pooling
from frontend.errors import bad_request
from frontend.text.tokenizer import TokenizerError

Pairs = list[tuple[str, str]]


async def create_score(ctx: ServingContext, req: ScoreRequest, raw: Request, request_id: str) -> Response:
    ctx.check_model(req.model)
    queries = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    documents = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not queries or not documents:
        raise bad_request("text_1 and text_2 each need at least one text", "text_1" if not queries else "text_2")
    if len(queries) > 1 and len(queries) != len(documents):
        raise bad_request(f"text_1 has {len(queries)} texts and text_2 {len(documents)}: give one text_1 for all, "
                          "or one per text_2", "text_1")  # fmt: skip
    if len(queries) == 1:
        queries = queries * len(documents)
    pairs = list(zip(queries, documents, strict=True))
    rid = f"score-{request_id}"
    result = await score_pairs(ctx, req, raw, rid, pairs, "text_2")
    if result is None:
        return Response(status_code=499)  # the client left; its requests were aborted
    scores, tokens = result
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return json_response({"id": rid, "object": "list", "created": int(time.time()), "model": ctx.served_name(req.model),
                          "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


async def create_rerank(ctx: ServingContext, req: RerankRequest, raw: Request, request_id: str) -> Response:
    ctx.check_model(req.model)
    if not req.documents:
        raise bad_request("documents is empty", "documents")
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    rid = f"rerank-{request_id}"
    result = await score_pairs(ctx, req, raw, rid, [(req.query, t) for t in texts], "documents")
    if result is None:
        return Response(status_code=499)
    scores, tokens = result
    results = []
    for i in sorted(range(len(texts)), key=lambda i: -scores[i])[: req.top_n or None]:  # best first
        result: dict = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return json_response({"id": rid, "model": ctx.served_name(req.model), "results": results,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


async def create_classify(ctx: ServingContext, req: ClassifyRequest, raw: Request, request_id: str) -> Response:
    ctx.check_model(req.model)
    pooling = serving_pooling(ctx, classifier=True)
    rid = f"classify-{request_id}"
    result = await pool_inputs(ctx, raw, rid, req)
    if result is None:
        return Response(status_code=499)
    pooled, tokens = result
    data = []
    for index, logits in enumerate(pooled):
        values = pooling.label_scores(logits, req.use_activation)
        data.append({"index": index, "label": pooling.labels[int(np.argmax(values))], "probs": values.tolist(),
                     "num_classes": pooling.size})  # fmt: skip
    return json_response({"id": rid, "object": "list", "created": int(time.time()), "model": ctx.served_name(req.model),
                          "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


async def score_pairs(ctx: ServingContext, req: ScoreRequest | RerankRequest, raw: Request, rid: str, pairs: Pairs,
                      param: str) -> tuple[list[float], int] | None:  # fmt: skip
    """Each pair's score and the prompt tokens it took; None when the client left."""
    pooling = serving_pooling(ctx, classifier=None)
    if pooling.classifies and pooling.size != 1:
        raise bad_request(f"this classifier has {pooling.size} labels; a score needs a model with one (a reranker): "
                          "POST /classify gives each label's probability", "model")  # fmt: skip
    fields = ctx.request_fields(req.model, req.priority, req.cache_salt)
    if pooling.classifies:
        await ctx.admit(len(pairs), ("one per pair", param))
        prompts = await off_loop(pair_prompts, ctx, pairs, req.truncate_prompt_tokens, req.add_special_tokens, param)
        result = await pool_prompts(ctx, raw, rid, prompts, fields, param)
        if result is None:
            return None
        logits, tokens = result
        return [float(pooling.label_scores(x, req.use_activation)[0]) for x in logits], tokens
    # An embedding model: each distinct text embedded once, then each pair's cosine
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    await ctx.admit(len(texts), ("one per distinct text", param))
    prompts, _ = await off_loop(completion_prompts, ctx, texts, req.truncate_prompt_tokens, req.add_special_tokens,
                                param)  # fmt: skip
    result = await pool_prompts(ctx, raw, rid, prompts, fields, param)
    if result is None:
        return None
    hidden, tokens = result
    unit = {t: unit_length(pooling.embedding(h).astype(np.float64)) for t, h in zip(texts, hidden, strict=True)}
    return [float(unit[q] @ unit[d]) for q, d in pairs], tokens


def pair_prompts(ctx: ServingContext, pairs: Pairs, keep: int | None, add_special_tokens: bool,
                 param: str) -> list[list[int]]:  # fmt: skip
    """Each (query, document) as a classifier's prompt: the --chat-template's rendering, or the texts joined."""
    prompts = []
    for query, document in pairs:
        try:
            ids = ctx.tokenizer.encode_pair(query, document, ctx.pair_template, add_special_tokens)
        except TokenizerError as exc:
            raise bad_request(f"--chat-template could not render this pair: {exc}", param) from None
        prompts.append(ctx.check_prompt(ids, param, keep))
    return prompts
