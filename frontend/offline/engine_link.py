"""Talking to an engine core over ZMQ directly, with no HTTP or asyncio: the offline LLM, tests and tools."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable

import zmq

from common import ipc
from common.config import EngineConfig
from common.messages import (
    AbortRequest,
    EngineDead,
    EngineMessage,
    EngineOutput,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    UtilityCall,
    UtilityResult,
)
from common.python_command import STOP_SIGNAL
from frontend.engine.spawn import EngineStartError, spawn_engine


class EngineLink:
    """Binds the frontend side of the sockets; engines connect. Synchronous; one user thread."""

    def __init__(self, addresses: ipc.Addresses | None = None, ctx: zmq.Context | None = None) -> None:
        self.addresses = addresses or ipc.Addresses.new_ipc()
        self.ctx = ctx or zmq.Context()
        self.input = ipc.make_socket(self.ctx, zmq.ROUTER, self.addresses.input, bind=True)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable engine raises, never drops silently
        self.output = ipc.make_socket(self.ctx, zmq.PULL, self.addresses.output, bind=True)
        self.identity = ipc.engine_identity(0)
        self._call_id = 0

    def send(self, msg: EngineRequest | AbortRequest | UtilityCall) -> None:
        self.input.send_multipart([self.identity, ipc.encode(msg)])

    def recv(self, timeout: float | None = None) -> EngineMessage | None:
        if timeout is not None and not self.output.poll(int(timeout * 1000)):
            return None
        return ipc.decode_output(self.output.recv())

    def close(self) -> None:
        self.input.close(0)
        self.output.close(0)
        self.addresses.cleanup()


class EngineClient(EngineLink):
    """Spawns its own engine core and offers blocking helpers on top of the raw link."""

    def __init__(self, config: EngineConfig, ready_timeout: float = 600.0) -> None:
        super().__init__()
        self.config = config
        self.proc = spawn_engine(config, self.addresses)
        self.ready = self._wait_ready(ready_timeout)
        self.pending: list[EngineOutputs] = []

    def _wait_ready(self, timeout: float) -> EngineReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.recv(timeout=0.2)
            if isinstance(msg, EngineReady):
                return msg
            if isinstance(msg, EngineDead):
                self.close()
                raise EngineStartError(f"engine core failed to start: {msg.error}")
            if self.proc.poll() is not None:
                self.close()
                raise EngineStartError(f"engine core exited with code {self.proc.returncode} before it was ready")
        self.close()
        raise EngineStartError(f"engine core not ready after {timeout:.0f} s")

    def call(self, method: str, arg: float = 0.0, timeout: float = 30.0) -> UtilityResult:
        """A utility call; step outputs that arrive meanwhile are kept for next_outputs()."""
        self._call_id += 1
        self.send(UtilityCall(self._call_id, method, arg))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(timeout=left)
            if isinstance(msg, UtilityResult) and msg.call_id == self._call_id:
                return msg
            if isinstance(msg, EngineOutputs):
                self.pending.append(msg)
        raise TimeoutError(f"no answer to {method!r} within {timeout} s")

    def next_outputs(self, timeout: float = 60.0) -> EngineOutputs:
        if self.pending:
            return self.pending.pop(0)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(timeout=left)
            if isinstance(msg, EngineOutputs):
                return msg
            if isinstance(msg, EngineDead):
                raise RuntimeError(f"engine core died: {msg.error}")
        raise TimeoutError(f"no engine output within {timeout} s")

    def generate(self, requests: Iterable[EngineRequest], timeout: float = 600.0) -> dict[str, list[EngineOutput]]:
        """Sends all requests, then collects every output until each one has finished."""
        results: dict[str, list[EngineOutput]] = {}
        for req in requests:
            results[req.request_id] = []
            self.send(req)
        open_ids = set(results)
        deadline = time.monotonic() + timeout
        while open_ids:
            for out in self.next_outputs(timeout=max(deadline - time.monotonic(), 0.001)).outputs:
                if out.request_id in results:
                    results[out.request_id].append(out)
                    if out.finished:
                        open_ids.discard(out.request_id)
        return results

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(STOP_SIGNAL)  # it ignores SIGTERM while we live
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def token_ids(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]
