"""Chat templates are found, picked and rendered as transformers does: named templates (tool_use for a request
with tools), additional_chat_templates/, and transformers' Jinja environment (tojson's options, {% generation %},
its dict and namespace). transformers itself is the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from common.model_source import resolve_model
from frontend.text.tokenizer import Tokenizer, TokenizerError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo", "parameters": CITY}}]
DEFAULT = "<|im_start|>plain{% for m in messages %}\n{{ m.role }}: {{ m.content }}{% endfor %}<|im_end|>"
TOOL_USE = "<|im_start|>tools {{ tools | tojson }}{% for m in messages %}\n{{ m.content }}{% endfor %}<|im_end|>"


def model_dir(tmp: Path, config: dict, files: dict[str, str] | None = None) -> Path:
    """The default model's tokenizer.json with this tokenizer_config.json and these extra files."""
    shutil.copy(resolve_model(None).path / "tokenizer.json", tmp)
    (tmp / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", **config}))
    for name, text in (files or {}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    return tmp


def assert_renders_as_transformers(path: Path, tools: list | None) -> str:
    ours = Tokenizer(path).apply_chat_template(MESSAGES, tools=tools)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(path)).apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    return ours


def test_named_templates_take_tool_use_for_a_request_with_tools(tmp_path):
    """tokenizer_config.json's list of named templates (Hermes-2-Pro, Command-R): "tool_use" renders a request with
    tools, so the prompt holds the tool definitions; "default" renders the rest."""
    path = model_dir(tmp_path, {"chat_template": [{"name": "default", "template": DEFAULT},
                                                  {"name": "tool_use", "template": TOOL_USE}]})  # fmt: skip
    with_tools = assert_renders_as_transformers(path, TOOLS)
    assert with_tools.startswith("<|im_start|>tools ") and '"name": "get_weather"' in with_tools
    assert assert_renders_as_transformers(path, None).startswith("<|im_start|>plain")
    tok = Tokenizer(path)
    assert tok.encode_chat(MESSAGES, tools=TOOLS) == tok.encode(with_tools, add_special_tokens=False)


def test_a_list_without_tool_use_renders_tools_with_the_default(tmp_path):
    path = model_dir(tmp_path, {"chat_template": [{"name": "default", "template": DEFAULT},
                                                  {"name": "rag", "template": "rag"}]})  # fmt: skip
    assert assert_renders_as_transformers(path, TOOLS).startswith("<|im_start|>plain")


def test_template_files_replace_the_configs_templates(tmp_path):
    """chat_template.jinja is the default and additional_chat_templates/NAME.jinja the others; when they exist,
    tokenizer_config.json's templates are not read (as transformers 5 loads them)."""
    stale = [{"name": "default", "template": "stale"}, {"name": "tool_use", "template": "stale"}]
    files = {"chat_template.jinja": DEFAULT, "additional_chat_templates/tool_use.jinja": TOOL_USE}
    path = model_dir(tmp_path, {"chat_template": stale}, files)
    assert assert_renders_as_transformers(path, TOOLS).startswith("<|im_start|>tools ")
    assert assert_renders_as_transformers(path, None).startswith("<|im_start|>plain")


def test_chat_template_flag_serves_requests_with_tools_too(tmp_path):
    path = model_dir(tmp_path, {"chat_template": [{"name": "default", "template": DEFAULT},
                                                  {"name": "tool_use", "template": TOOL_USE}]})  # fmt: skip
    (tmp_path / "mine.jinja").write_text("mine{{ tools | length }}")
    assert Tokenizer(path, chat_template=str(tmp_path / "mine.jinja")).apply_chat_template(MESSAGES, tools=TOOLS) == (
        "mine1")  # fmt: skip


# What transformers' environment gives templates beyond plain Jinja: tojson's json.dumps options (Kimi-K2 writes
# separators=(',', ':')), the {% generation %} tag of training templates, loop controls, its dict and namespace.
ENVIRONMENT = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m.role == 'system' %}{% continue %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
{% generation %}[{{ m.content }}]{% endgeneration %}
{%- endfor -%}
{{ tools | tojson(separators=(',', ':')) }}|{{ tools | tojson(ensure_ascii=True, sort_keys=True) }}|
{{- tools[0] | tojson(indent=2) }}|{{ dict(a=ns.n) | tojson }}|{{ dict.fromkeys(['x']) | tojson }}"""


def test_environment_renders_as_transformers(tmp_path):
    path = model_dir(tmp_path, {"chat_template": ENVIRONMENT})
    text = assert_renders_as_transformers(path, TOOLS)
    assert '[{"type":"function","function":{"name":"get_weather"' in text and "M\\u00e9t\\u00e9o" in text
    assert text.startswith("[Weather in Paris?]")


@pytest.mark.parametrize("template", ["{% set ns = namespace(_x=1) %}",
                                      "{% set ns = namespace() %}{% set ns._x = 1 %}"])  # fmt: skip
def test_sandbox_refuses_what_transformers_refuses(tmp_path, template):
    path = model_dir(tmp_path, {"chat_template": template + "x"})
    try:
        refused_by_them = not PreTrainedTokenizerFast.from_pretrained(str(path)).apply_chat_template(
            MESSAGES, tokenize=False).startswith("x")  # fmt: skip
    except Exception:
        refused_by_them = True
    try:
        refused_by_us = not Tokenizer(path).apply_chat_template(MESSAGES).startswith("x")
    except TokenizerError:
        refused_by_us = True
    assert refused_by_them and refused_by_us
