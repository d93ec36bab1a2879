"""What the CPU kernels stream every step, on 2 MiB pages: the packed weights and the KV cache.

A decode step reads every weight once. On 4 KiB pages that is a TLB miss every 4 KiB of it, and in a virtual
machine each miss walks two page tables. Linux backs a private anonymous mapping advised MADV_HUGEPAGE with
transparent huge pages (unless /sys/kernel/mm/transparent_hugepage/enabled says `never`); torch's own allocator does
so only with THP_MEM_ALLOC_ENABLE=1 (which the server sets for its engines, common/python_command.py) and only for
tensors of 2 MiB or more, and most single weights are smaller (all of the default model's int8 and int4 ones). So
the packed weights move into one such buffer after load, and the KV cache is allocated in one, in any process that
runs an engine. On a 2-vCPU Xeon VM, with THP_MEM_ALLOC_ENABLE=1 on both sides, one stream's int4 decode step of the
default model took 8.4 and 9.0 ms against 9.8 and 9.3 (the README's Performance section has the rest). Where the
platform has no MADV_HUGEPAGE, both stay ordinary tensors.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np
import torch
from torch import nn

from engine_core.device import libc

log = logging.getLogger("roseinfer.huge_pages")
HUGE_PAGE = 2 << 20
ALIGN = 64  # each weight starts on a cache line, as torch's allocator places them
RELEASE_EVERY = 256 << 20  # bytes of weights moved between two hand-backs of the heap's freed pages


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on CPU, on memory advised for huge pages where the platform takes the advice;
    every page is touched now, at start, rather than by the first steps that write it."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buffer = _advised_bytes(nbytes)
    if buffer is None:
        return torch.zeros(shape, dtype=dtype)
    buffer.zero_()
    return buffer.view(dtype).view(shape)


def move_packed_weights(model: nn.Module) -> int:
    """Moves every module's CPU `packed_weight` (PackedLinear, QuantizedLinear) and `packed_few` (a PackedLinear's
    grid panels) into one buffer advised for huge pages, in module order; returns the bytes moved (0 where none, or
    where the platform cannot advise it)."""
    # The bf16 panels first, back to back as ever, then the grid panels: a step reads one kind or the other.
    held = [(m, attr) for attr in ("packed_weight", "packed_few") for m in model.modules()
            if _packed_on_cpu(getattr(m, attr, None))]  # fmt: skip
    sizes = [_padded(getattr(m, attr).numel() * getattr(m, attr).element_size()) for m, attr in held]
    buffer = _advised_bytes(sum(sizes)) if held else None
    if buffer is None:
        return 0
    offset = released = 0
    for (module, attr), size in zip(held, sizes, strict=True):
        weight = getattr(module, attr)
        moved = buffer[offset : offset + weight.numel() * weight.element_size()].view(weight.dtype).view(weight.shape)
        moved.copy_(weight)
        setattr(module, attr, moved)  # a buffer's entry (QuantizedLinear registers it) or a plain attribute
        del weight
        offset += size
        if offset - released >= RELEASE_EVERY:
            _release_freed_heap()
            released = offset
    if released < offset:
        _release_freed_heap()
    return offset


def _release_freed_heap() -> None:
    """Hands the heap's free pages back to the kernel (glibc's malloc_trim). The engine keeps what it frees in its
    heap (engine_core/device.py keeps blocks up to 32 MB there), so each weight just moved would otherwise stay
    resident beside its copy: a model of many small weights (a mixture of experts) would need twice its size."""
    c = libc()
    if c is not None and hasattr(c, "malloc_trim"):
        c.malloc_trim(0)


def _packed_on_cpu(weight: object) -> bool:
    return isinstance(weight, torch.Tensor) and weight.device.type == "cpu"


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _advised_bytes(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of nbytes starting on a 2 MiB boundary of a private anonymous mapping advised MADV_HUGEPAGE,
    or None. The tensor owns the mapping: numpy's array keeps the mmap alive, and the tensor (and every view of it)
    keeps the array."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes <= 0:
        return None
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError as exc:  # a kernel built without transparent huge pages
        log.info("no huge pages (%s): the weights and KV cache stay on ordinary pages", exc)
        mapping.close()
        return None
    whole = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]
