"""POST /v1/chat/completions: messages -> chat template -> choices; role/content deltas; chat-style logprobs."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

from common.messages import StructuredOutput
from frontend.api.prompt_logprobs import check_stream, choice_prompt_logprobs, with_prompt_logprobs
from frontend.api.protocol import ChatCompletionRequest, ChatMessage
from frontend.api.serving import ServingContext, check_stream_options, clamp, off_loop, respond, token_namer
from frontend.api.sse import ResponseFormat
from frontend.api.structured_request import check, with_structured_output
from frontend.api.token_ids import WithTokenIds
from frontend.engine.fanout import Choice, FanOut
from frontend.engine.request_stream import Delta
from frontend.errors import bad_request
from frontend.text.tokenizer import TemplateKwargsError, TokenizerError
from frontend.tools.reasoning import after_thinking, with_reasoning
from frontend.tools.tool_calls import ToolPlan, calls_or_output, functions_as_tools, plan_tools
from frontend.tools.tool_stream import ToolStreams, as_function_call, finish_reason, legacy_finish_reason, message


def chat_prompt(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None, keep: int | None = None,
                add_special_tokens: bool = False) -> list[int]:  # fmt: skip
    if continue_final_message and add_generation_prompt:  # vLLM's words
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")  # fmt: skip
    try:
        # Special-token text inside the messages stays text unless the server was told to parse it.
        dicts = [m.template_dict() for m in messages]
        ids = ctx.tokenizer.encode_chat(dicts, add_generation_prompt, tools, continue_final_message, template_kwargs,
                                        add_special_tokens)  # fmt: skip
    except TokenizerError as exc:
        param = "chat_template_kwargs" if isinstance(exc, TemplateKwargsError) else "messages"
        raise bad_request(str(exc), param) from exc
    return ctx.check_prompt(ids, "messages", keep)


class ChatFormat:
    chunk_object = "chat.completion.chunk"

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, tools: ToolPlan | None = None,
                 structured: StructuredOutput | None = None) -> None:  # fmt: skip
        """`structured`: the grammar that holds the answer (a forced call, a response format), if any."""
        self.tok = ctx.tokenizer
        self.want_logprobs = req.logprobs
        self.name = token_namer(ctx, req.return_tokens_as_token_ids)  # how logprobs name a token
        make_parser = tools.make_parser() if tools is not None else None
        make_parser = with_reasoning(ctx.reasoning_parser, make_parser, structured)
        self.tool_streams = ToolStreams(make_parser) if make_parser is not None else None  # None: plain content
        self.prompt_logprobs_k = req.prompt_logprobs
        self.legacy_functions = req.functions is not None  # calls are answered as function_call
        # echo: the final message is the answer's beginning when it is the assistant's (as vLLM echoes it)
        last = req.messages[-1]
        self.echo = last.template_dict()["content"] if req.echo and last.role == "assistant" else ""

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.name(token_id), "logprob": clamp(logprob), "bytes": list(self.tok.token_bytes(token_id))}

    def _logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        content = []
        for i, (token, lp) in enumerate(zip(delta.token_ids, delta.logprobs, strict=False)):
            entry = self._entry(token, lp)
            ids = delta.top_ids[i] if i < len(delta.top_ids) else []
            lps = delta.top_logprobs[i] if i < len(delta.top_logprobs) else []
            entry["top_logprobs"] = [self._entry(t, x) for t, x in zip(ids, lps, strict=False)]
            content.append(entry)
        return {"content": content}

    def opening(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": self.echo}, "logprobs": None,
                "finish_reason": None}  # fmt: skip

    def content(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        if self.tool_streams is not None:  # the text goes through the choice's tool-call parser
            deltas = self.tool_streams.deltas(index, delta.text, delta.finish_reason is not None)
            if self.legacy_functions:
                deltas = [d for d in map(as_function_call, deltas) if d is not None]
            logprobs = self._logprobs(delta)
            if not deltas and logprobs is not None and logprobs["content"]:
                deltas = [{}]
            return [{"index": index, "delta": d, "logprobs": logprobs if i == 0 else None, "finish_reason": None}
                    for i, d in enumerate(deltas)]  # fmt: skip
        if not delta.text and not (self.want_logprobs and delta.logprobs):
            return []
        return [{"index": index, "delta": {"content": delta.text}, "logprobs": self._logprobs(delta),
                 "finish_reason": None}]  # fmt: skip

    def text_affixes(self, index: int) -> tuple[str, str] | None:
        """content()'s JSON around the text, when that is all it holds (no logprobs, no tool-call parsing)."""
        if self.want_logprobs or self.tool_streams is not None:
            return None
        return f'{{"index":{index},"delta":{{"content":', '},"logprobs":null,"finish_reason":null}'

    def finish(self, index: int, delta: Delta) -> dict[str, Any]:
        reason = delta.finish_reason
        if self.tool_streams is not None:
            reason = self.tool_streams.finish_reason(index, reason)
        if self.legacy_functions:
            reason = legacy_finish_reason(reason)
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason,
                "stop_reason": delta.stop_reason}  # fmt: skip

    def response(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        out = []
        for c in choices:
            msg, reason = {"role": "assistant", "content": c.result.text}, c.result.finish_reason
            if self.tool_streams is not None:
                parser = self.tool_streams.make_parser()
                msg, reason = message(parser, c.result.text), finish_reason(parser, reason)
                if self.legacy_functions:
                    msg, reason = as_function_call(msg) or msg, legacy_finish_reason(reason)
            if self.echo:
                msg["content"] = self.echo + (msg["content"] or "")
            out.append({"index": c.index, "message": msg, "logprobs": self._logprobs(c.result),
                        "finish_reason": reason, "stop_reason": c.result.stop_reason})  # fmt: skip
        body = {"object": "chat.completion", "choices": out, "usage": usage}
        if self.prompt_logprobs_k is not None:  # once, as vLLM's chat responses: every choice has the one prompt
            body["prompt_logprobs"] = choice_prompt_logprobs(self.tok, choices[0], self.prompt_logprobs_k)
        return body


async def start_chat(ctx: ServingContext, req: ChatCompletionRequest, rid: str,
                     clamp: bool = False) -> tuple[FanOut, ToolPlan]:  # fmt: skip
    """A chat request checked, admitted, rendered and sent to the engine as `rid`; also what to do with its tools.
    Shared by /v1/chat/completions, /v1/responses and /v1/messages (which translate their requests into chat
    requests). `clamp`: a max_tokens past the context is cut to it (ServingContext.max_tokens)."""
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    req = ctx.checked_logprobs(req, "top_logprobs")
    check_stream(req.prompt_logprobs, req.stream)
    check_stream_options(req)
    req = functions_as_tools(req)
    # Tool schemas are checked off the event loop: a large one takes a while.
    tools = await off_loop(plan_tools, req, ctx.tool_call_parser) if req.tools else plan_tools(req, None)
    if tools.keeps_special_tokens:
        req = req.model_copy(update={"skip_special_tokens": False})
    if tools.stop:  # the user's stop strings were checked already: these are the format's own
        stop = req.stop_strings
        req = req.model_copy(update={"stop": [*stop, *(s for s in tools.stop if s not in stop)]})
    await ctx.admit(req.n)
    kwargs = req.chat_template_kwargs if req.documents is None else {**(req.chat_template_kwargs or {}),
                                                                     "documents": req.documents}  # fmt: skip
    prompt = await off_loop(chat_prompt, ctx, req.messages, req.add_generation_prompt, tools.template_tools,
                            req.continue_final_message, kwargs, req.truncate_prompt_tokens,
                            req.add_special_tokens)  # fmt: skip
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = ctx.max_tokens(len(prompt), requested, param, clamp)
    params = ctx.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    params = with_prompt_logprobs(params, req.prompt_logprobs)
    params = await with_structured_output(req, params)  # response_format, guided_*: a bad one is a 400
    structured = tools.structured or calls_or_output(tools, req.tools or [], params.structured)
    if structured is not None:  # a forced tool call (it wins over a format), or the format's JSON or tool calls
        await check(structured, "tools")
        params = msgspec.structs.replace(params, structured=structured)
    if params.structured is not None:  # a reasoning model thinks first, where its tags are tokens
        params = msgspec.structs.replace(params, structured=after_thinking(params.structured, ctx.thinking))
    fan = await ctx.fan_out(rid, [prompt], req, params)
    fan.count_reasoning = ctx.reasoning_tokens
    return fan, tools


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request,
                                 request_id: str) -> Response:  # fmt: skip
    rid = f"chatcmpl-{request_id}"
    fan, tools = await start_chat(ctx, req, rid)
    fmt: ResponseFormat = ChatFormat(ctx, req, tools, fan.params.structured)
    return await respond(ctx, raw, fan, WithTokenIds(fmt, fan, chat=True) if req.return_token_ids else fmt, rid, req)
