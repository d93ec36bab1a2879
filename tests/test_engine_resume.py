"""A request re-sent with the tokens it already streamed continues exactly as it would have (crash resume)."""

from __future__ import annotations

import pytest

from common.messages import EngineRequest, SamplingParams
from engine_core.core import EngineCore
from tests.engine_helpers import fp32_config, mixed_prompts, run_engine, tokens_of


@pytest.fixture(scope="module")
def core():
    return EngineCore(fp32_config())


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.0, seed=77, frequency_penalty=0.5, ignore_eos=True),
])  # fmt: skip
def test_resumed_request_continues_identically(core: EngineCore, params: SamplingParams) -> None:
    prompt = mixed_prompts()[5]
    full = tokens_of(run_engine(core, [EngineRequest("full", prompt, params)]), ["full"])[0]
    assert len(full) == 40
    for cut in (1, 17):
        resumed = EngineRequest("resumed", prompt, params, output_token_ids=full[:cut])
        rest = tokens_of(run_engine(core, [resumed]), ["resumed"])[0]
        # max_tokens counts the tokens already streamed: the resumed request produces only the rest.
        assert full[:cut] + rest == full
