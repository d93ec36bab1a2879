"""Serving: validated request -> prompt ids -> FanOut -> JSON response or SSE in OpenAI's order; usage; disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.config import DEFAULT_MAX_LOGPROBS, ServerConfig
from common.messages import LoraRef, SamplingParams
from common.pooling import Pooling
from common.structured import INVALID_CONSTRAINT
from frontend.api.conversations import ConversationStore
from frontend.api.lora_adapters import LoraRegistry
from frontend.api.protocol import SamplingFields
from frontend.api.responses_store import ResponseStore
from frontend.api.sampling_defaults import SamplingDefaults
from frontend.api.sse import ResponseFormat, sse_stream
from frontend.engine.engine_client import AsyncEngineClient, EngineUnavailable, QueueFull
from frontend.engine.fanout import Choice, FanOut
from frontend.engine.recovery import ENGINE_GONE, POISON
from frontend.errors import ApiError, bad_request
from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.text.tokenizer import Tokenizer
from frontend.tools.reasoning import ReasoningTokens

T = TypeVar("T")
STORE_BYTES = ServerConfig.responses_store_mib << 20
R = TypeVar("R", bound=SamplingFields)


@dataclass
class ServingContext:
    client: AsyncEngineClient
    tokenizer: Tokenizer
    model_name: str  # what responses name the base model: --served-model-name's first name
    max_model_len: int
    vocab_size: int
    tool_call_parser: str | None = None  # --tool-call-parser: reads calls in the model's own format (tool_choice auto)
    reasoning_parser: str | None = None  # --reasoning-parser: chat answers' <think> part comes back as `reasoning`
    thinking: tuple[int | None, int] | None = None  # its tag tokens, which grammars wait on (reasoning.thinking_tokens)
    reasoning_tokens: ReasoningTokens | None = None  # counts the thinking for usage (where `thinking` is known)
    priority_scheduling: bool = False  # --scheduling-policy priority: requests' `priority` orders the engine's queue
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # --generation-config: what requests leave out
    loras: LoraRegistry = field(default_factory=LoraRegistry)  # the LoRA adapters served (api/lora_adapters.py)
    model_aliases: tuple[str, ...] = ()  # --served-model-name's other names: requests may name the base model so
    # --runner pooling: the server embeds or scores (api/serving_embeddings.py, serving_scores.py), never generates
    pooling: Pooling | None = None
    pair_template: bool = False  # --chat-template given: a scored pair is rendered by it, as vLLM's score template
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage says how many prompt tokens were cached
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # --max-logprobs, resolved: the most alternatives a request may ask for
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids: what a request that does not say takes
    # /v1/responses' stored responses (previous_response_id, GET) and /v1/conversations: --responses-store-mib
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(STORE_BYTES))
    conversations: ConversationStore = field(default_factory=lambda: ConversationStore(STORE_BYTES))

    @property
    def base_names(self) -> tuple[str, ...]:
        return self.model_name, *self.model_aliases

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.base_names and model not in self.loras.refs:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def lora(self, model: str | None) -> LoraRef | None:
        """The LoRA adapter a request's `model` names, which serves it in the engine (None: the base model)."""
        return self.loras.get(model) if model not in self.base_names else None

    def served_name(self, model: str | None) -> str:
        """The `model` a response names: the adapter's where one serves it, as vLLM answers."""
        ref = self.lora(model)
        return ref.name if ref is not None else self.model_name

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)

    def check_prompt(self, ids: list[int], param: str, keep: int | None = None) -> list[int]:
        """The prompt's ids, checked; with vLLM's truncate_prompt_tokens (`keep`), only its last `keep` tokens (-1:
        as many as the context holds)."""
        if keep is not None:
            if keep == 0:
                raise bad_request("truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
            ids = ids[-(self.max_model_len if keep == -1 else keep) :]
        if not ids:
            raise bad_request(f"{param} is empty", param)
        self.check_token_ids(ids, param)
        return ids

    def max_tokens(self, prompt_len: int, requested: int | None, param: str, clamp: bool = False) -> int:
        """The requested budget (default: the rest of the context), checked against max_model_len, then capped by
        the generation config's max_new_tokens (as vLLM: a server-wide limit). `clamp`: a budget past the context
        is cut to it rather than refused (Anthropic's max_tokens is a ceiling; Claude Code asks for 32000)."""
        room = self.max_model_len - prompt_len
        cap = self.sampling_defaults.max_tokens or room
        if clamp and requested is not None and room >= 1:
            requested = min(requested, room)
        if requested is None:
            if room < 1:
                raise bad_request(f"the prompt has {prompt_len} tokens; the maximum context length is "
                                  f"{self.max_model_len}", param)  # fmt: skip
            return min(room, cap)
        if requested > room or room < 1:  # the engine needs the prompt shorter than the context, max_tokens 0 too
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                              f"in the completion).", param)  # fmt: skip
        return min(requested, cap)

    def checked_logprobs(self, req: R, field: str) -> R:
        """`req` with -1 (vLLM's: the whole vocabulary) resolved in `field` (the k of its sampled logprobs) and in
        prompt_logprobs; more than --max-logprobs is refused, in vLLM's words."""
        resolved: dict[str, int] = {}
        for what, name in (("sample", field), ("prompt", "prompt_logprobs")):
            k = getattr(req, name)
            if k is None:
                continue
            resolved[name] = k = self.vocab_size if k == -1 else k
            if k > self.max_logprobs:
                raise bad_request(f"Requested {what} logprobs of {k}, which is greater than max allowed: "
                                  f"{self.max_logprobs}", name)  # fmt: skip
        return req.model_copy(update=resolved) if resolved else req

    def sampling_params(self, req: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        self.check_token_ids(list(req.stop_token_ids or []), "stop_token_ids")
        self.check_token_ids(list(req.logit_bias or {}), "logit_bias")
        self.check_token_ids(list(req.allowed_token_ids or []), "allowed_token_ids")
        if req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens})", "min_tokens")
        params = req.sampling_params(max_tokens, logprobs, self.sampling_defaults)
        return msgspec.structs.replace(params, bad_words=self.bad_word_ids(req.bad_words)) if req.bad_words else params

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's bad_words as token sequences: each word as it would begin the text and as it would follow a space."""
        sequences: list[list[int]] = []
        for word in words:
            if not word.strip():
                raise bad_request("bad_words holds an empty word", "bad_words")
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    async def admit(self, num_requests: int, what: tuple[str, str] = ("prompts x n", "n")) -> None:
        """Capacity first, before any text work: a full server refuses a burst in microseconds, not after
        rendering and tokenizing every prompt. A restarting engine is waited for (--engine-restart-timeout).
        A request larger than the whole queue would never fit: a 400, not a 429 to retry in vain. `what`: what
        the count is, and the field to blame."""
        if num_requests > self.client.max_queued:
            limit = self.client.max_queued
            raise bad_request(f"this request makes {num_requests} engine requests ({what[0]}), more than the "
                              f"server ever queues (--max-queued-requests {limit})", what[1])  # fmt: skip
        try:
            await self.client.wait_available()
            self.client.check_capacity(num_requests)
        except (EngineUnavailable, QueueFull) as exc:
            raise _unavailable(exc) from exc

    def request_fields(self, model: str | None, priority: int, cache_salt: str | None) -> dict[str, Any]:
        """The EngineRequest fields of every engine request behind an API request."""
        if priority != 0 and not self.priority_scheduling:  # as vLLM: it would be ignored
            raise bad_request("priority scheduling is not enabled (start the server with --scheduling-policy "
                              "priority)", "priority")  # fmt: skip
        return {"priority": priority, "lora": self.lora(model), "cache_salt": cache_salt or ""}

    async def fan_out(self, request_id: str, prompts: list[list[int]], req: SamplingFields,
                      params: SamplingParams) -> FanOut:  # fmt: skip
        def detokenizer(prompt: list[int]) -> IncrementalDetokenizer:
            return IncrementalDetokenizer(self.tokenizer, prompt, req.stop_strings, req.include_stop_str_in_output,
                                          req.skip_special_tokens, req.min_tokens)  # fmt: skip

        shared = self.request_fields(req.model, req.priority, req.cache_salt)
        fan = await self.start(lambda: FanOut(self.client, request_id, prompts, req.n, params, detokenizer,
                                              req.include_stop_str_in_output, shared))  # fmt: skip
        fan.prompt_tokens_details = self.prompt_tokens_details
        return fan

    async def start(self, fan_out: Callable[[], FanOut]) -> FanOut:
        """Sends an API request's engine requests once an engine is up (a 503 if none comes back in time)."""
        try:
            await self.client.wait_available()
            return fan_out()
        except (EngineUnavailable, QueueFull) as exc:  # the capacity others took while this one tokenized
            raise _unavailable(exc) from exc

    def failure(self, error: str | None, code: str | None = None) -> ApiError:
        if code == INVALID_CONSTRAINT:  # its grammar did not compile: the request's fault, which a retry repeats
            return bad_request(error or "the structured output constraint could not be compiled", None, code)
        if code == POISON:  # this request is the likely cause: retrying it elsewhere will not help
            return ApiError(500, error or "the request crashed the engine core", None, code)
        # Its engine will not come back (retired past its restart budget, or shutdown), or none serves: retry later.
        status = 503 if code == ENGINE_GONE or self.client.dead is not None else 500
        return ApiError(status, error or "the request failed in the engine", None, code or "engine_error")


