"""A spare engine process (`python -m engine_core --standby ...`, started by frontend/engine/supervisor.py once its
engine is ready): it does ahead of time what a start does before it touches the device or the weights, then waits
for the epoch on stdin. When the engine dies, its replacement starts from here instead of from a cold interpreter.

Ahead of time means importing torch, transformers and the engine, and reading the model's config: transformers'
config classes import most of the library (torch._dynamo, torch.distributed.tensor). On a 2-core CPU that is about
3.3 s of a 4.2 s start with the default model; what is left (weights, KV cache, warm-up) takes 0.85 s.

The warm-up runs in a thread of its own at the lowest CPU priority (nice 19: on Linux a thread's own), so that it
takes only cores the serving engine leaves idle. At normal priority, 10 s after the server's start, it took one of
2 cores from the first burst of requests: 64 requests x 128 in x 128 out ran at 520-541 output tok/s against 635-656
for the next bursts. A promotion that comes mid-warm-up waits for the imports under way (the engine is dead then,
so the cores are free), and the engine itself starts from the main thread, at the priority the server gave it (a
thread the imports start keeps nice 19: numpy's OpenBLAS worker, which the engine computes nothing on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import sys
import threading

from common.config import EngineConfig

log = logging.getLogger("roseinfer.engine")
# The warm-up waits this long after the spare starts (when its engine is ready): on 2 cores, warming up beside a
# restarted engine slowed its first steps (the resumed requests' recompute) from 0.02 to 0.4 s.
WARM_UP_AFTER_S = float(os.environ.get("ROSEINFER_SPARE_WARM_UP_AFTER", "10"))


def warm_up(config: EngineConfig) -> None:
    """Imports what EngineCore imports and reads the model's config once (its classes' modules stay imported)."""
    import engine_core.busy_loop  # noqa: F401
    from common.model_source import parse_hf_overrides, resolve_model
    from engine_core.models.loader import load_config

    with contextlib.suppress(Exception):  # the promoted start meets the same error and reports it
        overrides = parse_hf_overrides(config.hf_overrides)
        load_config(resolve_model(config.model, overrides=overrides).path, overrides)


def _warm_up_idly(config: EngineConfig) -> None:
    with contextlib.suppress(OSError):  # nice 19 for this thread only (Linux); elsewhere the warm-up just runs
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    warm_up(config)
    log.debug("spare engine process warm, waiting for its epoch")


def wait_for_epoch(config: EngineConfig) -> EngineConfig | None:
    """Starts warming up after WARM_UP_AFTER_S (see the top), and blocks until the server writes the epoch to start
    with (told sooner, it starts at once, cold); None when it never will (stdin closed, or stopped by the server)."""
    try:
        if not select.select([sys.stdin], [], [], WARM_UP_AFTER_S)[0]:
            threading.Thread(target=_warm_up_idly, args=(config,), name="warm-up", daemon=True).start()
        line = sys.stdin.readline()
    except KeyboardInterrupt:  # STOP_SIGNAL: discarded
        return None
    if not line.strip():
        return None
    return dataclasses.replace(config, epoch=int(line))
