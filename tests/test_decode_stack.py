"""Decode-only CPU steps through the layer stack in one C call (engine_core/models/cpu_decode.py): bit for bit the
logits of the Python layers, in bf16 and int8, with and without biases, with Granite's multipliers, OLMo 2 and 3's
post-norm layers, Qwen3's q/k norms, SmolLM3's layers without rotary embeddings, Phi-3's partial rotary and Gemma
3's layer; taken only by decode-only steps; attached by the model runner where it can run, and nowhere else."""

from __future__ import annotations

import pytest
import torch
import transformers

from bench.make_random_lora import ALL, write_adapter
from common.config import EngineConfig
from common.lora import lora_modules
from engine_core.attention import TorchBackend
from engine_core.core import EngineCore
from engine_core.lora import LoraAdapters
from engine_core.models.cpu_decode import DecodeStack
from engine_core.models.loader import build_model
from engine_core.models.quant import prepare_linears
from tests.cpu_features import (
    HAS_LINEAR,
    needs_fp8_decode,
    needs_int4_kernels,
    needs_int8_kernels,
    needs_linear_kernels,
)
from tests.engine_helpers import greedy_request, run_engine, save_tiny_llama, tokens_of
from tests.model_harness import PagedRun
from tests.test_model_parity import tiny_hf_model

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: the stack runs our CPU kernels")


def tiny_llama(variant: str, quantization: str | None = None, window: int | None = None) -> torch.nn.Module:
    """`variant`: Llama ("llama", or "llama-bias" with q/k/v/o biases), Granite (Llama's layer with its four
    multipliers), OLMo 2 (norms after the blocks, q and k each normed whole), OLMo 3 (and a sliding layer of window
    24 between full ones, each kind with its rotary base), Qwen3 (q and k heads normed; head_dim * heads != hidden),
    SmolLM3 (its middle layer without rotary embeddings), Phi-3 (3/4 of each head rotates), Gemma 3 (its four norms
    a layer, GeGLU, a sliding layer of window 24 and full layers with their own rotary base); `window`: Mistral's
    sliding window."""
    torch.manual_seed(0)
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, vocab_size=96, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
    gemma = variant == "gemma"
    config = (transformers.Qwen3Config(**shape, head_dim=64, architectures=["Qwen3ForCausalLM"])
              if variant == "qwen3" else
              transformers.GraniteConfig(**shape, embedding_multiplier=12.0, residual_multiplier=0.22,
                                         attention_multiplier=0.0078125, logits_scaling=8.0,
                                         architectures=["GraniteForCausalLM"])
              if variant == "granite" else
              transformers.Olmo2Config(**shape, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                       architectures=["Olmo2ForCausalLM"])
              if variant == "olmo2" else
              transformers.Olmo3Config(**shape, sliding_window=24, pad_token_id=None, bos_token_id=None,
                                       eos_token_id=None, layer_types=["sliding_attention", "full_attention",
                                                                       "sliding_attention"],
                                       rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 1e4},
                                                        "full_attention": {"rope_type": "default",
                                                                           "rope_theta": 1e6}},
                                       architectures=["Olmo3ForCausalLM"])
              if variant == "olmo3" else
              transformers.MistralConfig(**shape, sliding_window=window, architectures=["MistralForCausalLM"])
              if window else
              transformers.SmolLM3Config(**shape, no_rope_layers=[1, 0, 1], pad_token_id=None,
                                        architectures=["SmolLM3ForCausalLM"])
              if variant == "smollm3" else
              transformers.Phi3Config(**shape, pad_token_id=None, architectures=["Phi3ForCausalLM"],
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.75})
              if variant == "phi3" else
              transformers.Gemma3TextConfig(**shape, head_dim=32, sliding_window=24, query_pre_attn_scalar=24,
                                            layer_types=["full_attention", "sliding_attention", "full_attention"],
                                            final_logit_softcapping=5.0, architectures=["Gemma3ForCausalLM"])
              if gemma else
              transformers.LlamaConfig(**shape, attention_bias=variant == "llama-bias",
                                       architectures=["LlamaForCausalLM"]))  # fmt: skip
    model = build_model(config, torch.bfloat16, CPU, 256)
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm_one = 0.0 if gemma else 1.0  # Gemma's norms scale by 1 + weight
            param.copy_(norm_one + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    prepare_linears(model, quantization, CPU, torch.bfloat16)
    return model


def steps(model, stack: bool, kv_dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], int]:
    """Prefills, a mixed step, decodes of all five sequences, then of the first three: logits, and how many
    steps the stack ran."""
    # an fp8 cache in blocks of 8, which the AVX2 kernel takes (csrc/decode_avx2.c)
    run = PagedRun(model, 5, 120, dtype=torch.bfloat16, kv_dtype=kv_dtype, block_size=8 if kv_dtype else 4)
    model.decode_stack = DecodeStack.build(model) if stack else None
    assert (model.decode_stack is not None) == stack
    calls = 0
    if stack:
        real = model.decode_stack

        def counted(*args):
            nonlocal calls
            calls += 1
            return real(*args)

        model.decode_stack = _Spy(real, counted)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 33)]
    logits = run.prefill(prompts[:4], seqs=[0, 1, 2, 3])
    logits.append(run.mixed([5, 6, 7, 8], [prompts[4]], seqs=[4]))
    logits += [run.decode(torch.randint(0, 96, (5,), generator=g).tolist()) for _ in range(12)]
    logits += [run.decode([1, 2, 3]) for _ in range(3)]
    return logits, calls


