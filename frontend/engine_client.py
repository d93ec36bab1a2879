"""AsyncEngineClient: the API process's side of the ZMQ link: send, the single output task, streams, liveness."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from common import ipc
from common.config import EngineConfig
from common.engine_link import EngineStartError
from common.messages import (
    AbortRequest,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    UtilityCall,
    UtilityResult,
)
from frontend.detokenizer import IncrementalDetokenizer
from frontend.errors import EngineUnavailable
from frontend.liveness import EngineWatch
from frontend.metrics import Metrics
from frontend.recovery import EngineRecovery
from frontend.request_stream import Delta, RequestStream
from frontend.supervisor import EngineSupervisor

log = logging.getLogger("roseinfer.frontend")
__all__ = ["AsyncEngineClient", "EngineUnavailable", "QueueFull"]


class QueueFull(RuntimeError):
    """More requests in flight than --max-queued-requests allows (HTTP 503)."""


class AsyncEngineClient(EngineRecovery):
    """Also the asyncio direct client: `await AsyncEngineClient.spawn(EngineConfig(...))` needs no HTTP."""

    def __init__(self, addresses: ipc.Addresses, supervisor: EngineSupervisor | None = None, ping_timeout: float = 30.0,
                 max_queued: int = 1 << 30, metrics: Metrics | None = None) -> None:  # fmt: skip
        self.addresses = addresses
        self.supervisor = supervisor
        self.ping_timeout = ping_timeout
        self.max_queued = max_queued
        self.metrics = metrics
        self.resumable = False
        self.restart_timeout = 0.0  # how long a new request waits for a restarting engine
        self._ctx = zmq.asyncio.Context()
        # Sends go through a plain socket: never blocks (no HWM), and works from `finally` blocks of
        # cancelled tasks, where an await would be cancelled again.
        self._router = ipc.make_socket(self._ctx, zmq.ROUTER, addresses.input, bind=True)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable engine raises, never drops silently
        self._input = zmq.Socket.shadow(self._router.underlying)
        self._output = ipc.make_socket(self._ctx, zmq.PULL, addresses.output, bind=True)
        self._monitor = self._output.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._identity = ipc.engine_identity(supervisor.config.engine_index if supervisor else 0)
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}
        self._call_id = 0
        self._tasks: list[asyncio.Task] = []
        self._ready_future: asyncio.Future[EngineReady] | None = None
        self.ready: EngineReady | None = None
        self.epoch = supervisor.epoch if supervisor else 0
        self.dead: str | None = None
        self._down_epoch: int | None = None
        self._down = asyncio.Event()
        self._settled = asyncio.Event()
        self._closing = False

    @classmethod
    async def spawn(cls, config: EngineConfig, ready_timeout: float = 600.0, **kw) -> AsyncEngineClient:
        addresses = ipc.Addresses.new_ipc()
        client = cls(addresses, EngineSupervisor(config, addresses), **kw)
        try:
            await client.start(ready_timeout)
        except BaseException:
            await client.close()
            raise
        return client

    async def start(self, ready_timeout: float) -> EngineReady:
        """Spawns the engine (with a supervisor), starts the output and liveness tasks, waits for EngineReady."""
        self._ready_future = asyncio.get_running_loop().create_future()
        watch = EngineWatch(self, self._monitor)
        self._tasks = [asyncio.create_task(c) for c in (self._read_outputs(), *watch.coroutines())]
        if self.supervisor is not None:
            self.supervisor.spawn()
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready_future), ready_timeout)
        except TimeoutError:
            raise EngineStartError(f"engine core not ready after {ready_timeout:.0f} s") from None

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.dead is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ----

    def check_capacity(self, num_requests: int) -> None:
        if self.dead is not None:
            raise EngineUnavailable(self.dead)
        if self.ready is None:
            raise EngineUnavailable("the engine core is not ready")
        if len(self._streams) + num_requests > self.max_queued:
            raise QueueFull(f"too many requests in flight (--max-queued-requests {self.max_queued})")

    async def wait_available(self) -> None:
        """A new request arriving while the engine restarts waits for it, up to restart_timeout."""
        if self.healthy or not self.resumable:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), self.restart_timeout)
        if not self.healthy:
            raise EngineUnavailable(f"the engine core is restarting and was not back within "
                                    f"{self.restart_timeout:g} s ({self.dead})")  # fmt: skip

    def add(self, request: EngineRequest, detokenizer: IncrementalDetokenizer | None = None,
            include_stop_token: bool = False) -> RequestStream:  # fmt: skip
        self.check_capacity(1)
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        stream = RequestStream(request, detokenizer, include_stop_token)
        try:
            self._send(stream.mark_sent())
        except zmq.ZMQError as exc:
            if not self.resumable:
                raise EngineUnavailable(f"cannot reach the engine core: {exc}") from exc
            stream.sent_at = None  # it never got there: the next engine gets it
            self.engine_down(f"cannot reach the engine core: {exc}", self.epoch)
        self._streams[request.request_id] = stream
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Forgets the requests and tells the engine to free them (before its next step). Never awaits."""
        unfinished = [rid for rid in request_ids if (s := self._streams.pop(rid, None)) and not s.finished]
        if unfinished and self.dead is None:
            with contextlib.suppress(zmq.ZMQError):  # an unreachable engine has nothing left to free
                self._send(AbortRequest(unfinished))

    async def generate(self, request: EngineRequest, detokenizer: IncrementalDetokenizer | None = None,
                       include_stop_token: bool = False) -> AsyncIterator[Delta]:  # fmt: skip
        """Yields merged deltas until the request finishes; closing it early (aclose) aborts the request."""
        stream = self.add(request, detokenizer, include_stop_token)
        try:
            async for delta in stream:
                yield delta
        finally:
            if not stream.finished:
                self.abort([request.request_id])

    async def call(self, method: str, arg: float = 0.0, timeout: float | None = None) -> UtilityResult:
        if self.dead is not None:
            raise EngineUnavailable(self.dead)
        self._call_id += 1
        call_id = self._call_id
        future: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(UtilityCall(call_id, method, arg))
            return await asyncio.wait_for(future, timeout)
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"cannot reach the engine core: {exc}") from exc
        finally:
            self._calls.pop(call_id, None)

    def _send(self, msg: EngineRequest | AbortRequest | UtilityCall) -> None:
        self._input.send_multipart([self._identity, ipc.encode(msg)])

    # ---- the output task: the only loop over engine outputs ----

    async def _read_outputs(self) -> None:
        while True:
            frame = await self._output.recv(copy=False)
            try:
                msg = ipc.decode_output(frame.buffer)
            except Exception:  # a malformed message is dropped, not fatal to the server
                log.exception("undecodable engine message")
                continue
            if isinstance(msg, EngineOutputs):
                if msg.epoch == self.epoch:  # outputs of an older engine generation are stale
                    self._on_outputs(msg)
            elif isinstance(msg, UtilityResult):
                future = self._calls.get(msg.call_id)
                if future is not None and not future.done():
                    future.set_result(msg)
                if msg.stats is not None and self.metrics is not None:
                    self.metrics.observe_stats(msg.stats)
            elif isinstance(msg, EngineReady):
                self._on_ready(msg)
            elif isinstance(msg, EngineDead):
                self.engine_down(f"engine core (epoch {msg.epoch}) died: {msg.error}" if self.ready else
                                 f"engine core failed to start: {msg.error}", msg.epoch)  # fmt: skip

    def _on_outputs(self, msg: EngineOutputs) -> None:
        if msg.stats is not None and self.metrics is not None:
            self.metrics.observe_stats(msg.stats)
        stopped: list[str] = []
        for out in msg.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted or already ended by a stop string
                continue
            previous_time, num_before = stream.last_token_time, len(stream.output_token_ids)
            if stream.on_output(out):
                stopped.append(out.request_id)
            if self.metrics is not None:
                self.metrics.observe_output(stream, len(stream.output_token_ids) - num_before, previous_time)
            if stream.finished:
                del self._streams[out.request_id]
        if stopped:  # a stop string ended these in the frontend; the engine still runs them
            with contextlib.suppress(zmq.ZMQError):
                self._send(AbortRequest(stopped))

    async def close(self) -> None:
        """Stops the tasks and the engine process, closes the sockets, removes the ipc files."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.fail_all("the server is shutting down")
        self._settled.set()
        if self.supervisor is not None:
            await asyncio.to_thread(self.supervisor.stop, 10.0)
        self._output.disable_monitor()
        self._monitor.close(0)
        self._router.close(0)
        self._output.close(0)
        self._ctx.term()
        self.addresses.cleanup()
