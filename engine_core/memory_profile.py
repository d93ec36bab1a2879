"""KV cache sizing: how many blocks this engine gets, and one clear error at start when that is not enough.

CUDA, as vLLM sizes it: `--gpu-memory-utilization` is the fraction of the card's *total* memory this engine may
hold (weights + step activations + CUDA graphs + KV cache). The model runner snapshots the card before loading
the weights, loads them, runs one profiling step at the largest shapes a step can have (`--max-num-batched-tokens`
prefill tokens, the LM head and the sampler at `--max-num-seqs` rows) and gives the KV cache what is left:

    KV budget = total * utilization - weights - peak activations - non-torch growth - CUDA graph reserve

Non-torch growth is memory taken outside torch's caching allocator while loading and profiling (cuBLAS / NCCL
workspaces): the growth of (total - free) less the growth of what torch reserved. The profiling step's
temporaries stay cached in torch's allocator (no `empty_cache()` before the KV cache is allocated): the budget
paid for them, and a real step then finds its temporaries already reserved instead of freeing and re-allocating
segments on a card that the KV cache filled (which made the first pass of a benchmark 3x slower than the second).
Graph capture empties that cache again (torch.cuda.graph does), but the memory it frees stays free for the steps
after it, which reserve it once: on an H100 the 1B benchmark's first pass ran within 3% of its second.
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (set by the user, not by us: untested with our CUDA graphs)
would lower fragmentation further.

CPU: `--kv-cache-memory` GiB for the whole tensor-parallel group. `--num-kv-blocks` overrides either sizing.
Whatever the source, a cache that cannot hold one `--max-model-len` request fails the start with the numbers
and the flags to change, instead of starting with one block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.messages import EngineRequest, SamplingParams
from engine_core import distributed
from engine_core.batch import SchedulerOutput
from engine_core.request import Request
from engine_core.sampler import Sampler

GiB = 2**30
# CUDA graphs are captured lazily, after the KV cache exists; their pool comes from this reserve.
CUDA_GRAPH_RESERVE = 512 * 2**20

GPU_FLAGS = "--gpu-memory-utilization, --max-model-len, --max-num-batched-tokens, --max-num-seqs or --num-kv-blocks"
CPU_FLAGS = "--kv-cache-memory, --max-model-len or --num-kv-blocks"


class KvCacheSizeError(ValueError):
    """The engine cannot start: its KV cache would not hold one request of max_model_len tokens."""


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def blocks_needed(max_model_len: int, block_size: int) -> int:
    """Blocks one request of max_model_len tokens occupies."""
    return -(-max_model_len // block_size)


@dataclass(frozen=True)
class GpuMemory:
    """What the profile measured on one GPU, in bytes."""

    total: int
    free_at_start: int
    weights: int = 0
    activations: int = 0  # the profiling step's peak above the loaded weights
    non_torch: int = 0  # growth outside torch's allocator (cuBLAS, NCCL)
    graph_reserve: int = 0


def check_free_at_start(total: int, free: int, utilization: float) -> None:
    """Before loading anything: other processes on the card must leave us total * utilization."""
    requested = total * utilization
    if free < requested:
        most = free / total
        raise KvCacheSizeError(
            f"not enough free GPU memory to start: the GPU has {_gib(total)} GiB, {_gib(free)} GiB free at start "
            f"(others hold {_gib(total - free)} GiB), and --gpu-memory-utilization {utilization:g} requests "
            f"{_gib(requested)} GiB for this engine. Lower --gpu-memory-utilization to at most {most:.2f}, or free "
            "the GPU."
        )


def kv_budget(mem: GpuMemory, utilization: float) -> int:
    """Bytes left for the KV cache (negative when the rest does not even fit)."""
    return int(mem.total * utilization) - mem.weights - mem.activations - mem.non_torch - mem.graph_reserve


def gpu_kv_blocks(mem: GpuMemory, utilization: float, bytes_per_block: int, max_model_len: int,
                  block_size: int) -> int:  # fmt: skip
    """Blocks that fit in the KV budget; raises KvCacheSizeError when free memory at start was below the request,
    or when the budget cannot hold one max_model_len request."""
    check_free_at_start(mem.total, mem.free_at_start, utilization)
    budget = kv_budget(mem, utilization)
    blocks = max(budget, 0) // bytes_per_block
    needed = blocks_needed(max_model_len, block_size)
    if blocks < needed:
        raise KvCacheSizeError(
            f"the KV cache cannot hold one request of --max-model-len {max_model_len}: that needs {needed} blocks "
            f"of {block_size} tokens ({_gib(needed * bytes_per_block)} GiB), the budget holds {blocks}. GPU memory "
            f"(GiB): total {_gib(mem.total)}, free at start {_gib(mem.free_at_start)}, requested "
            f"{_gib(mem.total * utilization)} (--gpu-memory-utilization {utilization:g}), weights "
            f"{_gib(mem.weights)}, peak activations {_gib(mem.activations)}, non-torch {_gib(mem.non_torch)}, "
            f"CUDA graph reserve {_gib(mem.graph_reserve)}, KV budget {_gib(budget)}. Change {GPU_FLAGS}."
        )
    return int(blocks)


def cpu_kv_blocks(kv_cache_memory_gib: float, tp_size: int, bytes_per_block: int, max_model_len: int,
                  block_size: int) -> int:  # fmt: skip
    """--kv-cache-memory GiB (the whole group's) as blocks per rank; raises when one request does not fit."""
    blocks = int(kv_cache_memory_gib * GiB / tp_size // bytes_per_block)
    needed = blocks_needed(max_model_len, block_size)
    if blocks < needed:
        raise KvCacheSizeError(
            f"the KV cache cannot hold one request of --max-model-len {max_model_len}: that needs {needed} blocks "
            f"of {block_size} tokens ({_gib(needed * bytes_per_block * tp_size)} GiB), --kv-cache-memory "
            f"{kv_cache_memory_gib:g} GiB holds {blocks}. Change {CPU_FLAGS}."
        )
    return blocks


def check_num_kv_blocks(num_kv_blocks: int, max_model_len: int, block_size: int) -> int:
    """An explicit --num-kv-blocks must hold one max_model_len request as well."""
    needed = blocks_needed(max_model_len, block_size)
    if num_kv_blocks < needed:
        raise KvCacheSizeError(
            f"--num-kv-blocks {num_kv_blocks} cannot hold one request of --max-model-len {max_model_len}: that "
            f"needs {needed} blocks of {block_size} tokens. Raise --num-kv-blocks or lower --max-model-len."
        )
    return num_kv_blocks


# ---- CUDA measurement (needs the model runner; see ModelRunner.__init__) ----


@dataclass(frozen=True)
class StartSnapshot:
    total: int
    free: int
    reserved: int
    allocated: int


def snapshot_at_start(device: torch.device, utilization: float) -> StartSnapshot:
    """Before the weights load: fails at once when other processes leave us less than we were asked to take."""
    free, total = torch.cuda.mem_get_info(device)  # creates the CUDA context first: it is not in `free`
    check_free_at_start(total, free, utilization)
    return StartSnapshot(total, free, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


def profile_gpu(runner: Any, start: StartSnapshot, max_model_len: int, graph_reserve: int,
                pad_rows: Callable[[int], int]) -> GpuMemory:  # fmt: skip
    """After the weights loaded: one step at the largest shapes, over a one-block cache that the runner (a
    ModelRunner, not imported: it imports us) replaces with the real one afterwards. pad_rows: how the runner pads
    the LM head's rows. Leaves the step's temporaries cached in torch's allocator (see the module docstring)."""
    dev = runner.device
    torch.cuda.synchronize(dev)
    weights = torch.cuda.memory_allocated(dev) - start.allocated
    runner.num_blocks = 1
    runner._allocate_kv_cache()  # every dummy token reads and writes block 0 or the scratch slot
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base_allocated, base_reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    _profile_step(runner, max_model_len, pad_rows)
    torch.cuda.synchronize(dev)
    activations = max(torch.cuda.max_memory_allocated(dev) - base_allocated,
                      torch.cuda.max_memory_reserved(dev) - base_reserved)  # fmt: skip
    free, _ = torch.cuda.mem_get_info(dev)
    non_torch = (start.free - free) - (torch.cuda.memory_reserved(dev) - start.reserved)
    return GpuMemory(start.total, start.free, weights, activations, max(non_torch, 0), graph_reserve)


@torch.inference_mode()
def _profile_step(runner: Any, max_model_len: int, pad_rows: Callable[[int], int]) -> None:
    """The forward as the runner runs it (its own _prepare: padding and attention metadata), then the LM head and
    the sampler's fp32 softmax / top-k / top-p / logprobs temporaries at max_num_seqs rows. (Prompt logprobs work
    a slice of positions at a time and are not profiled.)"""
    cfg = runner.config
    seq_len = max(1, min(max_model_len - 1, cfg.max_num_batched_tokens))
    lengths = [seq_len] * (cfg.max_num_batched_tokens // seq_len)
    if cfg.max_num_batched_tokens % seq_len:
        lengths.append(cfg.max_num_batched_tokens % seq_len)
    batch = SchedulerOutput()
    for i, n in enumerate(lengths[: cfg.max_num_seqs]):
        # Each a chunked prefill's last chunk, attending to a whole max_model_len context: the widest attention a
        # step can have (what the torch reference path materialises grows with it).
        context = max(max_model_len - 1, n)
        req = Request(EngineRequest(f"profile-{i}", [0] * context, SamplingParams(max_tokens=1)), i)
        req.num_computed_tokens = context - n
        req.block_ids = [0] * blocks_needed(context, runner.block_size)
        batch.add(req, n)
    input_ids, positions, meta, _ = runner._prepare(batch)
    hidden = runner.model(input_ids, positions, meta)
    if runner.pooling:  # no LM head and no sampler: a pooled row is a slice of `hidden`
        return
    num_rows = cfg.max_num_seqs
    rows = torch.arange(pad_rows(num_rows), device=runner.device) % hidden.shape[0]
    if distributed.tp_size() > 1:  # the LM head's own slice only: the gather would start the worker protocol
        runner.model.lm_head(hidden[rows])
        if distributed.tp_rank() != 0:
            return
        logits = torch.zeros(num_rows, runner.vocab_size, dtype=runner.dtype, device=runner.device)
    else:
        logits = runner.model.compute_logits(hidden[rows])[:num_rows]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01,
                            logprobs=cfg.logprobs_limit(runner.vocab_size))
    requests = [Request(EngineRequest(f"profile-s{i}", [0], params), i) for i in range(num_rows)]
    Sampler(runner.device, runner.vocab_size)(logits, requests)
