"""Chat templates as transformers finds and compiles them: which files name which templates, and the Jinja
environment they render in (its filters, globals and tags), so a prompt matches transformers' token for token."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils


def model_templates(path: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """The model's templates by name, as transformers 5 loads them: chat_template.jinja ("default") and
    additional_chat_templates/NAME.jinja, which, when any exists, replace tokenizer_config.json's chat_template (a
    string, the default, or a list of {"name", "template"}, as Hermes-2-Pro and Command-R ship)."""
    templates: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text()
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        templates.update({f.name.removesuffix(".jinja"): f.read_text() for f in sorted(extra.glob("*.jinja"))})
    if templates:
        return templates
    value = cfg.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and isinstance(t.get("template"), str)}
    return {}


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    # Jinja's own escapes HTML; transformers' takes json.dumps' options (Kimi-K2 writes separators=(',', ':')).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %} (its AssistantTracker), which marks the assistant's text
    for training masks; rendering a prompt, it writes its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """transformers' `dict`: calls and fromkeys, none of the type's attributes (a sandbox escape route)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """transformers' `namespace`: no underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: namespace(self=...) still works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


def environment() -> jinja2.Environment:
    """The environment transformers renders chat templates in (utils/chat_template_utils.py)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env
