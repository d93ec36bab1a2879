"""Host values to device tensors without stalling the host."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence | np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list, or a numpy array) as a tensor on `device`. On CUDA through pinned memory and a non-blocking
    copy: a pageable copy waits for every kernel queued before it, which would keep the host from preparing a step
    while the GPU runs the last one (engine_core/overlap.py). Torch's pinned allocator keeps the buffer until the copy
    has run."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values).to(dtype)
        return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def padded_rows(rows: list[list[int]]) -> np.ndarray:
    """Rows of different lengths as one zero-padded 2-D array (block tables): a numpy row assignment per row costs
    a fraction of building a nested list for torch.tensor."""
    out = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
