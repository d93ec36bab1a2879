"""POST /v1/responses request schema (OpenAI's Responses API) and its translation into a chat completions request,
so that the chat path renders, admits, constrains and parses it. Only what that path can do is accepted: a field or
item it cannot serve is a 400 naming it, never silently dropped. (Reasoning items are taken and left out of the
prompt, as thinking models' templates leave earlier thinking out.)"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from frontend.api.protocol import (
    MAX_TOOLS,
    SEED_BOUNDS,
    ApiModel,
    CacheSalt,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Text,
    ToolCall,
    ToolDefinition,
)
from frontend.api.refused_fields import HostedPrompt, Include, TopLogprobs
from frontend.api.sampling_defaults import SamplingDefaults
from frontend.errors import ApiError, bad_request, from_validation_errors

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")
MAX_METADATA = 16  # OpenAI's bounds on metadata: pairs, key and value lengths
MetadataKey = Annotated[Text, Field(max_length=64)]
MetadataValue = Annotated[Text, Field(max_length=512)]


def _type_of(value: dict[str, Any], default: str | None) -> Any:
    """An object's `type`; absent or null, the default (a message item may leave it out)."""
    kind = value.get("type")
    return default if kind is None else kind


def one_of(supported: tuple[str, ...], what: str, default: str | None = None) -> BeforeValidator:
    """A 400 that names an unsupported type (an image part, a web_search tool) instead of pydantic's union noise."""

    def check(value: Any) -> Any:
        if not isinstance(value, dict):
            raise PydanticCustomError("not_an_object", "{what} are objects, not a {kind}",
                                      {"what": what, "kind": type(value).__name__})  # fmt: skip
        if _type_of(value, default) not in supported:
            raise PydanticCustomError("unsupported_kind", "{what} of type {kind} are not supported (only {ok})",
                                      {"what": what, "kind": repr(_type_of(value, default))[:80],
                                       "ok": ", ".join(supported)})  # fmt: skip
        return value

    return BeforeValidator(check)


class TextPart(ApiModel):
    type: Literal["input_text", "output_text"]
    text: Text


Content = Text | list[Annotated[TextPart, one_of(PART_TYPES, "content parts")]]


def _text(content: Content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(ApiModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


class FunctionCallItem(ApiModel):
    """A call the model made earlier (the client sends the conversation back whole)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class FunctionCallOutputItem(ApiModel):
    type: Literal["function_call_output"]
    call_id: Text
    output: Content


class ReasoningItem(ApiModel):
    """The model's reasoning in an earlier turn, as --reasoning-parser returned it (a client sends the output back
    whole). It stays out of the prompt: thinking models' templates leave earlier turns' thinking out too."""

    type: Literal["reasoning"]


def _item_tag(item: Any) -> str | None:
    return _type_of(item, "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_tag), one_of(ITEM_TYPES, "input items", "message"),
]  # fmt: skip


class FunctionTool(FunctionDefinition):
    """The Responses API's flat function tool: chat's function definition (its fields and their checks) with the
    tool's `type` beside them, where chat nests the definition under `function`."""

    type: Literal["function"]


class FunctionChoice(ApiModel):
    type: Literal["function"]
    name: Text


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")]
    | Annotated[FunctionChoice, one_of(("function",), "tool_choice objects"), Tag("function")],
    Discriminator(lambda v: "mode" if isinstance(v, str) else "function"),
]  # fmt: skip


class TextFormat(ApiModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = Field(None, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(ApiModel):
    format: TextFormat | None = None


class ConversationRef(ApiModel):
    id: Text


class ResponsesRequest(ApiModel):
    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None  # a system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, **SEED_BOUNDS)
    tools: list[Annotated[FunctionTool, one_of(("function",), "tools")]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=MAX_METADATA)
    user: Text | None = None
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)  # vLLM's, as on chat (--scheduling-policy priority)
    cache_salt: CacheSalt | None = None  # vLLM's, as on chat
    store: bool = True  # kept for previous_response_id and GET (responses_store.py) unless --responses-store-mib 0
    previous_response_id: Text | None = None  # continue that stored response: its conversation comes before input
    background: bool = False  # answered at once, in_progress; the client polls GET (needs store)
    conversation: Text | ConversationRef | None = None  # its items come before input; input and output join them
    truncation: Literal["auto", "disabled"] = "disabled"  # auto: the oldest items dropped where the context is short
    prompt: HostedPrompt = None  # refused, and so are logprobs:
    top_logprobs: TopLogprobs = None
    include: Include = None

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    def echo(self, d: SamplingDefaults, stored: bool) -> dict[str, Any]:
        """The request's settings as OpenAI echoes them in the response object (`d`: the server's defaults;
        `stored`: whether the response is kept)."""
        choice = self.tool_choice
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": d.temperature if self.temperature is None else self.temperature,
                "top_p": d.top_p if self.top_p is None else self.top_p,
                "tools": [t.model_dump() for t in self.tools or []],
                "tool_choice": "auto" if choice is None else choice if isinstance(choice, str) else choice.model_dump(),
                "parallel_tool_calls": self.parallel_tool_calls,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
                "metadata": self.metadata or {}, "user": self.user, "store": stored,
                "previous_response_id": self.previous_response_id,
                "reasoning": None, "truncation": self.truncation, "background": self.background,
                "conversation": {"id": self.conversation_id} if self.conversation is not None else None}  # fmt: skip


