"""EngineHandle: everything the API process knows of one engine core, by composition: its identity on the shared
input socket, its output socket, its process (supervisor.py), its life (recovery.py: epoch, ready, down, restart,
resume), its liveness watch (liveness.py), its restart budget, and the requests in flight on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from common import ipc
from common.messages import (
    AbortRequest,
    EngineDead,
    EngineOutputs,
    EnginePulse,
    EngineReady,
    EngineRequest,
    EngineStarted,
    LoraRef,
    UtilityCall,
    UtilityResult,
)
from frontend.engine.liveness import EngineWatch
from frontend.engine.recovery import EngineRecovery
from frontend.engine.request_stream import RequestStream
from frontend.engine.supervisor import EngineSupervisor, RestartBudget
from frontend.errors import EngineUnavailable
from frontend.metrics import Metrics

log = logging.getLogger("roseinfer.frontend")
Sender = Callable[[bytes, bytes], None]  # (identity, encoded message) through the client's input ROUTER


class EngineHandle:
    def __init__(self, index: int, label: str, output: zmq.asyncio.Socket, send: Sender,
                 process: EngineSupervisor | None, on_change: Callable[[], None], ping_timeout: float,
                 retired_loras: list[LoraRef]) -> None:  # fmt: skip
        self.index = index
        self.label = label
        self.identity = ipc.engine_identity(index)
        self.output = output
        self._send = send
        self.process = process
        self.ping_timeout = ping_timeout
        self.last_pulse = 0.0  # time.monotonic() of this epoch's last EnginePulse: its step was still moving
        self.metrics: Metrics | None = None
        self.budget: RestartBudget | None = None  # set by whoever supervises (launch.py)
        self.restarts = 0
        self.streams: dict[str, RequestStream] = {}  # in flight on this engine
        self.retired_loras = retired_loras  # the client's list: a restarted engine unloads them (recovery.py)
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}
        self._call_id = 0
        self._notify = on_change
        self.life = EngineRecovery(self, process.epoch if process else 0, self._on_change)
        self.monitor = output.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.watch = EngineWatch(self, self.monitor)

    def _on_change(self) -> None:
        if self.dead is not None and self.metrics is not None:
            self.metrics.engine_down(self.index)  # its batch is gone
        self._notify()

    # ---- state (the life's) ----

    @property
    def epoch(self) -> int:
        return self.life.epoch

    @property
    def ready(self) -> EngineReady | None:
        return self.life.ready

    @property
    def dead(self) -> str | None:
        return self.life.dead

    @property
    def healthy(self) -> bool:
        return self.life.healthy

    def is_up_or_starting(self, epoch: int) -> bool:
        return self.life.is_up_or_starting(epoch)

    def engine_down(self, reason: str, epoch: int, crashed: bool = True) -> None:
        self.life.engine_down(reason, epoch, crashed)

    @property
    def state(self) -> str:
        """For /health: ready | starting | restarting | dead."""
        if self.healthy:
            return "ready"
        if self.life.retired or (self.dead is not None and not self.life.resumable):
            return "dead"
        return "restarting" if self.dead is not None else "starting"

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"index": self.index, "state": self.state, "epoch": self.epoch,
                                "in_flight": len(self.streams), "load_tokens": self.load}  # fmt: skip
        if self.process is not None:
            info["pid"] = self.process.pid
            info["restarts"] = self.restarts
            if (spare := self.process.spare_pid) is not None:  # the warm process the next restart starts from
                info["spare_pid"] = spare
        if self.dead is not None:
            info["error"] = self.dead
        return info

    @property
    def load(self) -> int:
        """Tokens this engine holds or has to compute for what is in flight on it: prompts plus outputs so far."""
        return sum(len(s.request.prompt_token_ids) + len(s.output_token_ids) for s in self.streams.values())

    def coroutines(self) -> list[Coroutine[Any, Any, None]]:
        return self.watch.coroutines()

    # ---- requests ----

    def send(self, msg: EngineRequest | AbortRequest | UtilityCall) -> None:
        self._send(self.identity, ipc.encode(msg))

    def add(self, stream: RequestStream, park: bool = True) -> bool:
        """Sends the request. An engine that cannot be reached (ROUTER_MANDATORY: the request never got there) is
        taken down at once where it will restart. With `park` the stream then waits for its successor (without
        restarts: EngineUnavailable); without, add returns False and the caller sends it elsewhere."""
        try:
            self.send(stream.mark_sent())
        except zmq.ZMQError as exc:
            stream.sent_at = None  # it never got there: the next engine gets it
            reason = f"cannot reach the {self.label}: {exc}"
            if self.life.resumable:
                self.engine_down(reason, self.epoch)
            elif park:
                raise EngineUnavailable(reason) from exc
            if not park:
                return False
        self.streams[stream.request_id] = stream
        return True

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            with contextlib.suppress(zmq.ZMQError):  # an unreachable engine has nothing left to free
                self.send(AbortRequest(request_ids))

    async def call(self, method: str, arg: float = 0.0, timeout: float | None = None,
                   lora: LoraRef | None = None) -> UtilityResult:  # fmt: skip
        if self.dead is not None:
            raise EngineUnavailable(self.dead)
        self._call_id += 1
        call_id = self._call_id
        future: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self.send(UtilityCall(call_id, method, arg, lora))
            return await asyncio.wait_for(future, timeout)
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"cannot reach the {self.label}: {exc}") from exc
        finally:
            self._calls.pop(call_id, None)

    def fail_calls(self, error: Exception) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)

    # ---- its outputs (read by the client's one output loop) ----

    def on_message(self, msg: Any) -> None:
        if isinstance(msg, EngineOutputs):
            if msg.epoch == self.epoch:  # outputs of an older engine generation are stale
                self._on_outputs(msg)
        elif isinstance(msg, UtilityResult):
            future = self._calls.get(msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg)
            if msg.stats is not None and self.metrics is not None:
                self.metrics.observe_stats(msg.stats, self.index)
        elif isinstance(msg, EngineReady):
            self.life.on_ready(msg)
            if self.healthy and msg.epoch == self.epoch and self.process is not None:
                self.process.engine_ready()
        elif isinstance(msg, EnginePulse):
            if msg.epoch == self.epoch:
                self.last_pulse = time.monotonic()
        elif isinstance(msg, EngineStarted):
            if msg.epoch == self.epoch and (stream := self.streams.get(msg.request_id)) is not None:
                stream.started = True
        elif isinstance(msg, EngineDead):
            self.engine_down(f"{self.label} (epoch {msg.epoch}) died: {msg.error}" if self.ready else
                             f"{self.label} failed to start: {msg.error}", msg.epoch)  # fmt: skip

    def _on_outputs(self, msg: EngineOutputs) -> None:
        metrics = self.metrics
        if msg.stats is not None and metrics is not None:
            metrics.observe_stats(msg.stats, self.index)
        stopped: list[str] = []
        generated = 0
        for out in msg.outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:  # aborted or already ended by a stop string
                continue
            previous_time, num_before = stream.last_token_time, len(stream.output_token_ids)
            if stream.on_output(out):
                stopped.append(out.request_id)
            if metrics is not None:
                num_new = len(stream.output_token_ids) - num_before
                metrics.observe_output(stream, num_new, previous_time)
                generated += num_new
            if stream.finished:
                del self.streams[out.request_id]
        if metrics is not None:
            metrics.observe_generated(generated, self.index)  # once per step: a counter's lock per request cost
        self.abort(stopped)  # a stop string ended these in the frontend; the engine still runs them

    # ---- supervision ----

    async def supervise(self, ready_timeout: float, stopping: asyncio.Event) -> str | None:
        """Replaces this engine each time it goes down while its budget allows. Returns why not any more (the
        budget is spent: the caller retires it with give_up), or None when there is nothing left to do."""
        budget = self.budget
        assert budget is not None and self.process is not None
        while True:
            cause = await self.life.wait_down()
            if self.ready is None:
                return None  # it never started: start() reports that
            if stopping.is_set():
                self.life.give_up(f"{cause} (not restarted: the server is shutting down)")
                return None
            if not budget.take():
                log.error("%s down: %s; already restarted %d times within %g s (--max-engine-restarts)", self.label,
                          cause, budget.used, budget.window)  # fmt: skip
                return cause
            self.restarts += 1
            if self.metrics is not None:
                self.metrics.engine_restarts[self.index].inc()
            log.warning("%s down: %s; starting epoch %d (restart %d of %d within %g s), %d requests waiting to "
                        "resume", self.label, cause, self.epoch + 1, budget.used, budget.max_restarts, budget.window,
                        len(self.streams))  # fmt: skip
            await self.life.restart(ready_timeout)
