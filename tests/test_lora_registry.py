"""The API's side of runtime LoRA loads (frontend/api/lora_adapters.py) over several engines: every live engine loads
an adapter before its name is served, a refusal anywhere undoes the load everywhere (an engine that did not answer
is told too: it may still be loading), ids are never reused, and the routes stay off unless
VLLM_ALLOW_RUNTIME_LORA_UPDATING says otherwise. Also the adapters metric gateways read (lora_requests_info)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from transformers import LlamaConfig

from bench.make_random_lora import write_adapter
from common.messages import EngineRequest, LoraRef, SamplingParams, UtilityResult
from frontend.api.lora_adapters import (
    LoadLoraAdapterRequest,
    LoraRegistry,
    UnloadLoraAdapterRequest,
    runtime_updates_allowed,
)
from frontend.engine.request_stream import RequestStream
from frontend.errors import ApiError, EngineUnavailable
from frontend.metrics import Metrics


@dataclass
class _Handle:
    healthy: bool = True
    refuse: str | None = None  # the error this engine answers a load with
    gone: bool = False  # it dies during the call


@dataclass
class _Client:
    handles: list[_Handle]
    calls: list[tuple[int, str, int]] = field(default_factory=list)  # (engine, method, adapter id)
    retired_loras: list[LoraRef] = field(default_factory=list)  # what a restarted engine is told to unload

    async def call(self, method: str, timeout: float, engine: int, lora: LoraRef) -> UtilityResult:
        self.calls.append((engine, method, lora.id))
        handle = self.handles[engine]
        if handle.gone:
            raise EngineUnavailable("engine core 1 died")
        refused = handle.refuse is not None and method == "load_lora"
        return UtilityResult(0, ok=not refused, error=handle.refuse if refused else None)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)  # fmt: skip
    return write_adapter(tmp_path_factory.mktemp("adapter"), config, ["q_proj"], rank=4, alpha=4, seed=0)


def _registry(**kw) -> LoraRegistry:
    return LoraRegistry(**{"enabled": True, "runtime_updates": True, **kw})


def _load(registry: LoraRegistry, client: _Client, name: str, path: str, inplace: bool = False) -> str:
    request = LoadLoraAdapterRequest(lora_name=name, lora_path=path, load_inplace=inplace)
    return asyncio.run(registry.load(client, request, "base"))  # type: ignore[arg-type]


def _error(call) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call()
    return caught.value


def test_every_live_engine_loads_it_and_unloads_it(adapter):
    client, registry = _Client([_Handle(), _Handle(healthy=False), _Handle()]), _registry()
    assert _load(registry, client, "sql", adapter) == "Success: LoRA adapter 'sql' added successfully."
    assert client.calls == [(0, "load_lora", 1), (2, "load_lora", 1)]  # engine 1 restarts: it loads on first use
    assert registry.get("sql") == LoraRef(1, "sql", adapter)
    client.calls.clear()
    asyncio.run(registry.unload(client, UnloadLoraAdapterRequest(lora_name="sql")))  # type: ignore[arg-type]
    assert client.calls == [(0, "unload_lora", 1), (2, "unload_lora", 1)] and registry.get("sql") is None
    assert client.retired_loras == [LoraRef(1, "sql", adapter)]  # engine 1 unloads it once it is back


def test_a_refusal_undoes_the_load_on_every_engine(adapter):
    client = _Client([_Handle(), _Handle(refuse="LoRA adapter 'sql': the model has no layer x")])
    registry = _registry()
    error = _error(lambda: _load(registry, client, "sql", adapter))
    assert error.status == 400 and "has no layer x" in error.message
    assert client.calls == [(0, "load_lora", 1), (1, "load_lora", 1), (0, "unload_lora", 1), (1, "unload_lora", 1)]
    assert registry.get("sql") is None and [r.id for r in client.retired_loras] == [1]
    client.handles[1].refuse = None
    _load(registry, client, "sql", adapter)
    assert registry.get("sql").id == 2  # type: ignore[union-attr]  # id 1 named the refused load's weights


def test_an_engine_dying_mid_load_fails_it_with_503(adapter):
    client, registry = _Client([_Handle(), _Handle(gone=True)]), _registry()
    assert _error(lambda: _load(registry, client, "sql", adapter)).status == 503
    assert client.calls[2:] == [(0, "unload_lora", 1), (1, "unload_lora", 1)] and registry.get("sql") is None
    client.handles[0].healthy = client.handles[1].healthy = False
    assert _error(lambda: _load(registry, client, "sql", adapter)).status == 503  # no engine up to check weights


def test_load_in_place_is_a_new_id_and_retires_the_old(adapter):
    client, registry = _Client([_Handle()]), _registry()
    _load(registry, client, "sql", adapter)
    _load(registry, client, "sql", adapter, inplace=True)
    assert registry.get("sql").id == 2  # type: ignore[union-attr]
    assert client.calls == [(0, "load_lora", 1), (0, "load_lora", 2), (0, "unload_lora", 1)]
    assert [r.id for r in client.retired_loras] == [1]


def test_routes_are_off_unless_asked_for(adapter, monkeypatch: pytest.MonkeyPatch):
    client = _Client([_Handle()])
    error = _error(lambda: _load(_registry(runtime_updates=False), client, "sql", adapter))
    assert error.status == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in error.message
    error = _error(lambda: _load(_registry(enabled=False), client, "sql", adapter))
    assert error.status == 400 and "--enable-lora" in error.message
    assert not client.calls
    for value, allowed in (("True", True), ("1", True), (" true ", True), ("0", False), ("yes", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert runtime_updates_allowed() is allowed, value


def _lora_info(metrics: Metrics) -> list[str]:
    return [line for line in metrics.render().decode().splitlines() if line.startswith("roseinfer:lora_requests_info")]


def test_lora_requests_info_names_running_and_waiting_adapters() -> None:
    """vLLM's labels: an adapter with a request admitted into a step is running, one with a request not yet admitted
    is waiting (both, where it has both); base-model and finished requests count for nothing. One series at a time,
    its value the time it was taken."""
    refs = {name: LoraRef(i + 1, name, f"/adapters/{name}") for i, name in enumerate(["sql", "chat", "code", "x"])}
    streams = []
    for i, (lora, started, finished) in enumerate([("sql", True, False), ("chat", False, False), (None, True, False),
                                                    ("sql", False, False), ("code", True, False), ("x", True, True)]):
        stream = RequestStream(EngineRequest(f"r{i}", [1, 2], SamplingParams(), lora=lora and refs[lora]), None)
        stream.started, stream.finished = started, finished
        streams.append(stream)
    metrics = Metrics("base", lora=True)
    metrics.observe_loras(streams, max_lora=4)
    [line] = _lora_info(metrics)
    labels, value = line.split("} ")
    assert labels == ('roseinfer:lora_requests_info{max_lora="4",running_lora_adapters="sql,code",'
                      'waiting_lora_adapters="chat,sql"')
    assert abs(float(value) - time.time()) < 60
    metrics.observe_loras([], max_lora=3)
    assert [line.split("} ")[0] for line in _lora_info(metrics)] == [
        'roseinfer:lora_requests_info{max_lora="3",running_lora_adapters="",waiting_lora_adapters=""']
    without = Metrics("base")
    without.observe_loras(streams, max_lora=4)
    assert _lora_info(without) == []  # no --enable-lora: no series, as vLLM
