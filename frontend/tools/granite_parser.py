"""IBM Granite 3's tool calls (--tool-call-parser granite): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`,
a JSON list of calls after the <|tool_call|> special token, as Granite's chat template asks for them and vLLM's
granite parser reads them. That is Mistral's JSON-list spelling after another tag, so the parser is Mistral's
(frontend/tools/mistral_parser.py: content before the tag, calls held until their JSON closes, a tag that leads to
no calls kept as content) with Granite's tag and OpenAI's kind of call id."""

from __future__ import annotations

from frontend.tools.mistral_parser import MistralParser
from frontend.tools.tool_parsers import call_id

TAG = "<|tool_call|>"


class GraniteParser(MistralParser):
    tag = TAG
    new_id = staticmethod(call_id)
