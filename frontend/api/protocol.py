"""OpenAI request schemas (pydantic; violations become 400s) and their translation into SamplingParams."""

from __future__ import annotations

import json
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from common.messages import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_TOP_K, SamplingParams
from frontend.api.refused_fields import BeamSearch, LogitsProcessors, PromptEmbeds, RequestTemplate
from frontend.tools.tool_parsers import no_constant

if TYPE_CHECKING:  # sampling_defaults checks its values with SamplingFields' own bounds
    from frontend.api.sampling_defaults import SamplingDefaults

MAX_N = 64  # choices per request: each is an engine request
MAX_STOP = 16  # stop strings (checked every token) and stop token ids
MAX_STOP_CHARS = 4096  # per stop string: the matcher's tables are built per request
MAX_TOOLS = 128  # tool definitions per request, as OpenAI
MAX_ALLOWED_TOKENS = 1 << 18  # allowed_token_ids: more than any vocabulary we serve
MAX_CHOICES = 1024  # guided_choice strings
MIN_TOP_P = 1e-6  # any smaller keeps only the top token too; subnormals would read as 0 in the engine (flush-to-zero)
SEED_BOUNDS = {"ge": -(2**63), "le": 2**63 - 1}  # what the wire (msgpack int64) carries
MAX_CACHE_SALT = 256  # characters of a cache_salt
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions with max_tokens absent or null, as OpenAI and vLLM


def _valid_text(text: str) -> str:
    """JSON can spell lone UTF-16 surrogates ("\\ud800"); they are not text and no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text (a lone surrogate at position {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_text)]
# vLLM's chat_template_kwargs: extra variables for the chat template (e.g. Qwen3's enable_thinking), shallow JSON.
TemplateScalar = Text | bool | int | float | None
TemplateKwargs = Annotated[dict[Text, TemplateScalar | list[TemplateScalar] | dict[Text, TemplateScalar]],
                           Field(max_length=64)]  # fmt: skip
StopText = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]
# vLLM's: the prefix cache holds this request's blocks apart from those of requests without the same salt, so that
# another user cannot learn from a cache hit's speed what was asked (a secret per tenant, e.g. 256 random bits).
CacheSalt = Annotated[Text, Field(min_length=1, max_length=MAX_CACHE_SALT)]
# OpenAI: token id (a JSON key, so a string) -> bias added to its logit before sampling.
LogitBias = Annotated[dict[int, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)]


class ApiModel(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do; Infinity and NaN are refused everywhere.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI types its optional fields "X or null" and its clients send null for an option left unset: an
        explicit null means the field's default, as leaving it out does. A required field's null stays an error."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            keys = _defaulted_keys(cls)
            data = {k: v for k, v in data.items() if v is not None or k not in keys}
        return data


@cache
def _defaulted_keys(cls: type[ApiModel]) -> frozenset[str]:
    """The names (as the JSON spells them) of the fields of `cls` that have a default other than None."""
    return frozenset(f.alias or name for name, f in cls.model_fields.items()
                     if not f.is_required() and f.get_default(call_default_factory=True) is not None)  # fmt: skip


class StreamOptions(ApiModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (with include_usage)


class SamplingFields(ApiModel):
    """Fields shared by /v1/completions, /v1/chat/completions and /generate (vLLM's extensions included)."""

    model: Text | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    logits_processors: LogitsProcessors = None  # vLLM's: refused
    use_beam_search: BeamSearch = False  # vLLM's: refused
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, **SEED_BOUNDS)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=0.01, le=2)  # 1 is off; a tiny divisor makes logits inf
    logit_bias: LogitBias | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKENS)  # vLLM's
    bad_words: list[Annotated[Text, Field(max_length=256)]] | None = Field(None, max_length=MAX_BAD_WORDS)  # vLLM's
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: Text | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's: under --scheduling-policy priority, lower values are served first and preempted last
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    # vLLM's: only the prompt's last k tokens are kept (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    cache_salt: CacheSalt | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: every chunk carries its choice's usage so far (only with include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int, logprobs: int | None, d: SamplingDefaults) -> SamplingParams:
        """The request's settings; `d` (the server's --generation-config) fills those it leaves out."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=max(d.top_p if self.top_p is None else self.top_p, MIN_TOP_P),
            top_k=d.top_k if self.top_k is None else max(self.top_k, 0),
            min_p=d.min_p if self.min_p is None else self.min_p,
            seed=self.seed,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=d.repetition_penalty if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            logit_bias=dict(self.logit_bias or {}),
            allowed_token_ids=sorted(set(self.allowed_token_ids or [])),  # a mask (vLLM's too): repeats are one
        )


class JsonSchemaFormat(ApiModel):
    name: Text = Field("response", max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(ApiModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(ApiModel):
    """vLLM's `structured_outputs` object: one of these."""

    json_: dict[str, Any] | bool | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, max_length=MAX_CHOICES)
    grammar: Text | None = None
    json_object: bool | None = None


