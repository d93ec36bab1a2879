"""The packed weights and the KV cache on memory advised for huge pages (engine_core/huge_pages.py): zeroed,
2 MiB-aligned, owned by the tensors that use them, the same values after the move, and taken by a CPU engine."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from common.config import EngineConfig
from engine_core import huge_pages
from engine_core.core import EngineCore
from engine_core.models.layers import PackedLinear
from tests.cpu_features import needs_linear_kernels
from tests.engine_helpers import greedy_request, run_engine, save_tiny_llama, tokens_of

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: the CPU engine's memory"),
              pytest.mark.skipif(not THP.exists(), reason="a kernel without transparent huge pages")]  # fmt: skip


def advised(address: int) -> bool:
    """Whether the mapping holding `address` carries MADV_HUGEPAGE (VmFlags `hg` in /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_are_zeroed_aligned_advised_and_outlive_their_parts() -> None:
    cache = huge_pages.zeros((2, 3, 5, 16, 2, 64), torch.bfloat16)
    assert cache.shape == (2, 3, 5, 16, 2, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert cache.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert advised(cache.data_ptr())
    layer = cache[1, 2]  # as the model runner hands each layer its view
    del cache
    gc.collect()
    assert not layer.any()
    layer.fill_(1.5)
    assert layer.float().sum().item() == 1.5 * layer.numel()


@needs_linear_kernels
def test_packed_weights_move_into_one_advised_buffer_and_compute_the_same() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 40, bias=False)).to(torch.bfloat16)
    model[0], model[1] = PackedLinear(model[0]), PackedLinear(model[1])
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    before = model(x)
    old = [m.packed_weight.clone() for m in model]
    moved = huge_pages.move_packed_weights(model)
    first, second = (m.packed_weight for m in model)
    assert first.data_ptr() % huge_pages.HUGE_PAGE == 0 and advised(first.data_ptr())
    assert second.data_ptr() == first.data_ptr() + -(-first.numel() * first.element_size() // 64) * 64
    assert moved == sum(-(-w.numel() * w.element_size() // 64) * 64 for w in old)
    assert all(torch.equal(m.packed_weight, w) for m, w in zip(model, old, strict=True))
    gc.collect()
    assert torch.equal(model(x), before)


@needs_linear_kernels
def test_a_cpu_engine_keeps_its_weights_and_kv_cache_on_advised_memory(tmp_path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny", max_positions=256, init=0.2)
    core = EngineCore(EngineConfig(model=model_dir, dtype="bfloat16", kv_cache_memory=0.02, max_num_seqs=4))
    runner = core.runner
    assert advised(runner.kv_cache.data_ptr())
    packed = [m.packed_weight for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(advised(w.data_ptr()) for w in packed)
    prompts = [[5, 9, 17, 33, 2], [7, 7, 40]]
    out = run_engine(core, [greedy_request(f"r{i}", p, 6) for i, p in enumerate(prompts)])
    assert [len(t) for t in tokens_of(out, ["r0", "r1"])] == [6, 6]


@needs_linear_kernels
def test_moving_hands_the_heaps_freed_pages_back_as_it_goes(monkeypatch) -> None:
    """The engine keeps freed blocks of up to 32 MB in its heap (engine_core/device.py): without malloc_trim every
    moved weight would stay resident beside its copy. The heap goes back every RELEASE_EVERY bytes and at the end."""
    calls = []
    monkeypatch.setattr(huge_pages, "_release_freed_heap", lambda: calls.append(1))
    monkeypatch.setattr(huge_pages, "RELEASE_EVERY", 3 * 96 * 64 * 2)
    model = torch.nn.Sequential(*(PackedLinear(torch.nn.Linear(64, 96).to(torch.bfloat16)) for _ in range(7)))
    assert huge_pages.move_packed_weights(model) == 7 * 96 * 64 * 2
    assert len(calls) == 3  # after the third and sixth weights, and after the last
    assert huge_pages.libc() is not None and hasattr(huge_pages.libc(), "malloc_trim")  # glibc, as here
