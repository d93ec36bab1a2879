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


def test_decode_bound_of_a_mixture_of_experts() -> None:
    """4 of Qwen3-30B-A3B's layers: a token uses 8 of 128 experts; one stream reads those, 256 nearly all."""
    config = model_config("qwen3-moe-a3b-4l")
    experts = 4 * 128 * 3 * 768 * 2048
    layer = 2 * 4096 * 2048 + 2 * 512 * 2048 + 2 * 2048 + 2 * 128 + 128 * 2048  # q, o, k, v, norms, router
    dense = 4 * layer + 2048 + 49152 * 2048  # the final norm, the LM head
    one, many = (decode_bound(config, batch=b, context=0, dtype_bytes=2, bandwidth=4.8e12, peak_flops=989e12)
                 for b in (1, 256))  # fmt: skip
    assert one["flops"] == 2 * (dense + experts // 16)
    assert many["flops"] == 256 * one["flops"]
    assert one["bytes_read"] == pytest.approx(2 * (dense + experts / 16))
    assert many["bytes_read"] == pytest.approx(2 * (dense + experts), rel=1e-6)
