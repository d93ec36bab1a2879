"""Liveness inside a step (engine_core/pulse.py): every attention layer and LM head call ticks, and pulses go out
only while the ticks move. The API side, a long step that moves kept alive and a stuck one replaced:
tests/test_api_client.py."""

from __future__ import annotations

import queue
import threading
import time

from common.messages import EnginePulse, EngineRequest, SamplingParams
from engine_core.core import EngineCore
from engine_core.pulse import PULSE_INTERVAL_S, Progress, start_pulses
from tests.engine_helpers import engine_config, save_tiny_llama


def test_each_attention_layer_and_lm_head_call_ticks(tmp_path) -> None:
    core = EngineCore(engine_config(model=save_tiny_llama(tmp_path, 256, 0.2), dtype="float32"))
    layers = len(core.runner.model.attention_layers())
    assert layers == 2

    def ticks_of_one_step(params: SamplingParams) -> int:
        before = core.runner.progress.ticks
        core.add_request(EngineRequest(f"r{before}", list(range(4, 40)), params))
        outputs = core.step()  # the prompt's one step samples the request's only token
        assert [o.finished for o in outputs] == [True]
        return core.runner.progress.ticks - before

    assert ticks_of_one_step(SamplingParams(max_tokens=1, temperature=0.0)) == layers + 1  # the sampled row's logits
    # Prompt logprobs run the head over the prompt's positions as well, after the layers: seconds for a long prompt.
    assert ticks_of_one_step(SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)) == layers + 2


def test_pulses_only_while_the_ticks_move() -> None:
    progress, outputs, stop = Progress(), queue.Queue(), threading.Event()
    start_pulses(progress, outputs, epoch=7, stop=stop)
    try:
        end = time.monotonic() + 4 * PULSE_INTERVAL_S
        while time.monotonic() < end:  # a long step that moves
            progress.tick()
            time.sleep(0.01)
        pulses = [outputs.get_nowait() for _ in range(outputs.qsize())]
        assert len(pulses) >= 2 and all(p == EnginePulse(7) for p in pulses), pulses
        time.sleep(PULSE_INTERVAL_S * 1.5)  # the last moving interval may still be reported
        outputs.queue.clear()
        time.sleep(PULSE_INTERVAL_S * 3)  # stuck: nothing moves, nothing is sent
        assert outputs.empty()
    finally:
        stop.set()