def check_stream_options(req: SamplingFields) -> None:
    """OpenAI refuses stream_options on a request that does not stream (an explicit null is the default: fine)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                          "stream_options")  # fmt: skip


def _unavailable(exc: EngineUnavailable | QueueFull) -> ApiError:
    if isinstance(exc, QueueFull):  # 429 + Retry-After is what clients and proxies back off on
        return ApiError(429, str(exc), None, "too_many_requests", {"Retry-After": "1"})
    return ApiError(503, str(exc), None, "engine_unavailable")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Text work (chat templates, tokenizing, decoding) in a worker thread: a megabyte prompt takes seconds, and
    the event loop must keep serving /health and every other stream meanwhile (the tokenizer releases the GIL)."""
    return await asyncio.to_thread(fn, *args)


def token_namer(ctx: ServingContext, as_ids: bool | None) -> Callable[[int], str]:
    """How logprobs name a token: its text, or with vLLM's return_tokens_as_token_ids "token_id:{id}" (a token
    that is part of a character has no text of its own). `as_ids`: the request's choice (None: the server's)."""
    as_ids = ctx.tokens_as_ids if as_ids is None else as_ids
    return (lambda t: f"token_id:{t}") if as_ids else ctx.tokenizer.token_text


def clamp(logprob: float) -> float:
    """JSON has no -inf or NaN: a token the sampler could never pick reports -9999 as vLLM does."""
    return logprob if logprob == logprob and logprob > -9999.0 else -9999.0


