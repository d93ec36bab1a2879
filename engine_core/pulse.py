"""Liveness inside a step. The engine loop answers health checks between steps, and the API process counts an engine
that answers none within --engine-ping-timeout as hung. A step can outlast that and still be fine: a 2048-token
prefill chunk at the end of an 8k context took 32 s on a 2-core CPU, and its engine was killed as hung, again after
each restart, since its requests resumed into the same step. So every attention layer and LM head call the model
runs ticks a counter, and a thread sends an EnginePulse every half second in which the counter moved: the API
process declares a hang only when neither an answer nor a pulse came within the timeout. A stuck step (a kernel
that never returns, a collective waiting on a dead rank) ticks no more, and a stopped process sends nothing."""

from __future__ import annotations

import queue
import threading

from torch import nn

from common.messages import EnginePulse

PULSE_INTERVAL_S = 0.5  # a pulse is up to this old: it adds to how late a hang is noticed


class Progress:
    """A counter of the attention layers and LM head calls run so far. Plain int increments: the GIL makes them
    safe enough for a reader that only asks whether the value changed."""

    def __init__(self) -> None:
        self.ticks = 0

    def tick(self, *_: object) -> None:
        self.ticks += 1

    def watch(self, model: nn.Module) -> None:
        """Ticks before each attention layer's forward and each LM head call: prompt logprobs run the head over a
        long prompt's every position after the layers, seconds on a CPU (CUDA graph replays skip hooks: their
        steps are short)."""
        for module in [*model.attention_layers(), model.lm_head]:
            module.register_forward_pre_hook(self.tick)


def start_pulses(progress: Progress, outputs: queue.Queue, epoch: int, stop: threading.Event) -> None:
    """Puts an EnginePulse on the outputs queue every PULSE_INTERVAL_S while `progress` moves, until `stop`."""

    def run() -> None:
        seen = progress.ticks
        while not stop.wait(PULSE_INTERVAL_S):
            if progress.ticks != seen:
                seen = progress.ticks
                outputs.put(EnginePulse(epoch))

    threading.Thread(target=run, name="pulse", daemon=True).start()
