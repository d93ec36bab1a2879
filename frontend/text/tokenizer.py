"""Text <-> token ids and chat templates in the API process, with `tokenizers` + jinja2 (transformers imports torch)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as _HFTokenizer

from frontend.text.chat_template import environment, model_templates
from frontend.text.token_bytes import joined_bytes_table, token_bytes_table


class TokenizerError(RuntimeError):
    pass


class TemplateKwargsError(TokenizerError):
    """chat_template_kwargs that would replace a variable the server sets."""


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens either as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """`value` with `fn` applied to every string inside it, dict keys too (a tool schema's property names are the
    user's text; `fn` changes only strings that hold special-token text, which no field name a template reads does)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """transformers' continue_final_message: `text` cut right after the final message's content (its trailing
    whitespace too where the template kept it), so the model goes on with that message."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or final.strip() not in text:
        raise TokenizerError("continue_final_message: the final message does not appear in the chat after applying "
                             "the chat template")  # fmt: skip
    at = text.rindex(final.strip())
    kept = final.lstrip() if text[at : at + len(final.lstrip())] == final else final.strip()
    return text[: at + len(kept)]


class Tokenizer:
    """`parse_special_in_content`: read special-token text inside chat messages as control tokens, as the rendered
    prompt string would be; unsafe (a user message can close its turn and open a system one), so off by default."""

    def __init__(self, model_dir: Path, parse_special_in_content: bool = False,
                 chat_template: str | None = None) -> None:  # fmt: skip
        path = Path(model_dir)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path} has no tokenizer.json (the API server needs a fast tokenizer)")
        tokenizer_text = (path / "tokenizer.json").read_text()  # read once: two instances and the bytes table
        self._tok = _HFTokenizer.from_str(tokenizer_text)
        self.parse_special_in_content = parse_special_in_content
        # Encodes special-token text as plain text. A second instance, not a flag toggled on the shared one:
        # encodes run in worker threads at the same time.
        self._text_tok = _HFTokenizer.from_str(tokenizer_text)
        self._text_tok.encode_special_tokens = True
        specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values() if t.special), key=len)
        self._special_re = re.compile("|".join(map(re.escape, reversed(specials)))) if specials else None
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.special_tokens = {
            k: text for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (text := _token_text(cfg.get(k)))
        }
        templates = model_templates(path, cfg)
        if chat_template is not None:  # --chat-template: a Jinja file instead of the model's own, with tools too
            try:
                templates = {"default": Path(chat_template).read_text()}
            except OSError as exc:
                raise TokenizerError(f"--chat-template: cannot read {chat_template}: {exc}") from exc
        env = environment()  # transformers', so prompts match token for token
        try:
            compiled = {name: env.from_string(text) for name, text in templates.items()}
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"chat template: line {exc.lineno}: {exc.message}") from exc
        # As transformers picks among named templates: "tool_use" for a request with tools, where there is one.
        self._template = compiled.get("default")
        self._tool_template = compiled.get("tool_use")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        tokenizer_json = json.loads(tokenizer_text)
        self._bytes = token_bytes_table(self._tok, tokenizer_json)
        # What the incremental detokenizer joins instead of decoding, where decoding is joining bytes.
        self.joined_bytes = joined_bytes_table(self._tok, tokenizer_json, self._bytes)
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._affixes = self._special_affixes()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode holds it), so a long text tokenized in a worker thread never
        # stalls the event loop; for a short text the two cost the same.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pair(self, query: str, document: str, templated: bool, add_special_tokens: bool = True) -> list[int]:
        """A scored (query, document) pair as one prompt, as vLLM makes it: the chat template's rendering of the two as
        messages of roles "query" and "document" (special-token text in them stays text), or the texts joined and
        read as a completion's prompt is."""
        if templated:
            messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
            return self.encode_chat(messages, add_generation_prompt=False)
        return self.encode(query + document, add_special_tokens)

    def single_token(self, text: str) -> int | None:
        """The id of the one token that `text` encodes to, or None where it takes several (or none)."""
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id's entry in the vocabulary as written there (byte-level: "Ġthe"), as HF's convert_ids_to_tokens."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    def _token_text(self, token_id: int) -> str:
        """One token's text for logprobs (may be a partial UTF-8 character, shown as U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def _special_affixes(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer's post-processor puts before and after a text (e.g. a BOS)."""
        bare, full = self.encode("a", add_special_tokens=False), self.encode("a")
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
        return ([], []) if at is None else (full[:at], full[at + len(bare) :])

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, a partial UTF-8 character's too (chat logprobs' `bytes`)."""
        if self._bytes is not None and 0 <= token_id < len(self._bytes):
            return self._bytes[token_id]
        return self.token_text(token_id).encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> str:  # fmt: skip
        """`tools`: function definitions in HF's shape ({"type": "function", "function": {...}}), or None.
        `continue_final_message`: the text ends with the final message's content, left open (as transformers).
        `template_kwargs`: more variables for the template; none may replace the ones set here."""
        template = self._tool_template if tools is not None and self._tool_template is not None else self._template
        if template is None:
            raise TokenizerError("this model has no chat template; use /v1/completions")
        ours = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                **self.special_tokens}  # fmt: skip
        taken = sorted(ours.keys() & (template_kwargs or {}).keys())
        if taken:
            raise TemplateKwargsError(f"chat_template_kwargs may not set {', '.join(taken)}")
        try:
            text = template.render(**(template_kwargs or {}), **ours)
            return _open_final_message(text, messages) if continue_final_message else text
        except jinja2.TemplateError as exc:  # the template rejected the conversation (e.g. role order)
            raise TokenizerError(f"chat template: {exc}") from exc
        except (TypeError, ValueError, KeyError) as exc:  # e.g. a message shape it does not expect (tool calls)
            raise TokenizerError(f"chat template failed on this conversation: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None,
                    add_special_tokens: bool = False) -> list[int]:  # fmt: skip
        """The chat prompt's ids. Special tokens the template writes are control tokens; special-token text inside
        the messages, tools and template kwargs (content, name, any string) is plain text, as the OpenAI API treats
        message content. `add_special_tokens` (vLLM's): the tokenizer's own (a BOS) around the rendered text too."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, continue_final_message,
                                        template_kwargs)  # fmt: skip
        # Each string that holds special-token text is swapped for a unique marker, to learn where the template
        # writes it; the nonce keeps a user from writing a marker themselves.
        nonce = secrets.token_hex(8)
        strings: list[str] = []

        def marker(value: str) -> str:
            if self._special_re is None or self._special_re.search(value) is None:
                return value
            strings.append(value)
            return f"\ue000{nonce}:{len(strings) - 1}\ue001"

        marked, marked_tools, marked_kwargs = _map_strings([messages, tools, template_kwargs], marker)
        if self.parse_special_in_content or not strings:
            # The common case: the same ids as encoding the rendered string (as transformers does). The template
            # already wrote every special token (BOS included) the model expects.
            return self.encode(text, add_special_tokens=add_special_tokens)
        # Even parts are the template's text, odd parts the index of the string written there, as it is or (tool
        # definitions and call arguments, written with tojson) JSON-escaped. If putting the strings back does not
        # give the same text, the template changed or inspected them: refuse rather than guess which characters
        # came from the user.
        marked_text = self.apply_chat_template(marked, add_generation_prompt, marked_tools, continue_final_message,
                                               marked_kwargs)  # fmt: skip
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", marked_text)
        spans: list[str] = []
        at = 0
        for i, part in enumerate(parts):
            forms = (strings[int(part)], json.dumps(strings[int(part)], ensure_ascii=False)[1:-1]) if i % 2 else (part,)
            written = next((f for f in forms if text.startswith(f, at)), None)
            if written is None:
                raise TokenizerError("this model's chat template rewrites message text that contains special tokens")
            spans.append(written)
            at += len(written)
        if at != len(text):
            raise TokenizerError("this model's chat template rewrites message text that contains special tokens")
        # Spans are encoded one by one, so no BPE merge or pre-token crosses a span's edge. Acceptable: templates
        # put a special token at the far edge of a message, where the tokenizer splits anyway, and usually a newline
        # at the near edge, where the pre-tokenizer splits too (unless the content starts with whitespace). The
        # text is the same either way, and only prompts that hold special-token text take this path.
        ids: list[int] = []
        for i, span in enumerate(spans):
            if i % 2:
                ids += self._text_tok.encode_batch([span], add_special_tokens=False)[0].ids
            elif span:
                ids += self.encode(span, add_special_tokens=False)
        return [*self._affixes[0], *ids, *self._affixes[1]] if add_special_tokens else ids
