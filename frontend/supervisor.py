"""EngineSupervisor: the engine-core process handle, (re)spawned with an epoch; the one place a restart will go."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import subprocess

from common import ipc
from common.config import EngineConfig
from common.engine_link import spawn_engine


class EngineSupervisor:
    def __init__(self, config: EngineConfig, addresses: ipc.Addresses) -> None:
        self.config = config
        self.addresses = addresses
        self.epoch = config.epoch
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        """Starts the engine core for the current epoch. Call it from the main thread: the child gets
        SIGTERM (PR_SET_PDEATHSIG) when the *thread* that spawned it exits."""
        assert self.proc is None or self.proc.poll() is not None, "an engine core is already running"
        # Ctrl+C in a terminal signals the whole process group. The engine must not die with it: the API
        # drains in-flight requests first, then stops the engine itself. An ignored SIGINT survives exec.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.proc = spawn_engine(dataclasses.replace(self.config, epoch=self.epoch), self.addresses)
        finally:
            signal.signal(signal.SIGINT, previous)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        """None while the engine process runs (or was never started)."""
        return self.proc.poll() if self.proc is not None else None

    def stop(self, timeout: float = 10.0, dying: bool = False) -> None:
        """SIGTERM (the engine exits its loop cleanly), then SIGKILL if it does not go in time; reaps it.
        `dying`: it already said it is going (EngineDead); let it finish its own exit first."""
        if self.proc is None:
            return
        if dying:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
