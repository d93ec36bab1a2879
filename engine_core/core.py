"""EngineCore (add / abort / step, steppable in tests without sockets) and run_engine, the process's busy loop."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback

import zmq
from transformers import AutoConfig

from common import ipc
from common.config import EngineConfig
from common.messages import (
    AbortRequest,
    EngineDead,
    EngineOutput,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    EngineStarted,
    FinishReason,
    UtilityCall,
    UtilityResult,
)
from common.model_source import model_eos_ids, resolve_model
from engine_core.batch import SampledTokens, SchedulerOutput
from engine_core.kv_cache import KVCacheManager
from engine_core.memory_profile import KvCacheSizeError
from engine_core.model_runner import ModelRunner
from engine_core.overlap import DecodePipeline
from engine_core.pulse import start_pulses
from engine_core.request import Request
from engine_core.request_checks import invalid_request
from engine_core.scheduler import Scheduler
from engine_core.speculative import Speculator
from engine_core.structured import GrammarService

log = logging.getLogger("roseinfer.engine")

RanParts = list[tuple[SchedulerOutput, SampledTokens]]  # sub-batches of a step that executed, with their tokens


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = resolve_model(config.model)
        self.model_name = source.name
        hf_config = AutoConfig.from_pretrained(source.path)
        limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", 2048)
        max_model_len = min(config.max_model_len or min(limit, 8192), limit)
        self.runner = ModelRunner(config, source.path, max_model_len)
        # A single request must always fit in the cache, or it could wait forever.
        self.max_model_len = min(max_model_len, self.runner.num_blocks * config.block_size)
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = model_eos_ids(source.path, hf_config)
        self.grammars = GrammarService(source.path, self.vocab_size, self.eos_token_ids)  # constrained decoding
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        speculator = Speculator.build(config.speculative_config, self.max_model_len)  # n-gram drafts, if asked
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.runner.config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy, speculator)  # fmt: skip
        self.pipeline = DecodePipeline.build(config, self.scheduler, self.runner, self.max_model_len)
        self._rejected: list[EngineOutput] = []
        self._seq_no = 0
        self.last_step_time = 0.0

    def ready_message(self) -> EngineReady:
        return EngineReady(self.config.epoch, self.model_name, self.max_model_len, self.config.block_size,
                           self.runner.num_blocks, self.vocab_size, self.eos_token_ids)  # fmt: skip

    # ---- requests ----

    def add_request(self, msg: EngineRequest) -> None:
        error = invalid_request(msg, self.vocab_size, self.max_model_len, self.scheduler.requests)
        lora_slot = self.runner.lora.slots.get(msg.lora, 0) if msg.lora else 0
        if error is None and msg.lora and not lora_slot:
            error = f"LoRA adapter {msg.lora!r} is not loaded (--lora-modules)"
        if error is not None:
            self._rejected.append(EngineOutput(msg.request_id, [], FinishReason.ERROR, error=error))
            return
        if not msg.eos_token_ids:
            msg.eos_token_ids = self.eos_token_ids
        self._seq_no += 1
        try:
            request = Request(msg, self._seq_no)
            request.lora_slot = lora_slot
            request = self.grammars.attach(request)
        except Exception as exc:  # the request fails alone: it never started, so a crash would blame nobody
            log.exception("request %s could not be added", msg.request_id)
            self._rejected.append(EngineOutput(msg.request_id, [], FinishReason.ERROR, error=f"{exc!r}"))
            return
        self.scheduler.add(request)

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort(request_ids)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._rejected) or self._in_flight is not None

    @property
    def _in_flight(self) -> SchedulerOutput | None:
        return self.pipeline.inflight.sched if self.pipeline is not None and self.pipeline.inflight else None

    # ---- one step ----

    def step(self, before_update=None) -> list[EngineOutput]:
        """schedule -> execute -> (aborts that arrived meanwhile) -> update. Returns this step's outputs."""
        outputs, self._rejected = self._rejected, []
        start = time.perf_counter()
        if (in_flight := self._in_flight) is not None:  # engine_core/overlap.py: the next step launches first
            try:
                ran, failed = [self.pipeline.advance()], []  # type: ignore[union-attr]
            except Exception as exc:
                log.exception("an overlapped step failed")
                self.pipeline.inflight = None  # type: ignore[union-attr]  # the device's state is unknown: resync
                ran, failed = [], self._fail(in_flight.requests, f"engine step failed: {exc!r}")
        else:
            if not self.scheduler.has_work:
                return outputs
            sched = self.scheduler.schedule()
            if not sched.requests or (self.pipeline is not None and self.pipeline.try_launch(sched)):
                return outputs + self.scheduler.take_early_outputs()  # a launched step's tokens come with the next
            ran, failed = self._execute_isolating(sched)
        outputs += self.scheduler.take_early_outputs()  # constrained requests whose grammar failed
        outputs += failed
        if before_update is not None:
            before_update()
        for part, sampled in ran:
            # Update is bookkeeping, not tensor work: a raise there is a bug that may have half-applied the step of
            # the request it raised on. The outputs made before it stand (their requests are whole); the rest fail.
            made: list[EngineOutput] = []
            try:
                self.scheduler.update(part, sampled, made)
            except Exception as exc:
                log.exception("update failed")
                made += self._fail(part.requests, f"engine update failed: {exc!r}", {o.request_id for o in made})
            outputs += made
        if self.pipeline is not None:
            self.pipeline.sample_late()
        self.last_step_time = time.perf_counter() - start
        return outputs

    def _execute_isolating(self, sched: SchedulerOutput) -> tuple[RanParts, list[EngineOutput]]:
        """Runs the batch; if it raises, runs each half on its own, recursively, so that only a request that
        raises alone fails and the rest of the step goes on. Returns the parts that ran with their tokens, in
        batch order, and the culprits' outputs. Retrying is safe: execute changes no request state and only
        rewrites the same KV slots; num_computed_tokens moves in update, once per part."""
        try:
            return [(sched, self.runner.execute(sched))], []
        except Exception as exc:
            if len(sched.requests) == 1:
                log.exception("request %s failed its step", sched.requests[0].request_id)
                return [], self._fail(sched.requests, f"engine step failed: {exc!r}")
            log.debug("a step of %d requests failed (%r): splitting it", len(sched.requests), exc)
        mid = len(sched.requests) // 2
        ran: RanParts = []
        failed: list[EngineOutput] = []
        for half in (slice(None, mid), slice(mid, None)):
            # A slice of a decodes-first batch is still decodes-first.
            part_ran, part_failed = self._execute_isolating(sched.part(half))
            ran += part_ran
            failed += part_failed
        return ran, failed

    def _fail(self, requests: list[Request], error: str, sent: set[str] | None = None) -> list[EngineOutput]:
        """An ERROR output for each request with none sent, also one that update finished before it made its output
        (the scheduler has forgotten it: its stream would wait forever). An aborted request needs none."""
        failed = []
        for req in requests:
            if req.request_id in (sent or ()) or req.finish_reason == FinishReason.ABORT:
                continue
            self.scheduler.finish(req, FinishReason.ERROR, error)  # a no-op if update finished it
            failed.append(EngineOutput(req.request_id, [], FinishReason.ERROR, error=error))
        return failed

    def stats(self):
        return self.scheduler.stats(self.last_step_time, self.runner.last_forward_time)


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
        log.info("engine core ready: %s, %s on %s, %d KV blocks", core.model_name, dtype, runner.device.type,
                 runner.num_blocks)  # fmt: skip
        _busy_loop(core, inputs, outputs, notices, epoch)
        code = 0
    except KeyboardInterrupt:
        code = 0
    except BaseException as exc:  # fatal: tell the frontend before going away
        # Memory that cannot hold the engine is the user's to fix, and the message says how: no traceback for it.
        log.error("engine core died: %s", exc if isinstance(exc, KvCacheSizeError) else traceback.format_exc())
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
