"""EngineRecovery: one engine core's life: ready, down (noticed once per epoch), poison requests blamed, restarted,
its unfinished requests resumed on the replacement, or given up. A part of an EngineHandle (composition)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import zmq

from common.messages import AbortRequest, EngineReady, EngineRequest, LoraRef, UtilityCall
from frontend.engine.request_stream import RequestStream
from frontend.engine.spawn import EngineStartError
from frontend.engine.supervisor import EngineSupervisor
from frontend.errors import EngineUnavailable

log = logging.getLogger("roseinfer.frontend")
POISON = "request_crashed_engine"  # error code of a request failed for being in two engine crashes running
ENGINE_GONE = "engine_unavailable"  # error code of a request whose engine will not come back (retired, shutdown)


class Recoverable(Protocol):
    """What recovery needs of its engine handle."""

    label: str
    process: EngineSupervisor | None
    streams: dict[str, RequestStream]  # in flight on this engine
    retired_loras: list[LoraRef]  # LoRA adapters the API no longer serves

    def send(self, msg: EngineRequest | AbortRequest | UtilityCall) -> None: ...
    def fail_calls(self, error: Exception) -> None: ...


class EngineRecovery:
    """With `resumable` set (launch.py does, unless --max-engine-restarts 0), a dead engine leaves its unfinished
    streams open and sets the event wait_down() returns on; its supervisor calls restart() or give_up().
    Without it, a dead engine fails its in-flight requests at once. `on_change` runs on every ready, down and
    give-up: the client's requests waiting for an engine look again, the metrics forget a dead engine's batch."""

    def __init__(self, engine: Recoverable, epoch: int, on_change: Callable[[], None]) -> None:
        self.engine = engine
        self.on_change = on_change
        self.resumable = False
        self.epoch = epoch  # the engine we talk to, or wait for
        self.ready: EngineReady | None = None
        self.dead: str | None = None  # why this engine does not answer now
        self.retired = False  # no engine will come back here (given up)
        self.ready_future: asyncio.Future[EngineReady] | None = None
        self._down_epoch: int | None = None
        self._down = asyncio.Event()  # the current engine went down and waits for restart() or give_up()
        self._closing = False

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.dead is None

    def is_up_or_starting(self, epoch: int) -> bool:
        return epoch == self.epoch and self._down_epoch != epoch and not self._closing

    def expect_ready(self) -> asyncio.Future[EngineReady]:
        self.ready_future = asyncio.get_running_loop().create_future()
        return self.ready_future

    def on_ready(self, msg: EngineReady) -> None:
        if msg.epoch != self.epoch or self._down_epoch == msg.epoch:
            return  # a replaced engine's late word
        self.ready, self.dead = msg, None
        if self.ready_future is not None and not self.ready_future.done():
            self.ready_future.set_result(msg)
        resumed = [s for s in self.engine.streams.values() if not s.finished]
        try:
            for stream in resumed:
                self.engine.send(stream.mark_sent())
            # Adapters unloaded while it was down, or loaded again from its start flags: their weights go once no
            # resumed request uses them. Call id 0: nobody waits for the answer.
            for ref in self.engine.retired_loras:
                self.engine.send(UtilityCall(0, "unload_lora", lora=ref))
        except zmq.ZMQError as exc:
            self.engine_down(f"cannot reach the {self.engine.label} (epoch {msg.epoch}): {exc}", msg.epoch)
            return
        if resumed:
            log.warning("%s epoch %d ready: resumed %d unfinished requests", self.engine.label, msg.epoch, len(resumed))
        self.on_change()

    def engine_down(self, reason: str, epoch: int, crashed: bool = True) -> None:
        """Called by whatever notices first (EngineDead, process exit, disconnect, unanswered ping); once per epoch.
        `crashed` False (a hang): it blames no request, since an overloaded machine looks the same."""
        if not self.is_up_or_starting(epoch):
            return
        log.error("%s", reason)
        self._down_epoch, self.dead = epoch, reason
        if self.engine.process is not None:
            self.engine.process.kill()  # gone already, or hung: either way no two engines ever run
        self.engine.fail_calls(EngineUnavailable(reason))
        if self.ready_future is not None and not self.ready_future.done():
            self.ready_future.set_exception(EngineStartError(reason))
        if not self.resumable:
            self.give_up(reason)
            return
        streams = self.engine.streams
        for stream in list(streams.values()) if crashed else []:
            if stream.on_crash():  # in this crash and the one before without a token in between: the likely cause
                del streams[stream.request_id]
                log.error("request %s failed: in flight at two engine crashes running", stream.request_id)
                stream.fail("the request was in flight at two consecutive engine crashes and is not retried "
                            f"(last: {reason})", POISON)  # fmt: skip
        self._down.set()
        self.on_change()

    async def wait_down(self) -> str:
        """Returns (why) when the engine went down and waits for restart() or give_up()."""
        await self._down.wait()
        return self.dead or f"{self.engine.label} down"

    async def restart(self, ready_timeout: float) -> None:
        """Replaces the dead engine with epoch + 1 and the same configuration and placement; unfinished streams
        resume on its EngineReady. Returns when it is ready or down again (wait_down() then returns at once)."""
        process = self.engine.process
        assert process is not None and self._down.is_set()
        self._down.clear()
        process.kill()
        await asyncio.to_thread(process.stop)  # reaps it (killed: no wait)
        self.epoch += 1  # before the spawn: from here on the old engine's outputs are dropped
        try:
            process.respawn(self.epoch)
        except OSError as exc:
            self.engine_down(f"cannot start {self.engine.label} (epoch {self.epoch}): {exc}", self.epoch)
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.expect_ready()), ready_timeout)
        except EngineStartError:
            pass  # engine_down ran already
        except TimeoutError:
            self.engine_down(f"{self.engine.label} (epoch {self.epoch}) not ready after {ready_timeout:.0f} s",
                             self.epoch)  # fmt: skip

    def give_up(self, reason: str) -> None:
        """No engine will come back here: fail what is in flight on it."""
        self.resumable, self.retired = False, True
        self.dead = self.dead or reason
        if self.engine.process is not None:
            self.engine.process.discard_spare()
        self.fail_all(reason, ENGINE_GONE)
        self.on_change()

    def fail_all(self, error: str, code: str | None = None) -> None:
        """Ends every request in flight here with `error` (its consumer sees finish_reason "error")."""
        streams = list(self.engine.streams.values())
        self.engine.streams.clear()
        for stream in streams:
            stream.fail(error, code)

    def close(self) -> None:
        self._closing = True
        self.fail_all("the server is shutting down", ENGINE_GONE)