class ClosingStreamingResponse(StreamingResponse):
    """Runs `on_close` however the response ends (done, client gone, server stopping): aborts leftover requests."""

    def __init__(self, content: AsyncIterator[str | bytes], on_close: Callable[[], None], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away. The body was read already, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(ctx: ServingContext, raw: Request, fan: FanOut) -> list[Choice] | None:
    """Every choice run to its end (non-streaming); None when the client left first (its requests are aborted).
    A choice that failed in the engine raises its ApiError."""
    work = asyncio.ensure_future(fan.collect())
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        fan.abort()  # the client left (or this handler was cancelled): free the engine at once
    if not work.done() or work.cancelled():
        return None
    choices = work.result()
    failed = next((c.result for c in choices if c.result.finish_reason == "error"), None)
    if failed is not None:
        raise ctx.failure(failed.error, failed.error_code)
    return choices


async def respond(ctx: ServingContext, raw: Request, fan: FanOut, fmt: ResponseFormat, request_id: str,
                  req: SamplingFields) -> Response:  # fmt: skip
    head = {"id": request_id, "created": int(time.time()), "model": ctx.served_name(req.model)}
    if req.stream:
        chunks = sse_stream(fan, fmt, head, req.include_usage, req.continuous_usage, ctx.failure)
        return ClosingStreamingResponse(chunks, fan.abort, "text/event-stream")
    choices = await collect(ctx, raw, fan)
    if choices is None:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    return JSONResponse({**head, **fmt.response(choices, fan.usage())})


def stream_text(fan: FanOut) -> Response:
    """POST /generate: the text as it is generated, plain; a failure mid-way ends it with an [error: ...] line."""

    async def body() -> AsyncIterator[str]:
        try:
            async for _, delta in fan.deltas():
                if delta.text:
                    yield delta.text
                if delta.finish_reason == "error":
                    yield f"\n[error: {delta.error}]\n"
        finally:
            fan.abort()

    return ClosingStreamingResponse(body(), fan.abort, "text/plain; charset=utf-8")