class _Spy:
    """The stack with its calls counted."""

    def __init__(self, stack: DecodeStack, call) -> None:
        self.stack, self.call = stack, call

    def takes(self, meta, rows: int) -> bool:
        return self.stack.takes(meta, rows)

    def __call__(self, *args):
        return self.call(*args)


@needs_linear_kernels
@pytest.mark.parametrize("variant", ["llama", "llama-bias", "qwen3", "smollm3", "phi3", "gemma", "granite", "olmo2",
                                     "olmo3"])
@pytest.mark.parametrize("quantization", [None, pytest.param("int8", marks=needs_int8_kernels),
                                          pytest.param("int4", marks=needs_int4_kernels)])  # fmt: skip
def test_stack_gives_the_layers_logits_bit_for_bit(variant: str, quantization: str | None) -> None:
    model = tiny_llama(variant, quantization)
    assert (model.layers[0].self_attn.q_norm is not None) == (variant in ("qwen3", "gemma", "olmo2", "olmo3"))
    assert [layer.self_attn.rotate for layer in model.layers] == [True, variant != "smollm3", True]
    reference, none = steps(model, stack=False)
    ours, calls = steps(model, stack=True)
    assert none == 0 and calls == 15  # the 15 decode-only steps; never the prefills or the mixed step
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())


@needs_linear_kernels
def test_the_stack_attends_a_sliding_window_as_the_layers_do() -> None:
    """Mistral's window of 48: the decode steps' contexts grow from 41 to 55 keys across it; the stack passes each
    layer's window to the decode kernel, bit for bit what the layers get."""
    model = tiny_llama("llama", window=48)
    reference, _ = steps(model, stack=False)
    ours, calls = steps(model, stack=True)
    assert calls == 15
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())


@needs_linear_kernels
@needs_fp8_decode
@pytest.mark.parametrize("variant", ["llama", "qwen3", "gemma", "olmo3"])
def test_stack_over_an_fp8_kv_cache_gives_the_layers_logits_bit_for_bit(variant: str) -> None:
    """--kv-cache-dtype fp8: the stack writes its rows' K/V as csrc/kv_fp8.c rounds them and attends them through
    the same kernel the layers call (Gemma's and OLMo 3's sliding layers included)."""
    model = tiny_llama(variant)
    reference, _ = steps(model, stack=False, kv_dtype=torch.float8_e4m3fn)
    ours, calls = steps(model, stack=True, kv_dtype=torch.float8_e4m3fn)
    assert calls == 15
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())
    bf16, _ = steps(model, stack=True)
    assert not all(torch.equal(a, b) for a, b in zip(ours, bf16, strict=True))  # the fp8 cache changed something
    # near them: e4m3 keeps 3 mantissa bits
    assert all((a.float() - b.float()).norm() < 0.25 * b.float().norm() for a, b in zip(ours, bf16, strict=True))


