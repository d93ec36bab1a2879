"""The tensor-parallel group of this process: its rank, the collectives our layers call, and the step channel.

Rank 0 is the engine core: it schedules, samples, and before each forward broadcasts the step's inputs (op, token
ids, positions, slot mapping, decode block tables and lengths, prefill chunks); every logits computation first
broadcasts the hidden rows it is for (the LM head is vocab-parallel, and the prompt-logprobs path asks for logits
too). Workers (engine_core/worker.py) run the same forward on each broadcast and join each gather; only rank 0
gets the full logits. A failure inside a collective leaves the ranks out of step, so it is fatal for the whole
group (TensorParallelBroken); the supervisor then restarts the engine core, which starts fresh workers.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine_core.attention import AttentionMetadata, PrefillChunk

# Workers wait in a broadcast for as long as the engine idles: no timeout that an idle night could reach.
GROUP_TIMEOUT = datetime.timedelta(days=365)
OP_STEP, OP_LOGITS = 1, 2
_HEADER = 8


class TensorParallelBroken(BaseException):  # noqa: N818 (not an Exception: culprit isolation must not retry it)
    """A collective failed or a rank died: the group is out of step and only a restart of all of it helps."""


@dataclass
class TPGroup:
    rank: int
    size: int
    local_rank: int
    device: torch.device
    dtype: torch.dtype


_group: TPGroup | None = None


def tp_size() -> int:
    return 1 if _group is None else _group.size


def tp_rank() -> int:
    return 0 if _group is None else _group.rank


def group() -> TPGroup | None:
    return _group


def join(store: dist.Store, rank: int, size: int, local_rank: int, device: torch.device, dtype: torch.dtype) -> TPGroup:
    """Joins the process group through `store` (already scoped to this group's generation)."""
    global _group
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=GROUP_TIMEOUT)
    _group = TPGroup(rank, size, local_rank, device, dtype)
    return _group


@contextlib.contextmanager
def lockstep() -> Iterator[None]:
    """Around code that runs collectives: with several ranks, a failure there is fatal for the group."""
    if _group is None:
        yield
        return
    try:
        yield
    except Exception as exc:
        raise TensorParallelBroken(f"tensor-parallel rank {_group.rank}: {type(exc).__name__}: {exc}") from exc


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def all_min(value: int) -> int:
    """The smallest of every rank's value (KV blocks: the ranks must agree on one cache size)."""
    assert _group is not None
    t = torch.tensor([value], dtype=torch.long, device=_group.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_to_leader(local: torch.Tensor) -> torch.Tensor | None:
    """Concatenates every rank's [rows, n] along the last dim on rank 0; None on the others."""
    assert _group is not None
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(_group.size)] if _group.rank == 0 else None
    dist.gather(local, parts, dst=0)
    return None if parts is None else torch.cat(parts, dim=-1)


def _broadcast_op(op: int, sizes: list[int], payload: torch.Tensor | None) -> None:
    assert _group is not None
    header = torch.tensor([op, *sizes] + [0] * (_HEADER - 1 - len(sizes)), dtype=torch.long, device=_group.device)
    dist.broadcast(header, src=0)
    if payload is not None:
        dist.broadcast(payload, src=0)


def send_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
    """Rank 0: this step's inputs to every worker, as one header and one int64 payload."""
    assert _group is not None
    tables = meta.decode_block_tables
    num_decodes, width = (0, 0) if tables is None else tables.shape
    parts = [input_ids, positions, meta.slot_mapping]
    if tables is not None and meta.decode_seq_lens is not None:
        parts += [tables.flatten(), meta.decode_seq_lens]
    chunks = [[c.start, c.num_tokens, c.context_len, c.block_ids.numel()] for c in meta.prefills]
    parts += [torch.tensor(chunks, dtype=torch.long).flatten()] + [c.block_ids for c in meta.prefills]
    payload = torch.cat([p.to(_group.device, torch.long).flatten() for p in parts])
    sizes = [input_ids.numel(), num_decodes, width, len(meta.prefills), payload.numel()]
    _broadcast_op(OP_STEP, sizes, payload)


def announce_logits(hidden: torch.Tensor) -> None:
    """Rank 0, before its LM head: the rows every rank computes its vocabulary slice of."""
    _broadcast_op(OP_LOGITS, list(hidden.shape), hidden.contiguous())


def receive(block_size: int) -> tuple[int, tuple]:
    """Workers: the next op from rank 0 and its arguments."""
    assert _group is not None
    dev = _group.device
    header = torch.empty(_HEADER, dtype=torch.long, device=dev)
    dist.broadcast(header, src=0)
    op, *sizes = header.tolist()
    if op == OP_LOGITS:
        hidden = torch.empty(sizes[:2], dtype=_group.dtype, device=dev)
        dist.broadcast(hidden, src=0)
        return op, (hidden,)
    num_tokens, num_decodes, width, num_chunks, total = sizes[:5]
    payload = torch.empty(total, dtype=torch.long, device=dev)
    dist.broadcast(payload, src=0)
    input_ids, positions, slots, rest = payload.split([num_tokens] * 3 + [total - 3 * num_tokens])
    tables = lens = None
    if num_decodes:
        tables, lens, rest = rest.split([num_decodes * width, num_decodes, rest.numel() - num_decodes * (width + 1)])
        tables = tables.view(num_decodes, width)
    info, rest = rest.split([4 * num_chunks, rest.numel() - 4 * num_chunks])
    chunks = info.view(num_chunks, 4).tolist()
    block_ids = rest.split([c[3] for c in chunks]) if chunks else []
    prefills = [PrefillChunk(s, n, ctx, ids) for (s, n, ctx, _), ids in zip(chunks, block_ids, strict=True)]
    meta = AttentionMetadata.build(slots, tables, lens, prefills, block_size)
    return op, (input_ids, positions, meta)
