"""The schemas of vLLM's score, rerank and classify routes (POST /score, /rerank, /classify and their /v1, /v2
aliases), which RAG pipelines and rerank clients (Cohere's and Jina's shape) call."""

from __future__ import annotations

from pydantic import Field

from frontend.api.protocol import ApiModel, CacheSalt, Text


class PoolingExtras(ApiModel):
    model: Text | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # each prompt's last k tokens (a pair's, as rendered)
    add_special_tokens: bool = True  # the tokenizer's own, around a prompt that no --chat-template rendered
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    cache_salt: CacheSalt | None = None


class ScoreRequest(PoolingExtras):
    text_1: Text | list[Text]  # one query for every text_2, or one per text_2
    text_2: Text | list[Text]
    use_activation: bool = True  # a classifier's score is the sigmoid of its logit; false: the logit itself


class RerankDocument(ApiModel):
    text: Text


class RerankRequest(PoolingExtras):
    query: Text
    documents: list[Text | RerankDocument]  # strings, or Cohere's and Jina's {"text": ...}
    top_n: int = Field(0, ge=0)  # the best n (0: all), best first
    return_documents: bool = True
    use_activation: bool = True


class ClassifyRequest(PoolingExtras):
    input: Text | list[Text] | list[int] | list[list[int]]
    use_activation: bool = True  # probabilities (softmax over the labels; a single label's sigmoid); false: logits
