"""Where each data-parallel engine core runs: its engine index, its share of the CPU cores, its GPU(s)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from common.config import EngineConfig

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one entry per GPU: counted without importing torch in the API process


@dataclass(frozen=True)
class Placement:
    config: EngineConfig  # with engine_index and, on CPU, num_threads set
    cpus: frozenset[int] | None = None  # CPU affinity of the engine process; None: inherit ours
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # CUDA_VISIBLE_DEVICES


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    try:
        return [str(i) for i in range(len(os.listdir(NVIDIA_GPUS)))]
    except OSError:
        return []


def place_engines(config: EngineConfig, n: int, cores: list[int] | None = None) -> list[Placement]:
    """n = 1 is today's single engine, untouched. Otherwise engine i gets cores [i*k, (i+1)*k) with k = cores // n
    (threads = k; with fewer cores than engines they share them, one thread each) and, with GPUs, GPU i (its
    tensor-parallel group when there is one), wrapping around when there are fewer GPUs than engines."""
    if n == 1:
        return [Placement(config)]
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    per = len(cores) // n
    tp = max(1, config.tensor_parallel_size)
    gpus = _visible_gpus() if config.device != "cpu" else []
    placements = []
    for i in range(n):
        cpus = frozenset(cores[i * per : (i + 1) * per]) if per >= 1 else None
        threads = config.num_threads or max(1, per)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus[(i * tp + k) % len(gpus)] for k in range(tp))} if gpus else {}
        changes: dict = {"engine_index": i, "num_threads": threads}
        if config.master_port:  # each engine's tensor-parallel group has its own rendezvous
            changes["master_port"] = config.master_port + i
        placements.append(Placement(dataclasses.replace(config, **changes), cpus, env))
    return placements
