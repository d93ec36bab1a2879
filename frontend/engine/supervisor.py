"""EngineSupervisor: one engine-core process, (re)spawned with an epoch where it is placed; RestartBudget: how often."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import subprocess
import time

from common import ipc
from common.config import EngineConfig
from common.python_command import STOP_SIGNAL
from frontend.engine.spawn import spawn_engine


class EngineSupervisor:
    def __init__(self, config: EngineConfig, addresses: ipc.Addresses, cpus: frozenset[int] | None = None,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.config = config
        self.addresses = addresses
        self.cpus = cpus  # the engine's CPU affinity (data parallel: its own cores)
        self.env = env or {}
        self.epoch = config.epoch  # of the process in self.proc (or the next one to spawn)
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        """Starts the engine core for the current epoch. Call it from the main thread: the child gets
        SIGTERM (PR_SET_PDEATHSIG) when the *thread* that spawned it exits."""
        assert self.proc is None or self.proc.poll() is not None, "an engine core is already running"
        # Ctrl+C in a terminal signals the whole process group. The engine must not die with it: the API
        # drains in-flight requests first, then stops the engine itself. An ignored SIGINT survives exec (a
        # SIGTERM to the group the engine ignores itself, spawn_engine).
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        # A child inherits the spawning thread's affinity: set for the fork, so the engine never runs (or sizes
        # its thread pool) on another engine's cores, then ours is restored.
        ours = os.sched_getaffinity(0) if self.cpus else None
        try:
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)
            self.proc = spawn_engine(dataclasses.replace(self.config, epoch=self.epoch), self.addresses, self.env)
        finally:
            if ours is not None:
                os.sched_setaffinity(0, ours)
            signal.signal(signal.SIGINT, previous)

    def respawn(self, epoch: int) -> None:
        """A replacement with the same configuration and a new epoch; the old process must be gone (stop())."""
        self.epoch = epoch
        self.spawn()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        """None while the engine process runs (or was never started)."""
        return self.proc.poll() if self.proc is not None else None

    def kill(self) -> None:
        """SIGKILL without waiting: a hung (or stopped) engine honours nothing else."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def stop(self, timeout: float = 10.0) -> None:
        """STOP_SIGNAL (the engine exits its loop cleanly), then SIGKILL if it does not go in time; reaps it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(STOP_SIGNAL)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RestartBudget:
    """At most `max_restarts` restarts in any `window` seconds; 0 turns restarts off."""

    def __init__(self, max_restarts: int, window: float) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self._times: collections.deque[float] = collections.deque()

    def take(self, now: float | None = None) -> bool:
        """Spends one restart if the window has one left."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    @property
    def used(self) -> int:
        return len(self._times)
