"""ZMQ addresses (unique per run, removed on exit), socket construction, and the wire codecs."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import msgspec
import zmq

from common.messages import EngineInput, EngineMessage

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_output_decoder = msgspec.msgpack.Decoder(EngineMessage)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> EngineInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> EngineMessage:
    return _output_decoder.decode(data)


RUN_DIR_PREFIX = "roseinfer-"
OWNER_FILE = "owner.pid"  # "PID PID-NAMESPACE" of the process that created the run directory
STALE_AGE = 86400.0  # seconds: a run directory without an owner file (an older version's) is stale after this


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


def write_owner(run_dir: str, pid: int) -> None:
    with open(os.path.join(run_dir, OWNER_FILE), "w") as f:
        f.write(f"{pid} {_pid_namespace()}\n")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _is_stale(run_dir: str, max_age: float) -> bool:
    try:
        with open(os.path.join(run_dir, OWNER_FILE)) as f:
            owner = f.read().split()
    except FileNotFoundError:
        owner = []
    except OSError:  # another user's directory (mode 0700): not ours to judge
        return False
    if len(owner) == 2 and owner[0].isdigit() and int(owner[0]) > 0:
        # A pid from another pid namespace (a /tmp shared between containers) says nothing about liveness here.
        return owner[1] == _pid_namespace() and not _pid_alive(int(owner[0]))
    # No complete owner file: an older version's directory, or one whose owner is writing it right now.
    try:
        return time.time() - os.stat(run_dir).st_mtime > max_age
    except OSError:
        return False


def remove_run_dir(run_dir: str | None) -> None:
    """Removes a run directory; refuses any path that is not one (a mistyped --run-dir must not delete a tree)."""
    if run_dir and os.path.basename(os.path.normpath(run_dir)).startswith(RUN_DIR_PREFIX):
        shutil.rmtree(run_dir, ignore_errors=True)


def sweep_stale_run_dirs(tmp_dir: str | None = None, max_age: float = STALE_AGE) -> list[str]:
    """Removes the run directories left by servers that died without cleaning up (SIGKILL, OOM, power loss),
    never a live run's: several servers and tests may share the temp directory. Returns the removed paths."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(tmp_dir or tempfile.gettempdir()) as entries:
        for entry in entries:
            is_run_dir = entry.name.startswith(RUN_DIR_PREFIX) and entry.is_dir(follow_symlinks=False)
            if is_run_dir and _is_stale(entry.path, max_age):
                remove_run_dir(entry.path)
                removed.append(entry.path)
    return removed


@dataclass(frozen=True)
class Addresses:
    """The two endpoints of one frontend/engine pair. The frontend binds both; engines connect."""

    input: str
    output: str
    run_dir: str | None = None  # removed by cleanup() when ipc://

    @staticmethod
    def new_ipc() -> Addresses:
        sweep_stale_run_dirs()
        run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
        write_owner(run_dir, os.getpid())
        return Addresses(f"ipc://{run_dir}/in", f"ipc://{run_dir}/out", run_dir)

    def of_engine(self, index: int) -> Addresses:
        """Engine `index`'s (data parallel): the shared input ROUTER, an output socket of its own (the engine needs no
        index in its messages, and the socket monitor tells which engine's connection dropped)."""
        output = self.output if index == 0 else f"{self.output}{index}"
        return Addresses(self.input, output, self.run_dir)

    def cleanup(self) -> None:
        remove_run_dir(self.run_dir)


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool, identity: bytes | None = None):
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: flow control is the scheduler's job, and a dropped output would lose tokens.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # A restarted engine reuses its identity: hand the route over to the new connection.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def engine_identity(index: int) -> bytes:
    return index.to_bytes(2, "little")
