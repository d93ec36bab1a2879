"""POST /v1/completions: prompts (text, texts, ids, id lists) -> choices; echo; legacy-style logprobs."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from frontend.errors import bad_request
from frontend.fanout import Choice
from frontend.protocol import DEFAULT_COMPLETION_TOKENS, CompletionRequest
from frontend.request_stream import Delta
from frontend.serving import ServingContext, clamp, off_loop, respond


class CompletionFormat:
    chunk_object = "text_completion"

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompts: list[list[int]],
                 prompt_texts: list[str]) -> None:  # fmt: skip
        self.tok = ctx.tokenizer
        self.n = req.n
        self.echo = req.echo
        self.want_logprobs = req.logprobs is not None
        self.prompts = prompts
        self.prompt_texts = prompt_texts
        self.offsets = [0] * len(prompts) * req.n  # text_offset of each choice's next token

    def _prompt_index(self, index: int) -> int:
        return index // self.n

    def _echo_logprobs(self, index: int) -> dict[str, list]:
        """The engine computes no prompt logprobs: echoed prompt tokens carry null, as OpenAI's first token does."""
        tokens = [self.tok.token_text(t) for t in self.prompts[self._prompt_index(index)]]
        return {"tokens": tokens, "token_logprobs": [None] * len(tokens), "top_logprobs": [None] * len(tokens),
                "text_offset": self._advance(index, tokens)}  # fmt: skip

    def _advance(self, index: int, tokens: list[str]) -> list[int]:
        offsets = []
        for text in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(text)
        return offsets

    def _logprobs(self, index: int, delta: Delta) -> dict[str, list] | None:
        if not self.want_logprobs:
            return None
        tokens = [self.tok.token_text(t) for t in delta.token_ids[: len(delta.logprobs)]]
        top = [{self.tok.token_text(t): clamp(lp) for t, lp in zip(ids, lps, strict=False)}
               for ids, lps in zip(delta.top_ids, delta.top_logprobs, strict=False)]  # fmt: skip
        return {"tokens": tokens, "token_logprobs": [clamp(lp) for lp in delta.logprobs], "top_logprobs": top,
                "text_offset": self._advance(index, tokens)}  # fmt: skip

    def opening(self, index: int) -> dict[str, Any] | None:
        if not self.echo:
            return None
        logprobs = self._echo_logprobs(index) if self.want_logprobs else None
        text = self.prompt_texts[self._prompt_index(index)]
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def content(self, index: int, delta: Delta) -> dict[str, Any] | None:
        if not delta.text and not (self.want_logprobs and delta.logprobs):
            return None
        return {"index": index, "text": delta.text, "logprobs": self._logprobs(index, delta), "finish_reason": None}

    def finish(self, index: int, delta: Delta) -> dict[str, Any]:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason}  # fmt: skip

    def response(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        out = []
        for c in choices:
            text, logprobs = c.result.text, None
            if self.echo:
                text = self.prompt_texts[c.prompt_index] + text
            if self.want_logprobs:
                logprobs = self._echo_logprobs(c.index) if self.echo else None
                own = self._logprobs(c.index, c.result)
                assert own is not None
                logprobs = own if logprobs is None else {k: logprobs[k] + own[k] for k in own}
            out.append({"index": c.index, "text": text, "logprobs": logprobs,
                        "finish_reason": c.result.finish_reason, "stop_reason": c.result.stop_reason})  # fmt: skip
        return {"object": "text_completion", "choices": out, "usage": usage}


def completion_prompts(ctx: ServingContext, prompt: str | list[str] | list[int] | list[list[int]]
                       ) -> tuple[list[list[int]], list[str]]:  # fmt: skip
    """Every accepted prompt form -> (token ids, text) per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]  # type: ignore[list-item]
    ids_list: list[list[int]] = []
    texts: list[str] = []
    for p in prompt:
        ids = ctx.tokenizer.encode(p) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
        ctx.check_prompt(ids, "prompt")  # ids out of range must not reach the decode below
        texts.append(p if isinstance(p, str) else ctx.tokenizer.decode(ids, skip_special_tokens=False))
        ids_list.append(ids)
    return ids_list, texts


def num_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request, request_id: str) -> Response:
    ctx.check_model(req.model)
    await ctx.admit(num_prompts(req.prompt) * req.n)
    prompts, texts = await off_loop(completion_prompts, ctx, req.prompt)
    requested = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
    max_tokens = ctx.max_tokens(max(len(p) for p in prompts), requested, "max_tokens")
    params = ctx.sampling_params(req, max_tokens, req.logprobs)
    rid = f"cmpl-{request_id}"
    fan = await ctx.fan_out(rid, prompts, req, params)
    fmt = CompletionFormat(ctx, req, prompts, texts)
    return await respond(ctx, raw, fan, fmt, rid, bool(req.stream), req.include_usage)
