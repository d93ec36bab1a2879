"""Tool calling, request side: tools and tool_choice checked, the tools the chat template sees, and the JSON schema
that enforces tool_choice "required" or a named function through constrained decoding (any model, any template)."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from common.json_schema_check import MAX_SCHEMA_DEPTH, subschemas
from common.messages import StructuredOutput
from common.structured import ANY_OBJECT_SCHEMA
from frontend.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolDefinition,
)
from frontend.errors import bad_request
from frontend.tools.functiongemma_parser import STOP as FUNCTIONGEMMA_STOP
from frontend.tools.functiongemma_parser import FunctionGemmaParser
from frontend.tools.granite_parser import GraniteParser
from frontend.tools.mistral_parser import MistralParser
from frontend.tools.pythonic_parser import PythonicParser
from frontend.tools.qwen3_coder_parser import Qwen3CoderParser
from frontend.tools.tool_forced import ForcedCallsParser, NamedCallParser
from frontend.tools.tool_parsers import CLOSE, OPEN, HermesParser, Llama3JsonParser, ToolParser

# --tool-call-parser NAME -> the parser's class, called with max_calls
PARSERS: dict[str, Callable[[int | None], ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                                          "pythonic": PythonicParser, "mistral": MistralParser,
                                                          "functiongemma": FunctionGemmaParser,
                                                          "granite": GraniteParser,
                                                          "qwen3_coder": Qwen3CoderParser}  # fmt: skip
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: no parameters is a function without arguments

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does with its tools."""

    mode: Mode
    template_tools: list[dict[str, Any]] | None  # what the chat template receives (None: no tools in the prompt)
    structured: StructuredOutput | None = None  # "required" / "named": the output is held to this schema
    named: str | None = None  # the function a named tool_choice forces
    parser: str | None = None  # "auto": the model's own format, parsed when the server has a parser
    parallel: bool = True  # "auto": False keeps only the model's first call, as OpenAI answers

    @property
    def keeps_special_tokens(self) -> bool:
        """Mistral's, FunctionGemma's and Granite's tags are special tokens: their parsers read them only where the
        text keeps them (as in vLLM)."""
        return self.mode == "auto" and self.parser in ("mistral", "functiongemma", "granite")

    @property
    def stop(self) -> list[str]:
        """Stop strings the format needs: FunctionGemma goes on after its calls with the function's answer."""
        return [FUNCTIONGEMMA_STOP] if self.mode == "auto" and self.parser == "functiongemma" else []

    def make_parser(self) -> Callable[[], ToolParser] | None:
        """A factory for one choice's parser, or None when the output is plain content."""
        if self.mode == "named":
            name = self.named or ""
            return lambda: NamedCallParser(name)
        if self.mode == "required":
            return ForcedCallsParser
        if self.mode == "auto" and self.parser is not None:
            parser, max_calls = PARSERS[self.parser], None if self.parallel else 1
            if parser is Qwen3CoderParser:  # its values are written bare: each is typed by its parameter's schema
                schemas = {t["function"]["name"]: t["function"]["parameters"] for t in self.template_tools or []}
                return lambda: Qwen3CoderParser(max_calls, schemas)
            return lambda: parser(max_calls)
        return None


def _check_json(value: Any, where: str) -> None:
    """User JSON that goes into prompts, schemas and the engine: bounded depth, finite numbers, valid text."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise bad_request(f"{where} is nested deeper than {MAX_SCHEMA_DEPTH} levels", "tools")
        if isinstance(node, float) and not math.isfinite(node):
            raise bad_request(f"{where} holds a number that is not finite", "tools")
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            texts = [key, child] if isinstance(key, str) else [child]
            for text in texts:
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        raise bad_request(f"{where} holds text that is not valid Unicode", "tools") from None
            stack.append((child, depth + 1))


def _parameters(fn: FunctionDefinition) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else _EMPTY_PARAMETERS


def check_tools(tools: list[ToolDefinition]) -> None:
    """Unique names; parameters a valid JSON schema (draft 2020-12) of an object."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        where = f"tools[{i}].function.parameters"
        if fn.name in seen:
            raise bad_request(f"tools: the function name {fn.name!r} is defined twice", "tools")
        seen.add(fn.name)
        if fn.parameters is None:
            continue
        _check_json(fn.parameters, where)
        if fn.parameters.get("type", "object") != "object":
            raise bad_request(f"{where} must describe an object (\"type\": \"object\")", "tools")
        try:
            jsonschema.Draft202012Validator.check_schema(fn.parameters)
        except jsonschema.SchemaError as exc:
            path = "".join(f"[{p!r}]" for p in exc.path)
            raise bad_request(f"{where} is not a valid JSON schema: {exc.message} (at {path or 'the top'})",
                              "tools") from None  # fmt: skip
        except RecursionError:
            raise bad_request(f"{where} is too deeply nested", "tools") from None


