"""A request re-sent with the tokens it already streamed continues exactly as it would have (crash resume)."""

from __future__ import annotations

import pytest

from common.messages import EngineRequest, SamplingParams
from engine_core.core import EngineCore
from tests.engine_helpers import fp32_config, mixed_prompts, run_engine, tokens_of


@pytest.fixture(scope="module")
def core():
    return EngineCore(fp32_config())


PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.0, seed=77, frequency_penalty=0.5, ignore_eos=True),
]  # fmt: skip
CUTS = (1, 17)


def test_resumed_requests_continue_identically(core: EngineCore) -> None:
    """Greedy, seeded top-p and seeded with a penalty, each cut after 1 and after 17 tokens; the resumed requests
    arrive together, as a restarted engine receives every open stream at once."""
    prompt = mixed_prompts()[5]
    ids = [f"full{i}" for i in range(len(PARAMS))]
    full = tokens_of(run_engine(core, [EngineRequest(i, prompt, p) for i, p in zip(ids, PARAMS, strict=True)]), ids)
    assert [len(f) for f in full] == [40] * len(PARAMS)
    resumed = [EngineRequest(f"resumed{i}-{cut}", prompt, p, output_token_ids=full[i][:cut])
               for i, p in enumerate(PARAMS) for cut in CUTS]  # fmt: skip
    names = [r.request_id for r in resumed]
    rest = dict(zip(names, tokens_of(run_engine(core, resumed), names), strict=True))
    for i in range(len(PARAMS)):
        for cut in CUTS:
            # max_tokens counts the tokens already streamed: the resumed request produces only the rest.
            assert full[i][:cut] + rest[f"resumed{i}-{cut}"] == full[i], (i, cut)
