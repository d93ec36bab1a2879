"""EngineWatch: notices an engine core that is gone (process exit, socket disconnect) or hung (no ping answer)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.errors import EngineUnavailable

if TYPE_CHECKING:
    from frontend.engine_client import AsyncEngineClient

PROCESS_POLL_S = 0.1  # how soon a vanished engine process is noticed when no disconnect says so first
PING_INTERVAL_S = 1.0
# Outputs the engine pushed just before it went (an EngineDead saying why) are read before the down is declared.
LAST_WORDS_S = 0.05


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class EngineWatch:
    """Three tasks; each reports to client.engine_down(reason, epoch), which ignores all but the first per epoch."""

    def __init__(self, client: AsyncEngineClient, monitor: zmq.asyncio.Socket) -> None:
        self.client = client
        self.monitor = monitor

    def coroutines(self) -> list[Coroutine[Any, Any, None]]:
        jobs = [self.watch_disconnects(), self.ping()]
        return [*jobs, self.watch_process()] if self.client.supervisor is not None else jobs

    async def watch_disconnects(self) -> None:
        """The output PULL's socket monitor: the engine's PUSH connection closing means its process is gone."""
        epochs: dict[int, int] = {}  # connection fd -> epoch it connected in; a late old disconnect is not news
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                epochs[fd] = self.client.epoch
            elif event["event"] == zmq.EVENT_DISCONNECTED and (epoch := epochs.pop(fd, None)) is not None:
                await asyncio.sleep(LAST_WORDS_S)
                self.client.engine_down(f"engine core (epoch {epoch}) disconnected{self._exit_note(epoch)}", epoch)

    def _exit_note(self, epoch: int) -> str:
        supervisor = self.client.supervisor
        if supervisor is None or supervisor.epoch != epoch or (code := supervisor.exit_code()) is None:
            return ""
        return f": it {describe_exit(code)}"

    async def watch_process(self) -> None:
        """Process polling: covers a death the socket monitor cannot see (an engine that never connected)."""
        supervisor = self.client.supervisor
        assert supervisor is not None
        while True:
            await asyncio.sleep(PROCESS_POLL_S)
            epoch, code = supervisor.epoch, supervisor.exit_code()
            if code is None or not self.client.is_up_or_starting(epoch):
                continue
            await asyncio.sleep(0.5)  # an EngineDead sent just before exiting says why; let it arrive
            what = "before it was ready" if self.client.ready is None else "unexpectedly"
            self.client.engine_down(f"engine core (epoch {epoch}) {describe_exit(code)} {what}", epoch)

    async def ping(self) -> None:
        """A hung engine (alive, connected, not stepping) answers no health call: it is as dead as a gone one."""
        client = self.client
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            if not client.healthy:
                continue
            epoch = client.epoch
            try:
                await client.call("health", timeout=client.ping_timeout)
            except TimeoutError:
                client.engine_down(f"engine core (epoch {epoch}) did not answer a health check within "
                                   f"{client.ping_timeout:g} s", epoch, crashed=False)  # fmt: skip
            except EngineUnavailable:
                continue
