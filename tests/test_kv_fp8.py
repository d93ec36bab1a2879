"""The fp8 KV cache (--kv-cache-dtype fp8; engine_core/csrc/kv_fp8.c, torch_backend.to_fp8): K/V stored as float8
e4m3. The C conversion is torch's after the same saturation; decode attention over an fp8 cache is the bf16 kernel's
over the same values (every e4m3 value among them), bit for bit, and near the reference's; the torch reference reads
and writes it; the engine sizes twice the blocks in the same memory, and refuses what it cannot run."""

from __future__ import annotations

import pytest
import torch
import transformers

import launch
from common.config import EngineConfig
from engine_core.attention import AttentionMetadata, PrefillChunk, TorchBackend
from engine_core.attention.cpu_backend import CpuKernelBackend
from engine_core.attention.torch_backend import FP8_MAX, to_fp8
from engine_core.core import EngineCore
from engine_core.cpu_kernels import cpu_kernels
from engine_core.device import pick_kv_cache_dtype
from tests.cpu_features import HAS_FP8_DECODE, HAS_LINEAR, needs_fp8_decode, needs_prefill_kernel
from tests.engine_helpers import greedy_request, run_engine, tokens_of

FP8 = torch.float8_e4m3fn
CPU = torch.device("cpu")


@pytest.mark.skipif(cpu_kernels() is None, reason="needs our C kernels (a C compiler)")
def test_the_kernels_conversion_is_torchs_for_every_bf16_value() -> None:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ours = cpu_kernels().fp8_from_bf16(every).view(torch.uint8)  # type: ignore[union-attr]
    theirs = to_fp8(every).view(torch.uint8)
    assert torch.equal(ours, theirs)


def test_fp8_saturates_instead_of_overflowing_and_keeps_no_nan() -> None:
    x = torch.tensor([1e6, -float("inf"), 460.0, 3.0, float("nan"), -float("nan")], dtype=torch.bfloat16)
    assert to_fp8(x).float().tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX, 3.0, 0.0, 0.0]


def _caches(blocks: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V, the K cache's first elements every e4m3 value but NaN (subnormals, zeros, +-448)."""
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, 16, kv_heads, head_dim)
    k, v = (to_fp8(torch.randn(shape, generator=g).to(torch.bfloat16) * 2) for _ in range(2))
    every = torch.arange(256, dtype=torch.uint8)
    k.view(torch.uint8).view(-1)[:254] = every[(every & 0x7F) != 0x7F]
    return k, v


# (query heads, kv heads, head_dim, sequence lengths, consecutive rows of one sequence, window)
SHAPES = [
    (9, 3, 64, [1, 17, 200, 600, 1100, 33], False, None),  # SmolLM2's heads; parts of 512 keys past 512
    (8, 2, 128, [5, 700, 64], False, None),
    (4, 4, 32, [300, 301, 302, 303], True, None),  # a recompute's rows: one work item over shared blocks
    (9, 3, 64, [40, 90, 700], False, 48),  # a sliding window
    (6, 3, 32, [5, 37, 70], False, None),  # rows of 96 values: the widening's 64 at a time, then 32
]


@needs_fp8_decode
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, lens, one_sequence, window", SHAPES)
def test_decode_over_fp8_is_the_bf16_kernel_over_the_same_values(q_heads, kv_heads, head_dim, lens, one_sequence,
                                                                   window) -> None:  # fmt: skip
    kernels = cpu_kernels()
    assert kernels is not None
    width = -(-max(lens) // 16)
    blocks = width if one_sequence else width * len(lens)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(3))
    tables = order.view(1, width).expand(len(lens), width).contiguous() if one_sequence else order.view(-1, width)
    k8, v8 = _caches(blocks, kv_heads, head_dim, seed=len(lens))
    q = torch.randn(len(lens), q_heads, head_dim, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    seq_lens = torch.tensor(lens)
    scale = head_dim**-0.5
    ours = kernels.paged_decode(q, k8, v8, tables, seq_lens, scale, window)
    widened = kernels.paged_decode(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), tables, seq_lens, scale, window)
    assert torch.equal(ours, widened)
    # and near what the reference computes from the same fp8 values
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long), num_decodes=len(lens),
                             decode_block_tables=tables, decode_seq_lens=seq_lens, prefills=[], block_size=16)
    reference = TorchBackend().decode(q, k8, v8, meta, scale, window)
    assert (ours.float() - reference.float()).abs().max() < 0.05