def test_build_declines_what_it_cannot_run() -> None:
    model = tiny_llama("llama")
    assert DecodeStack.build(model) is None  # no KV cache bound yet: the layers attend with the torch reference
    PagedRun(model, 1, 16, dtype=torch.bfloat16)
    assert (DecodeStack.build(model) is not None) == HAS_LINEAR  # needs our packed bf16 linears
    PagedRun(model, 1, 16, dtype=torch.bfloat16, backend=TorchBackend())
    assert DecodeStack.build(model) is None  # torch attention backend
    fp32 = build_model(model.config, torch.float32, CPU, 256)
    PagedRun(fp32, 1, 16)
    assert DecodeStack.build(fp32) is None  # fp32: no packed bf16 linears


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-stack"), max_positions=512, init=0.3)


@pytest.fixture(scope="module")
def tiny_gemma_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-gemma-stack")
    tiny_hf_model("gemma3").save_pretrained(path)  # a sliding window of 8: the decodes cross it
    return str(path)


@pytest.mark.parametrize("model_dir", ["tiny_dir", "tiny_gemma_dir"])
def test_engine_attaches_the_stack_on_cpu_bf16_with_the_same_tokens(model_dir: str, request) -> None:
    model_dir = request.getfixturevalue(model_dir)
    config = EngineConfig(model=model_dir, dtype="bfloat16", kv_cache_memory=0.05, max_num_seqs=8)
    with_stack, without = EngineCore(config), EngineCore(config)
    assert (with_stack.runner.model.decode_stack is not None) == HAS_LINEAR  # see cpu_features
    without.runner.model.decode_stack = None
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 7][: 2 + i] for i in range(5)]
    requests = [greedy_request(f"r{i}", p, 24) for i, p in enumerate(prompts)]
    ours = tokens_of(run_engine(with_stack, requests, stagger=2), [r.request_id for r in requests])
    reference = tokens_of(run_engine(without, requests, stagger=2), [r.request_id for r in requests])
    assert ours == reference
    fp32 = EngineCore(EngineConfig(model=model_dir, dtype="float32", kv_cache_memory=0.05, max_num_seqs=8))
    assert fp32.runner.model.decode_stack is None


@needs_linear_kernels
@pytest.mark.parametrize("slots", [[1, 0, 2, 1, 2, 0, 1, 1, 2], [1] * 9])  # adapters among base rows; one on all
@pytest.mark.parametrize("gemma", [False, True])
def test_stack_adds_lora_adapters_as_the_layers_do(tmp_path, slots: list[int], gemma: bool) -> None:
    """Two adapters (one on every linear, one on q and v) over a decode step's rows: the stack's logits are the
    Python layers' bit for bit (gathered rows, and all rows at once), and not the base model's."""

    def decodes(stack: bool, lora: bool) -> list[torch.Tensor]:
        model = tiny_llama("gemma" if gemma else "llama")
        run = PagedRun(model, 9, 64, dtype=torch.bfloat16)
        model.decode_stack = DecodeStack.build(model) if stack else None
        config = model.config
        entries = [f"every={write_adapter(tmp_path / 'every', config, ALL, 8, 16, seed=1, std=0.1)}",
                   f"qv={write_adapter(tmp_path / 'qv', config, ['q_proj', 'v_proj'], 4, 8, seed=2, std=0.2)}"]
        modules = lora_modules(EngineConfig(enable_lora=True, lora_modules=entries)) if lora else []
        adapters = LoraAdapters.load(model, modules, 16, CPU, torch.bfloat16)
        adapters.attach()
        assert adapters.in_stack == (stack and lora)
        g = torch.Generator().manual_seed(1)
        run.prefill([torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 17, 9, 5, 12, 8, 4, 20, 6)])
        adapters.plan(slots)
        return [run.decode(torch.randint(0, 96, (9,), generator=g).tolist()) for _ in range(6)]

    reference, ours, base = decodes(stack=False, lora=True), decodes(stack=True, lora=True), decodes(True, False)
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())
    assert not torch.equal(ours[-1], base[-1])
