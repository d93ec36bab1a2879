"""KV cache sizing (engine_core/memory_profile.py): the budget arithmetic with made-up GPU numbers, the errors a
start fails with, the profiling step run on CPU, and the error reaching a user of launch.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from engine_core import memory_profile
from engine_core.core import EngineCore
from engine_core.device import padded_size, step_token_budget
from engine_core.memory_profile import (
    GiB,
    GpuMemory,
    KvCacheSizeError,
    check_num_kv_blocks,
    cpu_kv_blocks,
    gpu_kv_blocks,
    kv_budget,
)
from tests.conftest import Server
from tests.cpu_features import HAS_F32_LINEAR
from tests.engine_helpers import run_engine, tokens_of

MiB = 2**20
H100 = GpuMemory(total=80 * GiB, free_at_start=79 * GiB, weights=14 * GiB, activations=2 * GiB, non_torch=GiB // 2,
                 graph_reserve=GiB // 2)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=3, tie_word_embeddings=True)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_budget_is_the_share_of_total_memory_left_after_everything_else() -> None:
    assert kv_budget(H100, 0.9) == int(80 * GiB * 0.9) - 17 * GiB
    blocks = gpu_kv_blocks(H100, 0.9, bytes_per_block=2 * MiB, max_model_len=8192, block_size=16)
    assert blocks == (int(72 * GiB) - 17 * GiB) // (2 * MiB)
    # Free memory beyond total * utilization is not ours to take: the same budget with an idle card.
    idle = GpuMemory(**{**H100.__dict__, "free_at_start": 80 * GiB})
    assert gpu_kv_blocks(idle, 0.9, 2 * MiB, 8192, 16) == blocks


def test_a_budget_below_one_request_fails_with_the_numbers_and_flags() -> None:
    big = GpuMemory(**{**H100.__dict__, "activations": 56.5 * GiB})  # leaves 0.5 GiB: 256 blocks of 2 MiB
    with pytest.raises(KvCacheSizeError) as err:
        gpu_kv_blocks(big, 0.9, 2 * MiB, max_model_len=8192, block_size=16)
    msg = str(err.value)
    for text in ("--max-model-len 8192", "needs 512 blocks", "holds 256", "total 80.00", "free at start 79.00",
                 "requested 72.00", "weights 14.00", "peak activations 56.50", "KV budget 0.50",
                 "--gpu-memory-utilization", "--max-num-batched-tokens", "--max-num-seqs", "--num-kv-blocks"):
        assert text in msg, (text, msg)
    # A negative budget is the same error, never "1 block".
    with pytest.raises(KvCacheSizeError, match="KV budget -"):
        gpu_kv_blocks(GpuMemory(**{**H100.__dict__, "weights": 75 * GiB}), 0.9, 2 * MiB, 16, 16)


def test_memory_held_by_others_at_start_fails_before_anything_loads() -> None:
    with pytest.raises(KvCacheSizeError) as err:
        memory_profile.check_free_at_start(total=80 * GiB, free=40 * GiB, utilization=0.9)
    msg = str(err.value)
    assert "40.00 GiB free" in msg and "72.00 GiB" in msg and "at most 0.50" in msg, msg
    busy = GpuMemory(**{**H100.__dict__, "free_at_start": 60 * GiB})
    with pytest.raises(KvCacheSizeError, match="--gpu-memory-utilization 0.9 requests 72.00 GiB"):
        gpu_kv_blocks(busy, 0.9, 2 * MiB, 8192, 16)
    memory_profile.check_free_at_start(80 * GiB, 60 * GiB, 0.7)  # a lower share fits beside them


def test_cpu_sizing_and_explicit_blocks_must_hold_one_request() -> None:
    assert cpu_kv_blocks(2.0, 1, MiB, 8192, 16) == 2048
    assert cpu_kv_blocks(2.0, 2, MiB, 8192, 16) == 1024  # the flag is the whole group's
    with pytest.raises(KvCacheSizeError, match=r"needs 512 blocks.*--kv-cache-memory 0.25 GiB holds 256\."):
        cpu_kv_blocks(0.25, 1, MiB, 8192, 16)
    assert check_num_kv_blocks(512, 8192, 16) == 512
    with pytest.raises(KvCacheSizeError, match="--num-kv-blocks 511 cannot hold one request of --max-model-len 8192"):
        check_num_kv_blocks(511, 8192, 16)


def test_engine_start_fails_on_a_too_small_cache(tiny_dir: str) -> None:
    with pytest.raises(KvCacheSizeError, match="--num-kv-blocks 8 cannot hold"):
        EngineCore(EngineConfig(model=tiny_dir, dtype="float32", num_kv_blocks=8, max_model_len=256))
    if not torch.cuda.is_available():  # --kv-cache-memory sizes the CPU cache only
        # 2 layers x 2 KV heads x 8 dims x 2 (K, V) x 4 bytes x 16 tokens = 4 KiB a block; 256 tokens need 16.
        with pytest.raises(KvCacheSizeError, match=r"--kv-cache-memory \S+ GiB holds 15\. "):
            EngineCore(EngineConfig(model=tiny_dir, dtype="float32", kv_cache_memory=15 * 4096 / GiB,
                                    max_model_len=256))  # fmt: skip
    ok = EngineCore(EngineConfig(model=tiny_dir, dtype="float32", num_kv_blocks=16, max_model_len=256))
    assert ok.max_model_len == 256


def test_profiling_step_runs_at_the_largest_shapes(tiny_dir: str) -> None:
    """The dummy step the CUDA sizing measures, run here on CPU: prefills summing to max_num_batched_tokens
    through the runner's own _prepare, then the LM head and a top-k / top-p / logprobs sampler at max_num_seqs."""
    core = EngineCore(EngineConfig(model=tiny_dir, dtype="float32", num_kv_blocks=64, max_model_len=100,
                                   max_num_batched_tokens=250, max_num_seqs=40))  # fmt: skip
    seen: list[int] = []
    model = core.runner.model
    forward, logits = model.forward, model.compute_logits
    model.forward = lambda ids, pos, meta: seen.extend([ids.numel(), int(pos.max())]) or forward(ids, pos, meta)
    model.compute_logits = lambda h: seen.append(h.shape[0]) or logits(h)
    memory_profile._profile_step(core.runner, 100, padded_size)
    # 99 + 99 + 52 tokens (250), padded as the runner pads a step (to 256 where torch's fp32 matmul runs; not at
    # all on our fp32 kernel), each the last chunk of a 99-token context; 40 sampler rows
    assert seen == [padded_size(250, core.runner.min_rows), 98, 40]
    if core.runner.device.type == "cpu":
        assert core.runner.min_rows == (1 if HAS_F32_LINEAR else 8)


