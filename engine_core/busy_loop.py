"""run_engine: the engine-core process. Socket threads around a busy loop that receives requests, steps the
EngineCore (engine_core/core.py) and sends each step's outputs; utility calls (health, stats, LoRA loads) are answered
between steps."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback

import zmq

from common import ipc
from common.config import EngineConfig
from common.messages import (
    AbortRequest,
    EngineDead,
    EngineOutputs,
    EngineRequest,
    EngineStarted,
    UtilityCall,
    UtilityResult,
)
from common.model_errors import ConfigError, ModelSourceError
from engine_core.core import EngineCore
from engine_core.memory_profile import KvCacheSizeError
from engine_core.pulse import start_pulses

log = logging.getLogger("roseinfer.engine")


def run_engine(config: EngineConfig, addresses: ipc.Addresses) -> int:
    """The engine-core process: socket threads around a busy loop that touches queues, and a socket of its own for
    the one message that cannot wait for the sender thread (EngineStarted)."""
    ctx = zmq.Context()
    inputs: queue.Queue = queue.Queue()
    outputs: queue.Queue = queue.Queue()
    stop = threading.Event()
    threading.Thread(target=_recv_loop, args=(ctx, addresses.input, config.engine_index, inputs, stop),
                     daemon=True).start()  # fmt: skip
    sender = threading.Thread(target=_send_loop, args=(ctx, addresses.output, outputs), daemon=True)
    sender.start()
    notices = ipc.make_socket(ctx, zmq.PUSH, addresses.output, bind=False)  # the busy loop's own, for EngineStarted
    epoch = config.epoch
    try:
        core = EngineCore(config)
        outputs.put(core.ready_message())
        start_pulses(core.runner.progress, outputs, epoch, stop)
        runner = core.runner
        dtype = str(runner.dtype).removeprefix("torch.")
        if runner.kv_dtype != runner.dtype:  # --kv-cache-dtype fp8
            dtype += f" (KV cache {str(runner.kv_dtype).removeprefix('torch.')})"
        tokens = runner.num_blocks * runner.block_size  # as vLLM says it: how many full-context requests fit at once
        log.info("engine core ready: %s, %s on %s, %d KV blocks (%d tokens; maximum concurrency for %d tokens per "
                 "request: %.2fx)", core.model_name, dtype, runner.device.type, runner.num_blocks, tokens,
                 core.max_model_len, tokens / core.max_model_len)  # fmt: skip
        _busy_loop(core, inputs, outputs, notices, epoch)
        code = 0
    except KeyboardInterrupt:
        code = 0
    except BaseException as exc:  # fatal: tell the frontend before going away
        # Memory that cannot hold the engine, or a model or flags it cannot serve, is the user's to fix, and the
        # message says how: no traceback for them.
        users = isinstance(exc, KvCacheSizeError | ModelSourceError | ConfigError)
        log.error("engine core died: %s", exc if users else traceback.format_exc())
        outputs.put(EngineDead(epoch, f"{type(exc).__name__}: {exc}"))
        code = 1
    outputs.put(None)
    sender.join(timeout=5)
    notices.close()
    stop.set()
    ctx.term()  # the recv thread's blocking recv fails with ETERM and closes its socket; destroy() would race it
    return code


def _busy_loop(core: EngineCore, inputs: queue.Queue, outputs: queue.Queue, notices: zmq.Socket, epoch: int) -> None:
    # Debug, opt-in (crash tests): a request whose prompt holds this token id kills the process when its first
    # step starts, as a poison would.
    crash_on = os.environ.get("ROSEINFER_DEBUG_CRASH_ON_TOKEN")
    crash_on_id = int(crash_on) if crash_on else None
    poisoned: set[str] = set()

    def announce_started(request_id: str) -> None:
        # From this thread on its own socket (5 us), not through the sender's queue (a thread handoff, 100 us):
        # out before the request's first step runs, so that a crash in that step can be blamed on it.
        notices.send(ipc.encode(EngineStarted(epoch, request_id)), copy=False)
        if request_id in poisoned:
            time.sleep(0.05)  # a poison crashes in its step, not in the same microsecond
            os._exit(1)

    core.scheduler.on_start = announce_started

    def drain(block: bool) -> None:
        while True:
            try:
                msg = inputs.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                return
            block = False
            if isinstance(msg, EngineRequest):
                if crash_on_id is not None and crash_on_id in msg.prompt_token_ids:
                    poisoned.add(msg.request_id)
                core.add_request(msg)
            elif isinstance(msg, AbortRequest):
                core.abort(msg.request_ids)
            elif isinstance(msg, UtilityCall):
                outputs.put(_utility(core, msg))

    while True:
        drain(block=not core.has_work)
        if not core.has_work:
            continue
        step_outputs = core.step(before_update=lambda: drain(block=False))
        if step_outputs:
            outputs.put(EngineOutputs(epoch, step_outputs, time.time(), core.stats()))


def _utility(core: EngineCore, call: UtilityCall) -> UtilityResult:
    if call.method == "reset_prefix_cache":
        core.kv.reset_prefix_cache()
    elif call.method == "sleep":  # debug: stop stepping for a while, as a hung engine would
        time.sleep(call.arg)
    elif call.method == "busy":  # debug: a step that takes a while but moves, as a long prefill does
        end = time.monotonic() + call.arg
        while time.monotonic() < end:
            time.sleep(0.05)
            core.runner.progress.tick()
    elif call.method in ("load_lora", "unload_lora"):
        if call.lora is None:
            return UtilityResult(call.call_id, ok=False, error=f"{call.method} names no adapter")
        if call.method == "unload_lora":
            core.unload_lora(call.lora)
        elif (error := core.load_lora(call.lora)) is not None:
            return UtilityResult(call.call_id, ok=False, error=error)
    elif call.method not in ("health", "stats"):
        return UtilityResult(call.call_id, ok=False, error=f"unknown method {call.method!r}")
    return UtilityResult(call.call_id, stats=core.stats())


def _recv_loop(ctx: zmq.Context, address: str, index: int, inputs: queue.Queue, stop: threading.Event) -> None:
    sock = ipc.make_socket(ctx, zmq.DEALER, address, bind=False, identity=ipc.engine_identity(index))
    try:
        while not stop.is_set():
            data = sock.recv()
            try:
                inputs.put(ipc.decode_input(data))
            except Exception:  # a malformed message is dropped, not fatal
                log.exception("undecodable input message")
    except zmq.ZMQError:
        pass  # context terminated at shutdown
    finally:
        sock.close(0)


def _send_loop(ctx: zmq.Context, address: str, outputs: queue.Queue) -> None:
    sock = ipc.make_socket(ctx, zmq.PUSH, address, bind=False)
    sock.setsockopt(zmq.LINGER, 2000)  # let the last messages (EngineDead) get out
    while (msg := outputs.get()) is not None:
        sock.send(ipc.encode(msg), copy=False)
    sock.close()
