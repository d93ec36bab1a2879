"""EngineRecovery: the client's side of an engine death: notice it once, blame poison requests, restart, resume."""

from __future__ import annotations

import asyncio
import logging

import zmq

from common.engine_link import EngineStartError
from common.messages import AbortRequest, EngineReady, EngineRequest, UtilityCall, UtilityResult
from frontend.errors import EngineUnavailable
from frontend.metrics import Metrics
from frontend.request_stream import RequestStream
from frontend.supervisor import EngineSupervisor

log = logging.getLogger("roseinfer.frontend")
POISON = "request_crashed_engine"  # error code of a request failed for being in two engine crashes running


class EngineRecovery:
    """AsyncEngineClient's base: the state below is set by its __init__ and shared with its request side.

    With `resumable` set (launch.py does, unless --max-engine-restarts 0), a dead engine leaves every unfinished
    stream open and sets the event wait_down() returns on; whoever supervises calls restart() or give_up().
    Without it, a dead engine fails every in-flight request at once."""

    supervisor: EngineSupervisor | None
    metrics: Metrics | None
    resumable: bool
    epoch: int  # the engine we talk to, or wait for
    ready: EngineReady | None
    dead: str | None  # why no engine answers now
    _streams: dict[str, RequestStream]
    _calls: dict[int, asyncio.Future[UtilityResult]]
    _ready_future: asyncio.Future[EngineReady] | None
    _down_epoch: int | None
    _down: asyncio.Event  # the current engine went down and waits for restart() or give_up()
    _settled: asyncio.Event  # an engine answers, or none will come back: waiting requests re-check
    _closing: bool

    def _send(self, msg: EngineRequest | AbortRequest | UtilityCall) -> None:
        raise NotImplementedError

    def is_up_or_starting(self, epoch: int) -> bool:
        return epoch == self.epoch and self._down_epoch != epoch and not self._closing

    def _on_ready(self, msg: EngineReady) -> None:
        if msg.epoch != self.epoch or self._down_epoch == msg.epoch:
            return  # a replaced engine's late word
        self.ready, self.dead = msg, None
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.set_result(msg)
        resumed = [s for s in self._streams.values() if not s.finished]
        try:
            for stream in resumed:
                self._send(stream.mark_sent())
        except zmq.ZMQError as exc:
            self.engine_down(f"cannot reach the engine core (epoch {msg.epoch}): {exc}", msg.epoch)
            return
        if resumed:
            log.warning("engine core epoch %d ready: resumed %d unfinished requests", msg.epoch, len(resumed))
        self._settled.set()

    # ---- engine down, restart, give up ----

    def engine_down(self, reason: str, epoch: int, crashed: bool = True) -> None:
        """Called by whatever notices first (EngineDead, process exit, disconnect, unanswered ping); once per epoch.
        `crashed` False (a hang): it blames no request, since an overloaded machine looks the same."""
        if not self.is_up_or_starting(epoch):
            return
        log.error("%s", reason)
        self._down_epoch, self.dead = epoch, reason
        self._settled.clear()
        if self.supervisor is not None:
            self.supervisor.kill()  # gone already, or hung: either way no two engines ever run
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineUnavailable(reason))
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.set_exception(EngineStartError(reason))
        if self.metrics is not None:
            self.metrics.engine_down()
        if not self.resumable:
            self.give_up(reason)
            return
        for stream in list(self._streams.values()) if crashed else []:
            if stream.on_crash():  # in this crash and the one before without a token in between: the likely cause
                del self._streams[stream.request_id]
                log.error("request %s failed: in flight at two engine crashes running", stream.request_id)
                stream.fail("the request was in flight at two consecutive engine crashes and is not retried "
                            f"(last: {reason})", POISON)  # fmt: skip
        self._down.set()

    async def wait_down(self) -> str:
        """Returns (why) when the engine went down and waits for restart() or give_up()."""
        await self._down.wait()
        return self.dead or "engine core down"

    async def restart(self, ready_timeout: float) -> None:
        """Replaces the dead engine with epoch + 1 and the same configuration; unfinished streams resume on its
        EngineReady. Returns when it is ready or down again (wait_down() then returns at once)."""
        assert self.supervisor is not None and self._down.is_set()
        self._down.clear()
        self.supervisor.kill()
        await asyncio.to_thread(self.supervisor.stop)  # reaps it (killed: no wait)
        self.epoch += 1  # before the spawn: from here on the old engine's outputs are dropped
        try:
            self.supervisor.respawn(self.epoch)
        except OSError as exc:
            self.engine_down(f"cannot start engine core (epoch {self.epoch}): {exc}", self.epoch)
            return
        self._ready_future = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._ready_future), ready_timeout)
        except EngineStartError:
            pass  # engine_down ran already
        except TimeoutError:
            self.engine_down(f"engine core (epoch {self.epoch}) not ready after {ready_timeout:.0f} s", self.epoch)

    def give_up(self, reason: str) -> None:
        """No engine will come back: fail what is in flight and what waits."""
        self.resumable = False
        self.dead = self.dead or reason
        self.fail_all(reason)
        self._settled.set()

    def fail_all(self, error: str) -> None:
        """Ends every in-flight request with `error` (its consumer sees finish_reason "error")."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error)
