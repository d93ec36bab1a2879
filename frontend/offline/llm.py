"""LLM: offline batch generation (or embedding, scoring) over an engine-core process, with text in and out. The text
work is the API server's own (frontend/text/tokenizer.py: its chat templates, encoding and decoding), so an offline
prompt is the server's token for token."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from common.config import EngineConfig
from common.lora import lora_modules
from common.messages import EngineOutput, EngineRequest, SamplingParams
from common.model_source import parse_hf_overrides, resolve_model
from common.pooling import Pooling, read_pooling, unit_length
from frontend.offline.engine_link import EngineClient
from frontend.text.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    """`LLM(model=None).generate(["Hello"], SamplingParams(max_tokens=32))`: outputs in input order."""

    def __init__(self, model: str | None = None, chat_template: str | None = None, **engine_options) -> None:
        """`chat_template`: a Jinja file used instead of the model's own (the server's --chat-template; for score, a
        pair's template)."""
        config = dataclasses.replace(EngineConfig(), model=model, **engine_options)
        self.overrides = parse_hf_overrides(config.hf_overrides)
        # converts a GGUF once, before the engine
        self.source = resolve_model(model, overrides=self.overrides, tokenizer=config.tokenizer,
                                    quantization=config.quantization)
        self.tokenizer = Tokenizer(self.source.tokenizer, chat_template=chat_template)
        self.pair_template = chat_template is not None
        self.loras = {m.name: m.ref for m in lora_modules(config)}  # bad flags or adapter configs: before the engine
        self.engine = EngineClient(config)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str = "",
    ) -> list[CompletionOutput]:
        """`lora`: the adapter (by its `lora_modules` name, with `enable_lora=True`) that serves every prompt."""
        ref = self.loras.get(lora) if lora else None
        if lora and ref is None:
            raise ValueError(f"{lora!r} is not an adapter of lora_modules ({', '.join(self.loras) or 'none'})")
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        token_prompts = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        requests = [EngineRequest(str(i), p, sp, lora=ref)
                    for i, (p, sp) in enumerate(zip(token_prompts, params_list, strict=True))]  # fmt: skip
        results = []
        for p, outs in zip(token_prompts, self._run(requests, "generating", use_tqdm), strict=True):
            ids = [t for out in outs for t in out.new_token_ids]
            reason = outs[-1].finish_reason.openai()  # type: ignore[union-attr]
            results.append(CompletionOutput(p, ids, self.tokenizer.decode(ids, skip_special_tokens=True), reason))
        return results

    @functools.cached_property
    def pooling(self) -> Pooling:
        """What a pooling engine's requests give back (read when first needed: a generating model has none)."""
        return read_pooling(self.source.path, self.overrides)

    def embed(self, prompts: Sequence[str | list[int]], use_tqdm: bool = True) -> list[np.ndarray]:
        """Each prompt's embedding (common/pooling.py), for an embedding model or with runner="pooling"."""
        return [self.pooling.embedding(p) for p in self._pool(prompts, "embedding", use_tqdm)]

    def classify(self, prompts: Sequence[str | list[int]], use_tqdm: bool = True) -> list[np.ndarray]:
        """Each prompt's label probabilities, as POST /classify gives them, for a classifier (common/pooling.py)."""
        return [self.pooling.label_scores(p) for p in self._pool(prompts, "classifying", use_tqdm)]

    def score(self, query: str, documents: Sequence[str], use_tqdm: bool = True) -> list[float]:
        """Each document's score for the query, as POST /score gives it: a reranker's probability (each pair one
        prompt, through the chat_template if one was given), or an embedding model's cosine."""
        if not self.pooling.classifies:
            unit = [unit_length(v.astype(np.float64)) for v in self.embed([query, *documents], use_tqdm)]
            return [float(unit[0] @ v) for v in unit[1:]]
        pairs = [self.tokenizer.encode_pair(query, d, self.pair_template) for d in documents]
        return [float(p[0]) for p in self.classify(pairs, use_tqdm)]

    def _pool(self, prompts: Sequence[str | list[int]], what: str, use_tqdm: bool) -> list[bytes]:
        token_prompts = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        requests = [EngineRequest(str(i), p, SamplingParams(max_tokens=0), pool=True)
                    for i, p in enumerate(token_prompts)]  # fmt: skip
        results = []
        for outs in self._run(requests, what, use_tqdm):
            assert outs[-1].pooled is not None, "a pooling request finished without its result"
            results.append(outs[-1].pooled)
        return results

    def _run(self, requests: list[EngineRequest], what: str, use_tqdm: bool) -> list[list[EngineOutput]]:
        """Sends the requests (ids: their places) and gathers each one's outputs until all have finished; a failed
        request raises."""
        for request in requests:
            self.engine.send(request)
        outputs: list[list[EngineOutput]] = [[] for _ in requests]
        left = len(requests)
        with tqdm(total=len(requests), desc=what, disable=not use_tqdm) as bar:
            while left:
                for out in self.engine.next_outputs(timeout=600).outputs:
                    i = int(out.request_id)
                    outputs[i].append(out)
                    if out.finished:
                        if out.error:
                            raise RuntimeError(f"request {i} failed: {out.error}")
                        left -= 1
                        bar.update()
        return outputs

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