def refuse_state(req: ResponsesRequest, keeps_responses: bool) -> None:
    """400s for the server-side state a request cannot have here (with --responses-store-mib 0, none is kept)."""
    if req.previous_response_id is not None and not keeps_responses:
        raise bad_request("previous_response_id is not supported: this server keeps no responses "
                          "(--responses-store-mib 0); send the whole conversation as input instead",
                          "previous_response_id", "unsupported_parameter")  # fmt: skip
    if req.conversation is not None and req.previous_response_id is not None:
        raise bad_request("give conversation or previous_response_id, not both", "conversation")
    if req.background and not (req.store and keeps_responses):
        raise bad_request("background responses need store true (and a server that keeps responses) to be polled",
                          "background", "unsupported_parameter")  # fmt: skip


def own_items(req: ResponsesRequest) -> list[InputItem]:
    """The request's input as items (a string is one user message)."""
    return [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else list(req.input)


def item_dumps(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as stored responses and conversations keep and list them: message text as content parts."""
    out = []
    for item in items:
        dumped = item.model_dump()
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            dumped["content"] = [{"type": kind, "text": item.content}]
        out.append(dumped)
    return out


STORED_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


def turn_items(req: ResponsesRequest, history: list[dict[str, Any]]) -> list[InputItem]:
    """The items a response is made from: those it continues (a stored chain's or a conversation's, as stored;
    a continued response's instructions are not carried over, as OpenAI's are not), then its own input."""
    return [*STORED_ITEMS.validate_python(history), *own_items(req)]


def _messages(req: ResponsesRequest, items: list[InputItem]) -> list[ChatMessage]:
    """instructions first, then the items; a function_call item joins the assistant message just before it (the
    text and the calls of one turn), as chat spells a turn's parallel calls."""
    out = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    for item in items:
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant" and len(out[-1].tool_calls or []) < MAX_TOOLS:
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output)))
    if not out:
        raise bad_request("input is empty", "input")
    return out


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise bad_request("text.format of type json_schema needs a schema", "text")
    spec = JsonSchemaFormat.model_validate({"name": fmt.name or "response", "description": fmt.description,
                                            "schema": fmt.schema_, "strict": fmt.strict})  # fmt: skip
    return ResponseFormat(type="json_schema", json_schema=spec)


def chat_request(req: ResponsesRequest, items: list[InputItem]) -> ChatCompletionRequest:
    """The chat completions request that does what `req` asks with these items (400s for what it cannot)."""
    choice = req.tool_choice
    named = NamedToolChoice(type="function", function=NamedFunction(name=choice.name)) \
        if isinstance(choice, FunctionChoice) else choice  # fmt: skip
    tools = [ToolDefinition(type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"})))
             for t in req.tools or []]
    try:
        return ChatCompletionRequest.model_validate({
            "model": req.model, "messages": _messages(req, items), "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "user": req.user,
            "stream": req.stream, "tools": tools or None, "tool_choice": named, "priority": req.priority,
            "cache_salt": req.cache_salt,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text)})  # fmt: skip
    except ValidationError as exc:  # every field was checked above with chat's own bounds; a safety net
        raise from_validation_errors(list(exc.errors())) from None


# chat's parameter -> (the Responses parameter, how its messages name it)
CHAT_PARAMS = {"messages": ("input", "input"), "max_completion_tokens": ("max_output_tokens", "max_output_tokens"),
               "response_format": ("text", "text.format")}  # fmt: skip


def in_responses_terms(error: ApiError) -> ApiError:
    """A 400 from the chat path, with the parameter named as the Responses request names it."""
    if error.param in CHAT_PARAMS:
        error.message = error.message.replace(error.param, CHAT_PARAMS[error.param][1])
        error.param = CHAT_PARAMS[error.param][0]
    return error
