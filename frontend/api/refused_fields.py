"""Request fields (vLLM's, and the Responses API's) this server does not do, and whose silent omission would change
the answer: any value but null (for beam search: but false; for logprobs: but 0) is a 400 naming the field and
saying why, instead of an answer other than asked."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator


def _refused(why: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if value is not None:
            raise ValueError(why)
        return value

    return AfterValidator(check)


def _no_beam_search(use: bool) -> bool:
    if use:
        raise ValueError("beam search is not supported; sample n completions instead (n, seed, temperature)")
    return use


# A chat template is code the server would run: refused (vLLM too, unless started trusting them), never silently
# left out, which would render the messages otherwise than the client asked.
RequestTemplate = Annotated[str | None, _refused("a chat template in a request is not accepted; start the "
                                                  "server with --chat-template FILE to render with another one")]
# vLLM's prompt_embeds (with --enable-prompt-embeds) and per-request logits_processors: not built here
PromptEmbeds = Annotated[Any, _refused("prompt_embeds is not supported: send the prompt as text or token ids")]
LogitsProcessors = Annotated[Any, _refused("per-request logits_processors are not supported (logit_bias, "
                                           "allowed_token_ids and bad_words are)")]  # fmt: skip
BeamSearch = Annotated[bool, AfterValidator(_no_beam_search)]


def _refuse_logprobs(asked: bool) -> None:
    if asked:
        raise ValueError("logprobs are not served on /v1/responses; /v1/chat/completions gives them (logprobs, "
                         "top_logprobs)")


def _no_top_logprobs(value: Any) -> Any:
    _refuse_logprobs(value not in (None, 0))
    return value


def _no_logprobs_included(value: Any) -> Any:
    _refuse_logprobs(isinstance(value, list) and "message.output_text.logprobs" in value)
    return value


# /v1/responses: OpenAI's stored prompt templates, and logprobs of the output text (top_logprobs, or include's
# "message.output_text.logprobs"; the include's other values ask for nothing this server has, and are ignored)
HostedPrompt = Annotated[Any, _refused("prompt (a stored prompt template) is not supported: send instructions and "
                                       "input instead")]  # fmt: skip
TopLogprobs = Annotated[Any, AfterValidator(_no_top_logprobs)]
Include = Annotated[Any, AfterValidator(_no_logprobs_included)]
