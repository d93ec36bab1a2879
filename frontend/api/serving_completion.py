"""POST /v1/completions: prompts (text, texts, ids, id lists) -> choices; echo; legacy-style logprobs."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from common.messages import Logprobs
from frontend.api.prompt_logprobs import (
    attach_vllm_shape,
    check_stream,
    echo_part,
    legacy_top,
    with_prompt_logprobs,
)
from frontend.api.protocol import DEFAULT_COMPLETION_TOKENS, CompletionRequest
from frontend.api.serving import ServingContext, check_stream_options, clamp, off_loop, respond, token_namer
from frontend.api.structured_request import with_structured_output
from frontend.api.token_ids import WithTokenIds
from frontend.engine.fanout import Choice
from frontend.engine.request_stream import Delta
from frontend.errors import bad_request


class CompletionFormat:
    chunk_object = "text_completion"

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompts: list[list[int]],
                 prompt_texts: list[str]) -> None:  # fmt: skip
        self.tok = ctx.tokenizer
        self.name = token_namer(ctx, req.return_tokens_as_token_ids)  # how logprobs name a token
        self.n = req.n
        self.echo = req.echo
        self.want_logprobs = req.logprobs is not None
        self.logprobs_n = req.logprobs or 0
        self.prompt_logprobs_k = req.prompt_logprobs
        self.prompts = prompts
        self.prompt_texts = prompt_texts
        self.offsets = [0] * len(prompts) * req.n  # text_offset of each choice's next token
        self.echoed = [False] * len(prompts) * req.n

    def _prompt_index(self, index: int) -> int:
        return index // self.n

    def _echo_logprobs(self, index: int, lp: Logprobs | None) -> dict[str, list]:
        """The echoed prompt's logprobs (the engine's prompt logprobs; the first token null, as OpenAI's)."""
        prompt = self.prompts[self._prompt_index(index)]
        part = echo_part(self.name, prompt, lp, self.logprobs_n)
        part["text_offset"] = self._advance(index, prompt)
        return part

    def _advance(self, index: int, token_ids: list[int]) -> list[int]:
        offsets = []
        for token in token_ids:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(self.tok.token_text(token))
        return offsets

    def _logprobs(self, index: int, delta: Delta) -> dict[str, list] | None:
        if not self.want_logprobs:
            return None
        token_ids = delta.token_ids[: len(delta.logprobs)]
        top = [legacy_top(self.name, t, lp, ids, lps)
               for t, lp, ids, lps in zip(delta.token_ids, delta.logprobs, delta.top_ids, delta.top_logprobs,
                                          strict=False)]  # fmt: skip
        return {"tokens": [self.name(t) for t in token_ids], "token_logprobs": [clamp(lp) for lp in delta.logprobs],
                "top_logprobs": top, "text_offset": self._advance(index, token_ids)}  # fmt: skip

    def opening(self, index: int) -> dict[str, Any] | None:
        # With logprobs the echo waits for the first output, which brings the prompt's logprobs.
        if not self.echo or self.want_logprobs:
            return None
        return {"index": index, "text": self.prompt_texts[self._prompt_index(index)], "logprobs": None,
                "finish_reason": None}  # fmt: skip

    def content(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        echo_now = self.echo and self.want_logprobs and not self.echoed[index]
        if not echo_now and not delta.text and not (self.want_logprobs and delta.logprobs):
            return []
        if not echo_now:
            return [{"index": index, "text": delta.text, "logprobs": self._logprobs(index, delta),
                     "finish_reason": None}]  # fmt: skip
        self.echoed[index] = True
        echo = self._echo_logprobs(index, delta.prompt_logprobs)
        own = self._logprobs(index, delta)
        assert own is not None
        return [{"index": index, "text": self.prompt_texts[self._prompt_index(index)] + delta.text,
                 "logprobs": {k: echo[k] + own[k] for k in own}, "finish_reason": None}]  # fmt: skip

    def text_affixes(self, index: int) -> tuple[str, str] | None:
        """content()'s JSON around the text, when that is all it holds (no logprobs, hence no echo after the start)."""
        if self.want_logprobs:
            return None
        return f'{{"index":{index},"text":', ',"logprobs":null,"finish_reason":null}'

    def finish(self, index: int, delta: Delta) -> dict[str, Any]:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason}  # fmt: skip

    def response(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        out = []
        for c in choices:
            text, logprobs = c.result.text, None
            if self.echo:
                text = self.prompt_texts[c.prompt_index] + text
            if self.want_logprobs:
                logprobs = self._echo_logprobs(c.index, c.result.prompt_logprobs) if self.echo else None
                own = self._logprobs(c.index, c.result)
                assert own is not None
                logprobs = own if logprobs is None else {k: logprobs[k] + own[k] for k in own}
            out.append({"index": c.index, "text": text, "logprobs": logprobs,
                        "finish_reason": c.result.finish_reason, "stop_reason": c.result.stop_reason})  # fmt: skip
        attach_vllm_shape(self.tok, out, choices, self.prompt_logprobs_k)
        return {"object": "text_completion", "choices": out, "usage": usage}


def completion_prompts(ctx: ServingContext, prompt: str | list[str] | list[int] | list[list[int]],
                       keep: int | None = None, add_special_tokens: bool = True,
                       param: str = "prompt") -> tuple[list[list[int]], list[str]]:  # fmt: skip
    """Every accepted prompt form -> (token ids, text) per prompt; `keep`: truncate_prompt_tokens;
    `add_special_tokens`: the tokenizer's own (a BOS) around a text prompt; `param`: the field's name (embeddings
    take the same forms as `input`)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request(f"{param} is empty", param)
    if isinstance(prompt[0], int):
        prompt = [prompt]  # type: ignore[list-item]
    ids_list: list[list[int]] = []
    texts: list[str] = []
    for p in prompt:
        whole = ctx.tokenizer.encode(p, add_special_tokens) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
        ids = ctx.check_prompt(whole, param, keep)  # ids out of range must not reach the decode below
        texts.append(p if isinstance(p, str) and ids == whole else ctx.tokenizer.decode(ids, skip_special_tokens=False))
        ids_list.append(ids)
    return ids_list, texts


def num_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request, request_id: str) -> Response:
    ctx.check_model(req.model)
    if req.suffix is not None:  # as vLLM; OpenAI's legacy insert mode needs a model trained for it
        raise bad_request("suffix is not currently supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:  # no engine ranks candidates by their logprob sum
        raise bad_request(f"best_of is not supported (best_of={req.best_of}, n={req.n}): leave it unset or equal "
                          "to n", "best_of")  # fmt: skip
    req = ctx.checked_logprobs(req, "logprobs")
    check_stream(req.prompt_logprobs, req.stream)
    check_stream_options(req)
    await ctx.admit(num_prompts(req.prompt) * req.n)
    prompts, texts = await off_loop(completion_prompts, ctx, req.prompt, req.truncate_prompt_tokens,
                                    req.add_special_tokens)  # fmt: skip
    requested = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
    max_tokens = ctx.max_tokens(max(len(p) for p in prompts), requested, "max_tokens")
    params = ctx.sampling_params(req, max_tokens, req.logprobs)
    params = with_prompt_logprobs(params, req.prompt_logprobs, req.logprobs if req.echo else None)
    params = await with_structured_output(req, params)  # response_format, guided_*: a bad one is a 400
    rid = f"cmpl-{request_id}"
    fan = await ctx.fan_out(rid, prompts, req, params)
    fmt = CompletionFormat(ctx, req, prompts, texts)
    return await respond(ctx, raw, fan, WithTokenIds(fmt, fan, chat=False) if req.return_token_ids else fmt, rid, req)
