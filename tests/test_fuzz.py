"""Property-based fuzzing of every POST route's request schema: whatever the body, the answer is a 200 that parses
(SSE ending in [DONE], /generate streams that complete, Responses event streams that end in a completed response)
or an OpenAI-shaped 4xx; never a 5xx, a hang or a leak."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bench.make_random_model import write_model
from tests.conftest import Server, engine_child
from tests.fuzz_answers import problems, send_all
from tests.fuzz_field_strategies import MODEL
from tests.fuzz_request_strategies import SLOT, Req, encode, slot_key
from tests.test_api_streaming import assert_engine_idle_within, metric

# Bodies sent at once per example. An example lasts as long as its longest generation, and a CPU decode step costs
# little more for 50 sequences than for 1 (reading the weights dominates): wide examples keep the wall time low.
BATCH = 50
EXAMPLES = 47  # 47 x 50 slots, 1 in 10 empty: about 2,100 bodies
MIN_BODIES = 2000


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # The default tokenizer and chat template on a random model of two narrow layers: the schemas are what is
    # fuzzed, and its steps cost next to nothing. A 96-token context: long prompts and budgets fail fast.
    tmp = tmp_path_factory.mktemp("fuzz")
    model = write_model("tiny", tmp / "model")
    server = Server(tmp, "--model", str(model), "--served-model-name", MODEL, "--max-model-len", "96",
                    "--num-kv-blocks", "128")  # fmt: skip
    yield server.wait_healthy()
    server.assert_clean_exit()


def test_encode_escapes_lone_surrogates() -> None:
    assert encode({"p": "\ud800"}, True) == b'{"p": "\\ud800"}'
    assert encode({"p": "\ud800"}, False) == b'{"p": "\\ud800"}'  # no UTF-8 form: escaped too
    assert encode({"p": "é"}, False) == '{"p": "é"}'.encode()
    assert encode({"p": float("nan")}, True) == b'{"p": NaN}'


def test_fuzz_request_schemas(fuzz_server: Server) -> None:
    statuses: Counter[int] = Counter()

    # No shrinking: a failure already names each bad body with the server's log, and shrinking batches of 50 whose
    # every try waits for generations (or, after a hang, for the client's timeout) would hold the report for minutes.
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=False,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])  # fmt: skip
    @given(st.lists(SLOT, min_size=BATCH, max_size=BATCH, unique_by=slot_key))
    def fuzz(slots: list[Req | None]) -> None:
        reqs = [r for r in slots if r is not None]
        answers = asyncio.run(send_all(fuzz_server.url, reqs))
        statuses.update(status for status, _, _ in answers)
        found = [p for req, a in zip(reqs, answers, strict=True) for p in problems(req, *a)]
        assert not found, "\n\n".join([*found, "server log:\n" + fuzz_server.log_text()])

    fuzz()
    sent = sum(statuses.values())
    print(f"\nfuzz: {sent} bodies, statuses {dict(sorted(statuses.items()))}")
    assert sent >= MIN_BODIES, statuses
    assert statuses[200] >= sent // 10, f"too few accepted bodies to reach the engine: {statuses}"
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    assert engine_child(fuzz_server) == fuzz_server.engine_pid, "the engine core was restarted"
    assert_engine_idle_within(fuzz_server, 5.0)
    assert metric(fuzz_server, "num_requests_waiting") == 0
    assert "Traceback" not in fuzz_server.log.read_text(errors="replace"), fuzz_server.log_text()
