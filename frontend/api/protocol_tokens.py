"""Schemas of the vLLM-style token utilities: /generate, /tokenize, /detokenize."""

from __future__ import annotations

from pydantic import Field

from frontend.api.protocol import ApiModel, ChatMessage, SamplingFields, TemplateKwargs, Text
from frontend.api.refused_fields import RequestTemplate


class GenerateRequest(SamplingFields):
    """POST /generate: the smallest useful request; the answer is plain text, streamed."""

    prompt: Text | list[int]
    max_tokens: int = Field(16, ge=1)


class TokenizeRequest(ApiModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: RequestTemplate = None  # refused, as in a chat request
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: bool = False  # vLLM's: each id's piece of the vocabulary, as the tokenizer writes it


class DetokenizeRequest(ApiModel):
    model: Text | None = None
    tokens: list[int]