BACKENDS = ["torch", pytest.param("cpu", marks=[needs_fp8_decode, needs_prefill_kernel])]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_reads_the_cached_context_widened_and_its_own_rows_fresh(backend: str) -> None:
    """Two prefill chunks over cached context: attended over an fp8 cache, bit for bit what the same backend gives
    over a bf16 cache holding the widened context, the chunks' own K/V unrounded; the cache holds to_fp8 of them."""
    g = torch.Generator().manual_seed(0)
    k_new, v_new = (torch.randn(13, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(13, 4, 32, generator=g).to(torch.bfloat16)
    # 8 tokens after 40 cached ones (blocks 0..2), and 5 after 17 (blocks 3, 4): slots of the chunks' new rows
    slots = torch.cat([torch.arange(40, 48), torch.arange(3 * 16 + 17, 3 * 16 + 22)])
    chunks = [PrefillChunk(0, 8, 48, torch.arange(3)), PrefillChunk(8, 5, 22, torch.arange(3, 5))]
    meta = AttentionMetadata(slot_mapping=slots, prefills=chunks, block_size=16)
    k8, v8 = _caches(6, 2, 32, seed=1)
    k16, v16 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    kernels = cpu_kernels()
    run = TorchBackend() if backend == "torch" else CpuKernelBackend(kernels, kernel_prefill=True)  # type: ignore
    ours = run.forward(q, k_new, v_new, k8, v8, meta, 0.2)
    widened = run.forward(q, k_new, v_new, k16, v16, meta, 0.2)
    assert torch.equal(ours, widened)
    assert torch.equal(k8.flatten(0, 1)[slots].view(torch.uint8), to_fp8(k_new).view(torch.uint8))
    assert torch.equal(v8.flatten(0, 1)[slots].view(torch.uint8), to_fp8(v_new).view(torch.uint8))


def test_the_flag_refuses_what_it_cannot_run() -> None:
    assert launch.parse_args(["--kv-cache-dtype", "fp8"])[0].kv_cache_dtype == "fp8"
    assert pick_kv_cache_dtype("auto", torch.float32, CPU) == torch.float32
    assert pick_kv_cache_dtype("fp8_e4m3", torch.bfloat16, CPU) == FP8
    with pytest.raises(ValueError, match="CPU with a bfloat16 model only"):
        pick_kv_cache_dtype("fp8", torch.float32, CPU)
    with pytest.raises(ValueError, match="not one of auto, fp8, fp8_e4m3"):
        pick_kv_cache_dtype("fp8_e5m2", torch.bfloat16, CPU)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A random Llama whose heads of 32 the fp8 decode kernel takes."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      architectures=["LlamaForCausalLM"])  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("tiny-fp8")
    model.save_pretrained(path)
    return str(path)


def test_the_engine_keeps_twice_the_blocks_in_fp8(tiny_dir: str) -> None:
    def runner(kv: str):
        config = EngineConfig(model=tiny_dir, dtype="bfloat16", kv_cache_memory=0.01, kv_cache_dtype=kv,
                              max_num_seqs=256)  # fmt: skip
        return EngineCore(config).runner

    auto, fp8 = runner("auto"), runner("fp8")
    assert auto.kv_cache.dtype == torch.bfloat16 and fp8.kv_cache.dtype == FP8
    assert fp8.num_blocks // 2 == auto.num_blocks  # each sized down to whole blocks
    layer = fp8.model.attention_layers()[0]
    assert layer.attn_backend.name == ("cpu" if HAS_FP8_DECODE else "torch")
    assert (fp8.model.decode_stack is not None) == (HAS_FP8_DECODE and HAS_LINEAR)


def test_an_fp8_engine_gives_the_same_tokens_with_and_without_the_stack(tiny_dir: str) -> None:
    config = EngineConfig(model=tiny_dir, dtype="bfloat16", kv_cache_memory=0.05, kv_cache_dtype="fp8", max_num_seqs=8)
    with_stack, without = EngineCore(config), EngineCore(config)
    without.runner.model.decode_stack = None
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 7, 250, 3][: 2 + i] for i in range(5)]
    requests = [greedy_request(f"r{i}", p, 40) for i, p in enumerate(prompts)]
    ids = [r.request_id for r in requests]
    ours = tokens_of(run_engine(with_stack, requests, stagger=2), ids)
    assert ours == tokens_of(run_engine(without, requests, stagger=2), ids)
    assert all(len(t) == 40 for t in ours)
