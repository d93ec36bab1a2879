"""ZMQ addresses (unique per run, removed on exit), socket construction, and the wire codecs."""

from __future__ import annotations

import os
import shutil
import tempfile
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


@dataclass(frozen=True)
class Addresses:
    """The two endpoints of one frontend/engine pair. The frontend binds both; engines connect."""

    input: str
    output: str
    run_dir: str | None = None  # removed by cleanup() when ipc://

    @staticmethod
    def new_ipc() -> Addresses:
        run_dir = tempfile.mkdtemp(prefix="roseinfer-")
        return Addresses(f"ipc://{run_dir}/in", f"ipc://{run_dir}/out", run_dir)

    def cleanup(self) -> None:
        if self.run_dir and os.path.isdir(self.run_dir):
            shutil.rmtree(self.run_dir, ignore_errors=True)


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