def check_messages(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if (m.tool_calls or m.function_call) and m.role != "assistant":
            raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls or a function_call",
                              "messages")  # fmt: skip
        if m.role == "tool" and m.tool_call_id is None:
            raise bad_request(f"messages[{i}]: a tool message needs the tool_call_id it answers", "messages")
        if m.role == "function" and m.name is None:
            raise bad_request(f"messages[{i}]: a function message needs the name of the function it answers",
                              "messages")  # fmt: skip


def functions_as_tools(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """OpenAI's deprecated `functions` and `function_call` as the tools and tool_choice they became, with one call
    at most (the legacy answer holds one function_call)."""
    if req.functions is None:
        if req.function_call is not None:
            raise bad_request("function_call is only allowed when functions are given", "function_call")
        return req
    if req.tools is not None or req.tool_choice is not None:
        raise bad_request("give either functions and function_call (deprecated) or tools and tool_choice, not both",
                          "functions")  # fmt: skip
    choice = req.function_call
    if isinstance(choice, NamedFunction) and all(f.name != choice.name for f in req.functions):
        raise bad_request(f"function_call names {choice.name!r}, which is not among the functions", "function_call")
    named = NamedToolChoice(type="function", function=choice) if isinstance(choice, NamedFunction) else choice
    tools = [ToolDefinition(type="function", function=f) for f in req.functions]
    return req.model_copy(update={"tools": tools, "tool_choice": named, "parallel_tool_calls": False})


def _moved(parameters: dict[str, Any], at: str) -> dict[str, Any]:
    """A tool's parameters to live at `at` (a JSON pointer) inside a larger schema: every local $ref ("#" itself,
    "#/properties/home" as zod writes them, "#/$defs/X") still points into the tool's own schema."""
    parameters = copy.deepcopy(parameters)
    parameters.pop("$id", None)  # a new base URI would make jsonschema resolve the refs below against it
    for _, node in subschemas(parameters):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = f"#{at}{ref[1:]}"
    return parameters


def call_schema(tools: list[ToolDefinition]) -> dict[str, Any]:
    """One call: {"name": one tool's name, "arguments": that tool's parameters}. Each tool's parameters go whole
    under $defs, so that their own refs resolve as they did at their root."""
    alternatives, defs = [], {}
    for i, tool in enumerate(tools):
        defs[f"tool{i}"] = _moved(_parameters(tool.function), f"/$defs/tool{i}")
        name, arguments = {"type": "string", "const": tool.function.name}, {"$ref": f"#/$defs/tool{i}"}
        alternatives.append({"type": "object", "properties": {"name": name, "arguments": arguments},
                             "required": ["name", "arguments"]})  # fmt: skip
    return {"anyOf": alternatives, "$defs": defs}


def required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """An array of calls, at least one (exactly one without parallel_tool_calls)."""
    call = call_schema(tools)
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": call["anyOf"]}, "minItems": 1, "$defs": call["$defs"]}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_or_output(plan: ToolPlan, tools: list[ToolDefinition], output: StructuredOutput | None
                    ) -> StructuredOutput | None:  # fmt: skip
    """tool_choice auto with a JSON output format (OpenAI Agents SDK: tools and an output_type): the format alone
    would hold the whole answer to its JSON, so the model could never call a tool. With the hermes parser the
    answer may instead be the model's tagged calls; None where this does not apply (the format stays)."""
    if plan.mode != "auto" or plan.parser != "hermes" or output is None:
        return None
    if output.kind not in ("json_schema", "json_object"):
        return None
    schema = json.loads(output.spec) if output.kind == "json_schema" else json.loads(ANY_OBJECT_SCHEMA)
    spec = {"schema": schema, "calls": call_schema(tools), "begin": OPEN + "\n", "end": "\n" + CLOSE,
            "separator": "\n", "parallel": plan.parallel}  # fmt: skip
    return StructuredOutput("json_or_calls", json.dumps(spec))


def _template_tool(tool: ToolDefinition) -> dict[str, Any]:
    """The shape HF chat templates read (they write it with tojson): what the client sent, without nulls."""
    fn = tool.function
    out: dict[str, Any] = {"name": fn.name}
    if fn.description is not None:
        out["description"] = fn.description
    out["parameters"] = _parameters(fn)
    return {"type": "function", "function": out}


def plan_tools(req: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """Checks the request's tools, tool_choice and tool messages (400 on any fault) and says what to do."""
    check_messages(req.messages)
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice is not None:
            raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
        return ToolPlan("none", None)
    check_tools(tools)
    if choice == "none":  # the model is told of no tools, so it writes no calls of its own format either
        return ToolPlan("none", None)
    template_tools = [_template_tool(t) for t in tools]
    if choice is None or choice == "auto":
        return ToolPlan("auto", template_tools, parser=parser, parallel=req.parallel_tool_calls)
    if choice == "required":
        schema = required_schema(tools, req.parallel_tool_calls)
        return ToolPlan("required", template_tools, StructuredOutput("json_schema", json.dumps(schema)))
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    spec = json.dumps(_parameters(tool.function))
    return ToolPlan("named", template_tools, StructuredOutput("json_schema", spec), named=name)
