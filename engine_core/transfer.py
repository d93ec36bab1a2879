"""Host values to device tensors without stalling the host."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` as a tensor on `device`. On CUDA through pinned memory and a non-blocking copy: a pageable copy waits
    for every kernel queued before it, which would keep the host from preparing a step while the GPU runs the last
    one (engine_core/overlap.py). Torch's pinned allocator keeps the buffer until the copy has run."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
