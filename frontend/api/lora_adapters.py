"""The LoRA adapters this server serves, by name, and vLLM's routes that change them while it runs:
POST /v1/load_lora_adapter and /v1/unload_lora_adapter, on only where VLLM_ALLOW_RUNTIME_LORA_UPDATING is set (as
vLLM: anyone who can call them makes the server read a directory of their choice).

Each load gets an id never used before (LoraRef.id), the engine's key for the adapter's weights and its prefix-cache
blocks: a name loaded again in place (`load_inplace`) is a new adapter to the engine, and requests already running
on the old weights finish on them. Every live engine loads the weights before the name is served; an engine that
restarts, or was down meanwhile, loads an adapter when a request first names it (requests carry its path)."""

from __future__ import annotations

import asyncio
import logging
import os

from common.lora import LoraModule, LoraNotFound
from common.messages import LoraRef
from frontend.api.protocol import ApiModel, Text
from frontend.engine.engine_client import AsyncEngineClient
from frontend.errors import ApiError, EngineUnavailable, bad_request

log = logging.getLogger("roseinfer.api")

RUNTIME_UPDATES = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the two routes, honoured as vLLM reads it
LOAD_TIMEOUT_S = 300.0


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES, "0").strip().lower() in ("1", "true")


class LoadLoraAdapterRequest(ApiModel):
    lora_name: Text
    lora_path: Text
    load_inplace: bool = False  # replace an adapter already served under this name


class UnloadLoraAdapterRequest(ApiModel):
    lora_name: Text
    lora_int_id: int | None = None  # vLLM's; ignored: a name is unique here


class LoraRegistry:
    def __init__(self, modules: list[LoraModule] | None = None, enabled: bool = False, max_rank: int = 16,
                 runtime_updates: bool = False) -> None:  # fmt: skip
        self.refs: dict[str, LoraRef] = {m.name: m.ref for m in modules or []}  # served, in load order
        self.enabled, self.max_rank, self.runtime_updates = enabled, max_rank, runtime_updates
        self._next_id = len(self.refs) + 1  # --lora-modules hold 1..n, in the engines too
        self._lock = asyncio.Lock()  # one change at a time: ids and engine calls in order

    def get(self, name: str | None) -> LoraRef | None:
        return self.refs.get(name) if name is not None else None

    async def load(self, client: AsyncEngineClient, req: LoadLoraAdapterRequest, base_names: tuple[str, ...]) -> str:
        self._check_allowed()
        if not req.lora_name or not req.lora_path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if req.lora_name in base_names:
            raise bad_request(f"The lora adapter '{req.lora_name}' conflicts with the served base model.", "lora_name")
        async with self._lock:
            old = self.refs.get(req.lora_name)
            if old is not None and not req.load_inplace:
                raise bad_request(f"The lora adapter '{req.lora_name}' has already been loaded. If you want to load "
                                  "the adapter in place, set 'load_inplace' to True.", "lora_name")  # fmt: skip
            if not any(h.healthy for h in client.handles):
                raise ApiError(503, "no engine core is up to load the adapter; retry shortly", None,
                               "engine_unavailable")  # fmt: skip
            ref = LoraRef(self._next_id, req.lora_name, req.lora_path)
            try:  # its config, as at start, before any engine reads the weights
                await asyncio.to_thread(LoraModule.read, ref, self.max_rank)
            except LoraNotFound as exc:
                raise ApiError(404, str(exc), "lora_path", "lora_not_found") from None
            except ValueError as exc:
                raise bad_request(str(exc), "lora_path") from None
            self._next_id += 1  # spent even if an engine refuses: an id names one set of weights only
            error = await _on_every_engine(client, "load_lora", ref)
            if error is not None:  # every engine forgets it, one still loading it (a timeout) once it is done
                await _retire(client, ref)
                raise error
            self.refs[ref.name] = ref
            if old is not None:  # its running requests finish on the old weights, which go after them
                await _retire(client, old)
        log.info("loaded LoRA adapter %r (id %d) from %s", ref.name, ref.id, ref.path)
        return f"Success: LoRA adapter '{ref.name}' added successfully."

    async def unload(self, client: AsyncEngineClient, req: UnloadLoraAdapterRequest) -> str:
        self._check_allowed()
        if not req.lora_name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        async with self._lock:
            ref = self.refs.pop(req.lora_name, None)
            if ref is None:
                raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name",
                               "lora_not_found")  # fmt: skip
            await _retire(client, ref)  # requests already sent finish first
        log.info("unloaded LoRA adapter %r (id %d)", ref.name, ref.id)
        return f"Success: LoRA adapter '{ref.name}' removed successfully."

    def _check_allowed(self) -> None:
        if not self.runtime_updates:
            raise ApiError(404, f"loading and unloading LoRA adapters at run time is off: set {RUNTIME_UPDATES}=True "
                                "in the server's environment", None, "not_found")  # fmt: skip
        if not self.enabled:
            raise bad_request("LoRA adapters are not enabled (start the server with --enable-lora)", None)


async def _retire(client: AsyncEngineClient, ref: LoraRef) -> None:
    """Unloads it from every live engine; an engine that is down unloads it once restarted (recovery.py), since it
    may load it again: from its start flags, or for a resumed request."""
    client.retired_loras.append(ref)
    await _on_every_engine(client, "unload_lora", ref)


async def _on_every_engine(client: AsyncEngineClient, method: str, ref: LoraRef) -> ApiError | None:
    """Calls every live engine; returns the first refusal as an ApiError. An engine that is down is skipped: a
    restarted one loads an adapter on first use, and unloads the retired ones when it is ready."""
    targets = [i for i, h in enumerate(client.handles) if h.healthy]
    results = await asyncio.gather(*(client.call(method, timeout=LOAD_TIMEOUT_S, engine=i, lora=ref)
                                     for i in targets), return_exceptions=True)  # fmt: skip
    error = None
    for i, result in zip(targets, results, strict=True):
        if isinstance(result, EngineUnavailable | TimeoutError):
            error = error or ApiError(503, f"engine core {i} did not answer {method}: {result!r}", None,
                                      "engine_unavailable")  # fmt: skip
        elif isinstance(result, BaseException):
            error = error or ApiError(500, f"engine core {i}: {result!r}")
        elif not result.ok:
            error = error or bad_request(result.error or "the engine refused the adapter", "lora_path")
    return error
