"""POST /v1/messages request schema (Anthropic's Messages API, what Claude Code and Anthropic's SDKs call) and its
translation into a chat completions request, so that the chat path renders, admits, constrains and parses it, as
/v1/responses does. What that path cannot serve (images, documents, server tools) is a 400 naming it. Thinking blocks
sent back are taken and left out of the prompt, as thinking models' templates leave earlier thinking out."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, ValidationError

from frontend.api.protocol import (
    MAX_STOP,
    MAX_TOOLS,
    ApiModel,
    CacheSalt,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    NamedFunction,
    NamedToolChoice,
    StopText,
    TemplateKwargs,
    Text,
    ToolCall,
)
from frontend.api.protocol_responses import one_of
from frontend.errors import ApiError, bad_request, from_validation_errors

BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class TextBlock(ApiModel):
    type: Literal["text"]
    text: Text


class ToolUseBlock(ApiModel):
    """A call the model made earlier (the client sends the conversation back whole)."""

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


class ToolResultBlock(ApiModel):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[Annotated[TextBlock, one_of(("text",), "tool_result content blocks")]] = ""
    is_error: bool = False


class ThinkingBlock(ApiModel):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(lambda b: "thinking" if _kind(b) == "redacted_thinking" else _kind(b)),
    one_of(BLOCK_TYPES, "content blocks"),
]  # fmt: skip


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, dict) else getattr(block, "type", None)


def _role(value: Any) -> Any:
    """Claude Code (2.1.154 and later) also sends roles "ctx" and "msg", both user turns (as vLLM reads them)."""
    return "user" if value in ("ctx", "msg") else value


class Message(ApiModel):
    role: Annotated[Literal["user", "assistant"], BeforeValidator(_role)]
    content: Text | list[Block]


class Tool(ApiModel):
    """A client tool; Anthropic's server tools (web search, code execution) have a `type` and are refused."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    input_schema: dict[str, Any] | None = None  # required of a client tool (chat_request says so)
    type: Text | None = None  # "custom"; another type is a server tool, refused by name in chat_request


class ToolChoice(ApiModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool = False


class Thinking(ApiModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class OutputFormat(ApiModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(ApiModel):
    format: OutputFormat | None = None  # the answer's JSON schema: the structured outputs of chat's response_format
    effort: Text | None = None  # taken, and left to the model: no effort setting here


class Metadata(ApiModel):
    user_id: Text | None = None


class MessagesRequest(ApiModel):
    model: Text
    max_tokens: int = Field(ge=1)
    messages: list[Message]
    system: Text | list[Annotated[TextBlock, one_of(("text",), "system blocks")]] | None = None
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None  # enabled or not: the chat template's enable_thinking (Qwen3's, SmolLM3's)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # vLLM's, as on chat
    chat_template_kwargs: TemplateKwargs | None = None
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    cache_salt: CacheSalt | None = None


class CountTokensRequest(ApiModel):
    model: Text
    messages: list[Message]
    system: Text | list[Annotated[TextBlock, one_of(("text",), "system blocks")]] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: TemplateKwargs | None = None

    def as_messages_request(self) -> MessagesRequest:
        return MessagesRequest(**self.model_dump(exclude_none=True), max_tokens=1)


def _text(content: Text | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _messages(req: MessagesRequest) -> list[ChatMessage]:
    """system first; a user message's tool results become tool messages before its text, an assistant message's
    tool_use blocks its tool calls, as chat spells them."""
    out = [ChatMessage(role="system", content=_text(req.system))] if req.system else []
    for message in req.messages:
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if message.role == "assistant":
            calls = [ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                     for b in blocks if isinstance(b, ToolUseBlock)]  # fmt: skip
            out.append(ChatMessage(role="assistant", content=text, tool_calls=calls or None))
            continue
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                result = _text(b.content)
                out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                       content=f"Error: {result}" if b.is_error else result))  # fmt: skip
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append(ChatMessage(role="user", content=text))
    if not req.messages:
        raise bad_request("messages is empty", "messages")
    return out


def _tool_choice(choice: ToolChoice | None) -> str | NamedToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("tool_choice of type tool needs the tool's name", "tool_choice")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completions request that does what `req` asks (400s for what it cannot)."""
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise bad_request(f"tools of type {tool.type!r} (server tools) are not supported", "tools")
        if tool.input_schema is None:
            raise bad_request(f"tools.{i}.input_schema: Field required", "tools", "missing_required_parameter")
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.input_schema}} for t in req.tools or []]  # fmt: skip
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        kwargs.setdefault("enable_thinking", req.thinking.type != "disabled")
    parallel = not (req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use)
    fmt = req.output_config.format if req.output_config is not None else None
    response_format = None if fmt is None else {"type": "json_schema", "json_schema": {"name": "output",
                                                "schema": fmt.schema_, "strict": True}}  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate({
            "model": req.model, "messages": _messages(req), "max_completion_tokens": req.max_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences,
            "stream": req.stream, "tools": tools or None, "tool_choice": _tool_choice(req.tool_choice),
            "parallel_tool_calls": parallel, "chat_template_kwargs": kwargs or None, "priority": req.priority,
            "cache_salt": req.cache_salt, "user": req.metadata.user_id if req.metadata else None,
            "response_format": response_format})  # fmt: skip
    except ValidationError as exc:  # every field was checked with chat's own bounds; a safety net
        raise from_validation_errors(list(exc.errors())) from None


# chat's parameter -> the Messages API's
CHAT_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config"}


def in_messages_terms(error: ApiError) -> ApiError:
    """A 400 from the chat path, with the parameter named as the Messages request names it."""
    if error.param in CHAT_PARAMS:
        error.message = error.message.replace(error.param, CHAT_PARAMS[error.param])
        error.param = CHAT_PARAMS[error.param]
    return error
