"""Text <-> token ids and chat templates in the API process, with `tokenizers` + jinja2 (transformers imports torch)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(RuntimeError):
    pass


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens either as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = Path(model_dir)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path} has no tokenizer.json (the API server needs a fast tokenizer)")
        self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.special_tokens = {
            k: text for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (text := _token_text(cfg.get(k)))
        }
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        # The same environment transformers renders chat templates in, so prompts match token for token.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(template) if template else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        """One token's text for logprobs (may be a partial UTF-8 character, shown as U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise TokenizerError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except jinja2.TemplateError as exc:  # the template rejected the conversation (e.g. role order)
            raise TokenizerError(f"chat template: {exc}") from exc
