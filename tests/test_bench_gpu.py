"""bench/gpu.py's decode-step bound, by hand for the llama-7b shape."""

from __future__ import annotations

import pytest

from bench.gpu import decode_bound
from bench.make_random_model import model_config


def test_decode_bound_of_the_7b_shape() -> None:
    config = model_config("llama-7b")
    weights = 6_878_924_800 - 49152 * 4096  # the embedding table is read only as rows: not in the bound
    kv_per_token = 2 * 32 * 32 * 128 * 2  # K and V, 32 layers x 32 heads x 128 dims, bf16
    b = decode_bound(config, batch=64, context=640, dtype_bytes=2, bandwidth=3.35e12, peak_flops=989e12)
    assert b["bytes_read"] == 2 * weights + 64 * 640 * kv_per_token
    assert b["flops"] == 64 * (2 * weights + 4 * 640 * 32 * 128 * 32)
    assert b["bandwidth_ms"] == pytest.approx(b["bytes_read"] / 3.35e12 * 1e3)
    # 13.4 GB of weights + 21.5 GB of KV at 3.35 TB/s; the FLOPs take 0.9 ms
    assert b["bound_ms"] == max(b["bandwidth_ms"], b["compute_ms"]) == pytest.approx(10.4, abs=0.1)
