"""AsyncEngineClient: the API process's side of the ZMQ link to one or more engine cores (data parallel): routes each
request to an engine handle, runs the one output loop over every engine's output socket, and waits for engines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator

import msgspec
import zmq
import zmq.asyncio

from common import ipc
from common.config import EngineConfig
from common.messages import EngineReady, EngineRequest, LoraRef, UtilityResult
from frontend.engine.engine_handle import EngineHandle
from frontend.engine.placement import place_engines
from frontend.engine.recovery import ENGINE_GONE
from frontend.engine.request_stream import Delta, RequestStream
from frontend.engine.router import PrefixRouter
from frontend.engine.spawn import EngineStartError
from frontend.engine.stream_pacing import StreamPacing
from frontend.engine.supervisor import EngineSupervisor
from frontend.errors import EngineUnavailable
from frontend.metrics import Metrics
from frontend.text.detokenizer import IncrementalDetokenizer

log = logging.getLogger("roseinfer.frontend")
__all__ = ["AsyncEngineClient", "EngineUnavailable", "QueueFull"]


class QueueFull(RuntimeError):
    """More requests in flight than --max-queued-requests allows (HTTP 429)."""


class AsyncEngineClient:
    """Also the asyncio direct client: `await AsyncEngineClient.spawn(EngineConfig(...))` needs no HTTP.

    `processes` gives one engine per entry (None: an engine someone else started, index 0, tests)."""

    def __init__(self, addresses: ipc.Addresses, processes: list[EngineSupervisor | None] | None = None,
                 ping_timeout: float = 30.0, max_queued: int = 1 << 30,
                 metrics: Metrics | None = None) -> None:  # fmt: skip
        self.addresses = addresses
        self.max_queued = max_queued
        self.restart_timeout = 0.0  # how long a new request waits for a restarting engine
        self._ctx = zmq.asyncio.Context()
        # Sends go through a plain socket: never blocks (no HWM), and works from `finally` blocks of
        # cancelled tasks, where an await would be cancelled again.
        self._router = ipc.make_socket(self._ctx, zmq.ROUTER, addresses.input, bind=True)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable engine raises, never drops silently
        self._input = zmq.Socket.shadow(self._router.underlying)
        self._changed = asyncio.Event()  # an engine became ready, went down or was given up
        processes = processes or [None]
        several = len(processes) > 1
        # LoRA adapters the API unloaded (or replaced, or failed to load) that an engine may hold: each restarted
        # engine is told to unload them (frontend/api/lora_adapters.py adds to it before it calls the live ones).
        self.retired_loras: list[LoraRef] = []
        self.handles: list[EngineHandle] = []
        for i, process in enumerate(processes):
            out = ipc.make_socket(self._ctx, zmq.PULL, addresses.of_engine(i).output, bind=True)
            label = f"engine core {i}" if several else "engine core"
            self.handles.append(EngineHandle(i, label, out, self._send, process, self._changed.set, ping_timeout,
                                             self.retired_loras))  # fmt: skip
        self.router: PrefixRouter | None = None  # several engines: set once the block size is known
        self.metrics = metrics
        self.request_log: Callable[[EngineRequest, int], None] | None = None  # --enable-log-requests: (request, engine)
        self.output_log: Callable[[RequestStream], None] | None = None  # --enable-log-outputs: each ended request
        self.pacing = StreamPacing(lambda: self.num_in_flight)  # many streams: several tokens per consumer wakeup
        self._tasks: list[asyncio.Task] = []
        self._num_added = 0  # makes each engine request id unique (add)

    @classmethod
    async def spawn(cls, config: EngineConfig, ready_timeout: float = 600.0, data_parallel_size: int = 1,
                    **kw) -> AsyncEngineClient:  # fmt: skip
        addresses = ipc.Addresses.new_ipc()
        client = cls(addresses, supervisors(config, addresses, data_parallel_size), **kw)
        try:
            await client.start(ready_timeout)
        except BaseException:
            await client.close()
            raise
        return client

    async def start(self, ready_timeout: float) -> EngineReady:
        """Spawns the engines, starts the output and liveness tasks, waits for every EngineReady."""
        futures = [h.life.expect_ready() for h in self.handles]
        self._tasks = [asyncio.create_task(self._read_outputs())]
        self._tasks += [asyncio.create_task(c) for h in self.handles for c in h.coroutines()]
        for handle in self.handles:
            if handle.process is not None:
                handle.process.spawn()
        try:
            ready = await asyncio.wait_for(asyncio.shield(asyncio.gather(*futures)), ready_timeout)
        except TimeoutError:
            raise EngineStartError(f"engine core not ready after {ready_timeout:.0f} s") from None
        if len(self.handles) > 1:
            self.router = PrefixRouter(ready[0].block_size)
        return ready[0]

    # ---- the whole (what /health, serving and launch.py ask) ----

    @property
    def metrics(self) -> Metrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Metrics | None) -> None:
        self._metrics = metrics
        for handle in self.handles:
            handle.metrics = metrics

    @property
    def resumable(self) -> bool:
        return any(h.life.resumable for h in self.handles)

    @resumable.setter
    def resumable(self, value: bool) -> None:
        for handle in self.handles:
            handle.life.resumable = value

    @property
    def ping_timeout(self) -> float:
        return self.handles[0].ping_timeout

    @ping_timeout.setter
    def ping_timeout(self, value: float) -> None:
        for handle in self.handles:
            handle.ping_timeout = value

    @property
    def supervisor(self) -> EngineSupervisor | None:
        return self.handles[0].process

    @property
    def ready(self) -> EngineReady | None:
        return next((h.ready for h in self.handles if h.ready is not None), None)

    @property
    def healthy(self) -> bool:
        """At least one engine takes requests."""
        return any(h.healthy for h in self.handles)

    @property
    def dead(self) -> str | None:
        """Why no engine takes requests now; None while one does."""
        if self.healthy:
            return None
        return next((h.dead for h in self.handles if h.dead is not None), None)

    @property
    def num_in_flight(self) -> int:
        return sum(len(h.streams) for h in self.handles)

    def in_flight(self) -> Iterator[RequestStream]:
        return (stream for h in self.handles for stream in h.streams.values())

    # ---- requests ----

    def check_capacity(self, num_requests: int) -> None:
        if not self.healthy:
            raise EngineUnavailable(self.dead or "the engine core is not ready")
        if self.num_in_flight + num_requests > self.max_queued:
            raise QueueFull(f"too many requests in flight (--max-queued-requests {self.max_queued})")

    async def wait_available(self) -> None:
        """A new request arriving while no engine serves waits for one to come back, up to restart_timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.restart_timeout
        while not self.healthy and self.resumable:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - loop.time()))
            if loop.time() >= deadline:
                break
        if not self.healthy and self.resumable:
            raise EngineUnavailable(f"the engine core is restarting and was not back within "
                                    f"{self.restart_timeout:g} s ({self.dead})")  # fmt: skip

    def engine_of(self, stream: RequestStream) -> EngineHandle | None:
        """The engine `stream` is in flight on (or waits for); None once it has ended."""
        return next((h for h in self.handles if h.streams.get(stream.request_id) is stream), None)

    def add(self, request: EngineRequest, detokenizer: IncrementalDetokenizer | None = None,
            include_stop_token: bool = False) -> RequestStream:  # fmt: skip
        """Sends the request under an engine id of its own, `<its id>#<n>` (the stream's request_id): a client's
        id (X-Request-Id) may come again (a retry) while the engine still runs or reports the aborted first try."""
        self.check_capacity(1)
        self._num_added += 1
        request = msgspec.structs.replace(request, request_id=f"{request.request_id}#{self._num_added}")
        stream = RequestStream(request, detokenizer, include_stop_token, self.pacing)
        stream.on_finish = self.output_log
        live = [h for h in self.handles if h.healthy]  # a dead engine takes nothing new while it restarts
        while True:
            scope = (request.lora.id if request.lora is not None else 0, request.cache_salt)
            handle = live[0] if self.router is None else self.router.choose(request.prompt_token_ids, live, scope)
            live.remove(handle)
            # An engine that refuses the send died a moment ago: another live one takes it, else it waits there.
            if handle.add(stream, park=not live):
                break
        if self.metrics is not None:
            self.metrics.observe_prompt(len(request.prompt_token_ids), handle.index)
        if self.request_log is not None:
            self.request_log(request, handle.index)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Forgets the requests (streams' request_id: the engine ids) and tells their engines to free them (before
        the next step). Never awaits."""
        for handle in self.handles:
            unfinished = [rid for rid in request_ids if (s := handle.streams.pop(rid, None)) and not s.finished]
            handle.abort(unfinished)

    async def generate(self, request: EngineRequest, detokenizer: IncrementalDetokenizer | None = None,
                       include_stop_token: bool = False) -> AsyncIterator[Delta]:  # fmt: skip
        """Yields merged deltas until the request finishes; closing it early (aclose) aborts the request."""
        stream = self.add(request, detokenizer, include_stop_token)
        try:
            async for delta in stream:
                yield delta
        finally:
            if not stream.finished:
                self.abort([stream.request_id])

    async def call(self, method: str, arg: float = 0.0, timeout: float | None = None, engine: int = 0,
                   lora: LoraRef | None = None) -> UtilityResult:  # fmt: skip
        return await self.handles[engine].call(method, arg, timeout, lora)

    async def refresh_stats(self, timeout: float) -> None:
        """Fresh scheduler numbers from every live engine into the metrics (no step runs while one is idle)."""
        calls = [h.call("stats", timeout=timeout) for h in self.handles if h.healthy]
        await asyncio.gather(*calls, return_exceptions=True)

    def fail_all(self, error: str) -> None:
        """Ends every in-flight request with `error` (its consumer sees finish_reason "error")."""
        for handle in self.handles:
            handle.life.fail_all(error, ENGINE_GONE)

    def _send(self, identity: bytes, data: bytes) -> None:
        self._input.send_multipart([identity, data])

    # ---- the output loop: the only reader of engine outputs, over every engine's socket ----

    async def _read_outputs(self) -> None:
        if len(self.handles) == 1:
            handle = self.handles[0]
            while True:
                self._dispatch(handle, await handle.output.recv(copy=False))
        poller = zmq.asyncio.Poller()
        owners = {}
        for handle in self.handles:
            poller.register(handle.output, zmq.POLLIN)
            owners[handle.output] = (handle, zmq.Socket.shadow(handle.output.underlying))
        while True:
            for sock, _ in await poller.poll():
                handle, plain = owners[sock]
                with contextlib.suppress(zmq.Again):  # drain: the socket's fd only signals new arrivals
                    while True:
                        self._dispatch(handle, plain.recv(zmq.NOBLOCK, copy=False))

    def _dispatch(self, handle: EngineHandle, frame: zmq.Frame) -> None:
        try:
            msg = ipc.decode_output(frame.buffer)
        except Exception:  # a malformed message is dropped, not fatal to the server
            log.exception("undecodable message from the %s", handle.label)
            return
        if isinstance(msg, EngineReady) and self.router is not None and handle.ready is not None:
            self.router.forget(handle.index)  # a restarted engine's prefix cache is empty
        handle.on_message(msg)

    async def close(self) -> None:
        """Stops the tasks and the engine processes, closes the sockets, removes the ipc files."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for handle in self.handles:
            handle.life.close()
        self._changed.set()
        await asyncio.gather(*(asyncio.to_thread(h.process.close, 10.0) for h in self.handles if h.process))
        for handle in self.handles:
            handle.output.disable_monitor()
            handle.monitor.close(0)
            handle.output.close(0)
        self._router.close(0)
        self._ctx.term()
        self.addresses.cleanup()


def supervisors(config: EngineConfig, addresses: ipc.Addresses, data_parallel_size: int,
                keep_spares: bool = False) -> list[EngineSupervisor | None]:  # fmt: skip
    """One engine process per data-parallel rank, each placed on its own cores (and GPU), each with a warm spare
    for its restarts if asked (supervisor.py)."""
    return [EngineSupervisor(p.config, addresses.of_engine(p.config.engine_index), p.cpus, p.env, keep_spares)
            for p in place_engines(config, data_parallel_size)]  # fmt: skip
