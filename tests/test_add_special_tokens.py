"""vLLM's add_special_tokens, from the request to the engine request's prompt ids, on a tokenizer whose
post-processor adds a BOS (the default model's adds none): completions add it unless told not to, chat adds it
around the rendered template only when told to; transformers' encoding is the reference."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from common.messages import EngineRequest
from common.model_source import resolve_model
from frontend.api.protocol import ChatCompletionRequest, CompletionRequest
from frontend.api.serving import ServingContext
from frontend.api.serving_chat import start_chat
from frontend.api.serving_completion import create_completion
from frontend.text.tokenizer import Tokenizer

BOS = "<|endoftext|>"  # id 0 in the default model's vocabulary
PLAIN = [{"role": "user", "content": "Hello there"}]
SPECIAL_TEXT = [{"role": "user", "content": "Say <|im_end|> please"}]  # encoded span by span


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source, path = resolve_model(None).path, tmp_path_factory.mktemp("bos")
    spec = json.loads((source / "tokenizer.json").read_text())
    bos, a, b = ({"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}})  # fmt: skip
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, a], "pair": [bos, a, b],
                              "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}}}  # fmt: skip
    (path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(source / "tokenizer_config.json", path)
    shutil.copy(source / "chat_template.jinja", path)
    return path


class CapturingClient:
    """Just enough of AsyncEngineClient to admit a request and keep the engine requests it is sent."""

    max_queued = 100
    dead = None

    def __init__(self) -> None:
        self.sent: list[EngineRequest] = []

    async def wait_available(self) -> None:
        pass

    def check_capacity(self, n: int) -> None:
        pass

    def add(self, req: EngineRequest, *_: Any) -> Any:
        self.sent.append(req)
        return SimpleNamespace(request_id=req.request_id, finished=True)

    def abort(self, ids: list[str]) -> None:
        pass


def engine_prompt(tok: Tokenizer, route: str, body: dict[str, Any]) -> list[int]:
    client = CapturingClient()
    ctx = ServingContext(client, tok, "m", max_model_len=2048, vocab_size=tok.vocab_size)  # type: ignore[arg-type]
    if route == "chat":
        asyncio.run(start_chat(ctx, ChatCompletionRequest(**body, max_tokens=4), "r"))
    else:  # streamed: the response is built without reading the (absent) HTTP request
        asyncio.run(create_completion(ctx, CompletionRequest(**body, max_tokens=4, stream=True), None, "r"))  # type: ignore[arg-type]
    return list(client.sent[0].prompt_token_ids)


def test_completions_add_the_bos_unless_told_not_to(bos_dir: Path):
    tok, ref = Tokenizer(bos_dir), PreTrainedTokenizerFast.from_pretrained(str(bos_dir))
    prompt = "<|im_start|>user\nHello<|im_end|>\n"  # a template the client rendered itself
    with_bos = engine_prompt(tok, "completion", {"prompt": prompt})
    assert with_bos[0] == 0 and with_bos == ref.encode(prompt)
    without = engine_prompt(tok, "completion", {"prompt": prompt, "add_special_tokens": False})
    assert without == with_bos[1:] == ref.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("messages", [PLAIN, SPECIAL_TEXT])
def test_chat_adds_the_bos_around_the_template_only_when_told_to(bos_dir: Path, messages: list[dict]):
    tok, ref = Tokenizer(bos_dir), PreTrainedTokenizerFast.from_pretrained(str(bos_dir))
    rendered = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    plain = engine_prompt(tok, "chat", {"messages": messages})
    assert plain[0] != 0 and tok.decode(plain, skip_special_tokens=False) == rendered
    added = engine_prompt(tok, "chat", {"messages": messages, "add_special_tokens": True})
    assert added == [0, *plain]
    if messages is PLAIN:  # special-token text in content stays text in ours, so only a plain chat compares
        assert plain == ref.encode(rendered, add_special_tokens=False) and added == ref.encode(rendered)
