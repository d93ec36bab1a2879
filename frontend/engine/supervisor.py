"""EngineSupervisor: one engine-core process, (re)spawned with an epoch where it is placed, and its warm spare;
RestartBudget: how often."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import time

from common import ipc
from common.config import EngineConfig
from common.python_command import STOP_SIGNAL
from frontend.engine.spawn import spawn_engine

log = logging.getLogger("roseinfer.frontend")


class EngineSupervisor:
    """With `keep_spare`, a second process waits beside the engine, its imports done (engine_core/standby.py), and
    a restart gives it the new epoch instead of starting cold: the replacement is up seconds sooner. Not under
    tensor parallelism, whose workers would still start cold."""

    def __init__(self, config: EngineConfig, addresses: ipc.Addresses, cpus: frozenset[int] | None = None,
                 env: dict[str, str] | None = None, keep_spare: bool = False) -> None:  # fmt: skip
        self.config = config
        self.addresses = addresses
        self.cpus = cpus  # the engine's CPU affinity (data parallel: its own cores)
        self.env = env or {}
        self.epoch = config.epoch  # of the process in self.proc (or the next one to spawn)
        self.proc: subprocess.Popen | None = None
        self.keep_spare = keep_spare and config.tensor_parallel_size == 1 and config.nnodes == 1
        self.spare: subprocess.Popen | None = None
        self._spare_replaced_at: int | None = None  # the epoch whose dead spare was replaced

    def spawn(self) -> None:
        """Starts the engine core for the current epoch, from the spare when one is alive. Call it from the main
        thread: the child gets SIGTERM (PR_SET_PDEATHSIG) when the *thread* that spawned it exits."""
        assert self.proc is None or self.proc.poll() is not None, "an engine core is already running"
        self.proc = self._promote_spare() or self._start(standby=False)

    def engine_ready(self) -> None:
        """The engine is up: a spare for its next restart starts now (never beside a start, and it waits before it
        warms up: engine_core/standby.py). From the main thread, as spawn()."""
        if self.keep_spare and (self.spare is None or self.spare.poll() is not None):
            try:
                self.spare = self._start(standby=True)
            except OSError as exc:  # only a restart's head start is lost
                log.warning("cannot start a spare engine process: %s", exc)

    def replace_dead_spare(self) -> None:
        """A spare that died while its engine serves (killed, out of memory) is reaped and replaced, once per engine
        epoch: the next restart still starts warm, and a spare that cannot live is not started over and over. From
        the main thread, while the engine is ready."""
        spare = self.spare
        if spare is None or spare.poll() is None:  # poll() also reaps it
            return
        _discard(spare)  # its pipe closed
        self.spare = None
        if self._spare_replaced_at != self.epoch:
            self._spare_replaced_at = self.epoch
            log.warning("the spare engine process %d exited (code %d); starting another", spare.pid, spare.returncode)
            self.engine_ready()

    @property
    def spare_pid(self) -> int | None:
        return self.spare.pid if self.spare is not None and self.spare.poll() is None else None

    def _promote_spare(self) -> subprocess.Popen | None:
        spare, self.spare = self.spare, None
        if spare is None or spare.poll() is not None or spare.stdin is None:
            return None
        try:
            spare.stdin.write(f"{self.epoch}\n".encode())
            spare.stdin.close()
        except OSError:  # it died meanwhile
            _discard(spare)
            return None
        log.info("engine core epoch %d starts from the spare process %d", self.epoch, spare.pid)
        return spare

    def _start(self, standby: bool) -> subprocess.Popen:
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
            config = dataclasses.replace(self.config, epoch=self.epoch)  # a spare is told its own when promoted
            return spawn_engine(config, self.addresses, self.env, standby)
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

    def discard_spare(self) -> None:
        """No restart will come (the engine is retired, or the server stops): the spare goes, and no new one."""
        self.keep_spare = False
        if self.spare is not None:
            _discard(self.spare)
            self.spare = None

    def close(self, timeout: float = 10.0) -> None:
        self.discard_spare()
        self.stop(timeout)

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


def _discard(spare: subprocess.Popen) -> None:
    """A spare holds nothing worth a clean stop: SIGKILL, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        spare.kill()
    spare.wait()
    with contextlib.suppress(OSError):  # a write to it may still wait in the buffer: its pipe is broken
        if spare.stdin is not None:
            spare.stdin.close()


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