class StructuredFields(ApiModel):
    """Constrained decoding (frontend/api/structured_request.py): OpenAI's response_format, vLLM's guided_* and
    structured_outputs. At most one may be given; texts are bounded by common/structured.py's MAX_SPEC_CHARS."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, max_length=MAX_CHOICES)
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputsParams | None = None


class CompletionRequest(SamplingFields, StructuredFields):
    prompt_embeds: PromptEmbeds = None  # vLLM's: refused (first, so that its error is the one given without prompt)
    prompt: Text | list[Text] | list[int] | list[list[int]]
    # null: the default, not "the whole context"; 0 scores the prompt (echo + logprobs) and generates nothing
    max_tokens: int | None = Field(DEFAULT_COMPLETION_TOKENS, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM's), within --max-logprobs
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:{id}" (None: the server's)
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids beside the text
    prompt_logprobs: int | None = Field(None, ge=-1)  # vLLM's extension; -1 as above
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own special tokens (a BOS) around a text prompt
    suffix: Text | None = None  # not supported: a 400 when given, as vLLM
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # supported only as n (no ranking of candidates), as vLLM V1


class TextPart(ApiModel):
    type: Literal["text"]
    text: Text


class FunctionCall(ApiModel):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(ApiModel):
    """A call the assistant made earlier in the conversation."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        """HF chat templates expect the arguments as an object (they write it with tojson)."""
        arguments: Any = self.function.arguments
        try:  # only a clean object: no NaN, no lone surrogates spelled as escapes, no nesting past recursion
            parsed = json.loads(arguments, parse_constant=no_constant)
            json.dumps(parsed, ensure_ascii=False).encode()
            arguments = parsed if isinstance(parsed, dict) else arguments
        except (ValueError, RecursionError):
            pass
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(ApiModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # "function": legacy tool results
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant messages only
    tool_call_id: Text | None = None  # tool messages: the call this answers
    function_call: FunctionCall | None = None  # assistant messages only: the legacy form of one tool call

    def template_dict(self) -> dict[str, Any]:
        """What chat templates expect: string content (null content, as beside tool calls, is ""); OpenAI's newer
        "developer" role is a system prompt; tool calls and tool results in the shape HF templates read (the legacy
        function call and function result as a tool call and a tool result)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        out: dict[str, Any] = {"role": role, "content": content}
        if self.function_call is not None:
            out["tool_calls"] = [ToolCall(id="call_0", function=self.function_call).template_dict()]
        if self.tool_calls:
            out["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.role == "function":
            out["name"] = self.name
        return out


class FunctionDefinition(ApiModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; checked in frontend/tools/tool_calls.py
    strict: bool | None = None


class ToolDefinition(ApiModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(ApiModel):
    name: Text


class NamedToolChoice(ApiModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, StructuredFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM's), within --max-logprobs
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:{id}" (None: the server's)
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids beside the text
    prompt_logprobs: int | None = Field(None, ge=-1)  # vLLM's extension; -1 as above
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the final message is left open for the model to continue
    add_special_tokens: bool = False  # vLLM's: the tokenizer's own (a BOS) around the rendered template too
    echo: bool = False  # vLLM's: a final assistant message's content leads the answer (with continue_final_message)
    chat_template: RequestTemplate = None  # vLLM's: refused
    chat_template_kwargs: TemplateKwargs | None = None
    documents: list[dict[Text, Text]] | None = Field(None, max_length=MAX_TOOLS)  # vLLM's: RAG templates' `documents`
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated forms of tools and tool_choice: at most one call, answered as message.function_call
    functions: list[FunctionDefinition] | None = Field(None, max_length=MAX_TOOLS)
    function_call: Literal["none", "auto"] | NamedFunction | None = None