@pytest.mark.parametrize(("flags", "reason"), [
    (["--num-kv-blocks", "4"], "--num-kv-blocks 4 cannot hold one request of --max-model-len 2048"),
    (["--kv-cache-dtype", "fp8", "--dtype", "float32"], "--kv-cache-dtype fp8 runs on CPU with a bfloat16 model only"),
])  # fmt: skip
def test_launch_prints_the_error_and_exits_without_restarting(tmp_path, flags: list[str], reason: str) -> None:
    """Memory that cannot hold the engine, or flags that do not go together: one clear line, no traceback."""
    server = Server(tmp_path, *flags, "--max-engine-restarts", "3")
    code = server.proc.wait(timeout=180)
    log = server.log_text()
    assert code != 0, log
    assert "error:" in log and reason in log, log
    assert "restart" not in log.lower() and "Traceback" not in log, log


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA memory profile needs a GPU")
def test_cuda_start_profiles_and_sizes_within_the_share(tiny_dir: str) -> None:
    # 0.1% of the card cannot hold the 512 MiB reserve for the (Triton backend's) CUDA graphs: the profile runs,
    # then the start fails.
    with pytest.raises(KvCacheSizeError, match=r"peak activations .* KV budget -"):
        EngineCore(EngineConfig(model=tiny_dir, dtype="bfloat16", gpu_memory_utilization=0.001, max_model_len=256,
                                attention_backend="triton"))  # fmt: skip
    core = EngineCore(EngineConfig(model=tiny_dir, dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=256,
                                   max_num_seqs=8))  # fmt: skip
    assert core.runner.num_blocks == 8 * 16  # the tiny model's cache is capped at max_num_seqs full requests
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    results = run_engine(core, [EngineRequest("a", [5, 6, 7], params)])
    assert len(tokens_of(results, ["a"])[0]) == 3


def test_step_budget_defaults_as_vllm_server(monkeypatch) -> None:
    """--max-num-batched-tokens unset: 8192 on a GPU of 70 GiB or more other than an A100, 2048 elsewhere."""
    cuda = torch.device("cuda")
    for name, gib, want in [("NVIDIA H200", 139.8, 8192), ("NVIDIA H100 80GB HBM3", 79.2, 8192),
                            ("NVIDIA A100-SXM4-80GB", 79.2, 2048), ("NVIDIA L40S", 44.4, 2048)]:  # fmt: skip
        props = SimpleNamespace(name=name, total_memory=int(gib * 2**30))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
        assert step_token_budget(None, cuda) == want, name
        assert step_token_budget(512, cuda) == 512  # a flag always wins
    assert step_token_budget(None, torch.device("cpu")) == 2048
