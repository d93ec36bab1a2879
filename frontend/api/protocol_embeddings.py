"""The schema of POST /v1/embeddings: OpenAI's fields and vLLM's extras."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from frontend.api.protocol import ApiModel, CacheSalt, Text


class EmbeddingRequest(ApiModel):
    input: Text | list[Text] | list[int] | list[list[int]]
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # Matryoshka models: the embedding's first `dimensions` values
    user: Text | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True  # the tokenizer's own, such as the EOS an embedding model's tokenizer appends
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    cache_salt: CacheSalt | None = None
