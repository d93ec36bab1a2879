"""EngineWatch: notices an engine core that is gone (process exit, socket disconnect) or hung (no ping answer)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.messages import EngineReady, UtilityResult
from frontend.engine.supervisor import EngineSupervisor
from frontend.errors import EngineUnavailable

PROCESS_POLL_S = 0.1  # how soon a vanished engine process is noticed when no disconnect says so first
PING_INTERVAL_S = 1.0
WAIT_CHECK_S = 0.25  # how often an unanswered health call checks for pulses and its timeout
# Outputs the engine pushed just before it went (an EngineDead saying why) are read before the down is declared.
LAST_WORDS_S = 0.05


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Watched(Protocol):
    """What the watch needs of the engine it watches (an EngineHandle)."""

    label: str  # "engine core", or "engine core 1" among several, for log lines and errors
    epoch: int
    ready: EngineReady | None
    process: EngineSupervisor | None
    ping_timeout: float
    last_pulse: float  # time.monotonic() of the current epoch's last EnginePulse

    @property
    def healthy(self) -> bool: ...
    def is_up_or_starting(self, epoch: int) -> bool: ...
    def engine_down(self, reason: str, epoch: int, crashed: bool = True) -> None: ...
    async def call(self, method: str, arg: float = 0.0, timeout: float | None = None) -> UtilityResult: ...


class EngineWatch:
    """Three tasks per engine; each reports to engine.engine_down(reason, epoch), which ignores all but the first
    per epoch."""

    def __init__(self, engine: Watched, monitor: zmq.asyncio.Socket) -> None:
        self.engine = engine
        self.monitor = monitor

    def coroutines(self) -> list[Coroutine[Any, Any, None]]:
        jobs = [self.watch_disconnects(), self.ping()]
        return [*jobs, self.watch_process()] if self.engine.process is not None else jobs

    async def watch_disconnects(self) -> None:
        """The output PULL's socket monitor: the engine's PUSH connection closing means its process is gone."""
        epochs: dict[int, int] = {}  # connection fd -> epoch it connected in; a late old disconnect is not news
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                epochs[fd] = self.engine.epoch
            elif event["event"] == zmq.EVENT_DISCONNECTED and (epoch := epochs.pop(fd, None)) is not None:
                await asyncio.sleep(LAST_WORDS_S)
                why = f"{self.engine.label} (epoch {epoch}) disconnected{self._exit_note(epoch)}"
                self.engine.engine_down(why, epoch)

    def _exit_note(self, epoch: int) -> str:
        process = self.engine.process
        if process is None or process.epoch != epoch or (code := process.exit_code()) is None:
            return ""
        return f": it {describe_exit(code)}"

    async def watch_process(self) -> None:
        """Process polling: covers a death the socket monitor cannot see (an engine that never connected); and a
        ready engine's dead spare is replaced."""
        process = self.engine.process
        assert process is not None
        while True:
            await asyncio.sleep(PROCESS_POLL_S)
            epoch, code = process.epoch, process.exit_code()
            if code is None and self.engine.healthy:
                process.replace_dead_spare()
            if code is None or not self.engine.is_up_or_starting(epoch):
                continue
            await asyncio.sleep(0.5)  # an EngineDead sent just before exiting says why; let it arrive
            what = "before it was ready" if self.engine.ready is None else "unexpectedly"
            self.engine.engine_down(f"{self.engine.label} (epoch {epoch}) {describe_exit(code)} {what}", epoch)

    async def ping(self) -> None:
        """A hung engine (alive, connected, not stepping) answers no health call: it is as dead as a gone one. One
        in a long step answers only after it, but sends pulses meanwhile (engine_core/pulse.py): the engine is hung
        when neither an answer nor a pulse came within the timeout."""
        engine = self.engine
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            if not engine.healthy:
                continue
            epoch, sent = engine.epoch, time.monotonic()
            call = asyncio.ensure_future(engine.call("health"))
            try:
                while not call.done():
                    await asyncio.wait([call], timeout=WAIT_CHECK_S)
                    if not call.done() and time.monotonic() - max(sent, engine.last_pulse) > engine.ping_timeout:
                        call.cancel()
                        engine.engine_down(f"{self.engine.label} (epoch {epoch}) did not answer a health check "
                                           f"within {engine.ping_timeout:g} s", epoch, crashed=False)  # fmt: skip
            finally:
                call.cancel()  # a no-op once it is done; this task's own cancellation leaves no call behind
            with contextlib.suppress(asyncio.CancelledError, EngineUnavailable):
                call.result()
