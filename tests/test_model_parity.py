"""Logits parity of our models with transformers' own implementations on the same weights (float32, CPU).

Ours run through the paged KV cache (tests/model_harness.py): batched flat prefill, batched decode, and
chunked prefill over a cached prefix. HF runs each full sequence alone with no cache; since attention is
causal, one HF forward over prompt + decoded tokens gives the reference for the prefill and every decode step.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from engine_core.models.loader import build_model, load_model, load_weights
from tests.model_harness import PagedRun

TOL = 1e-3
VOCAB = 128
MAX_POSITIONS = 128
CPU = torch.device("cpu")
PROMPT_LENS = [5, 12, 1, 23]  # one flat prefill batch; lengths straddle the 4-token cache blocks
DECODE_STEPS = 4
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB)

PHI3_LONGROPE = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * MAX_POSITIONS,
                     pad_token_id=None, bos_token_id=None, eos_token_id=None, architectures=["Phi3ForCausalLM"])
PHI3_LONGROPE["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                    "short_factor": [1.0, 1.5, 2.0, 1.2], "long_factor": [3.0, 5.0, 7.0, 9.0]}

TINY_CONFIGS = {
    "llama3-rope": lambda: transformers.LlamaConfig(
        **LLAMA_LIKE,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        architectures=["LlamaForCausalLM"],
    ),
    "qwen2": lambda: transformers.Qwen2Config(  # biased q/k/v, tied embeddings
        **LLAMA_LIKE,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    ),
    "qwen3": lambda: transformers.Qwen3Config(  # q/k norms per head, head_dim * heads != hidden, tied embeddings
        **LLAMA_LIKE,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    ),
    "smollm3": lambda: transformers.SmolLM3Config(  # its first layer without rotary embeddings (NoPE), tied embeddings
        **LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[0, 1], tie_word_embeddings=True,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        architectures=["SmolLM3ForCausalLM"],
    ),  # fmt: skip
    # Phi-3: q/k/v and gate/up fused in the checkpoint; half of each head rotates (Phi-4-mini: 3/4); LongRoPE's short
    # factors and its attention factor, contexts within the original length (tests/test_phi3.py: past it).
    "phi3": lambda: transformers.Phi3Config(
        **LLAMA_LIKE, **PHI3_LONGROPE, original_max_position_embeddings=MAX_POSITIONS
    ),
    "mistral": lambda: transformers.MistralConfig(  # head_dim * heads != hidden, a single KV head
        **LLAMA_LIKE,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        architectures=["MistralForCausalLM"],
    ),
    # Sliding windows narrower than the tests' contexts: Mistral 7B v0.1's (every layer), Qwen2's (layers past
    # max_window_layers); the window's masks where a step reaches past it, the kernels where not.
    "mistral-window": lambda: transformers.MistralConfig(
        **LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        architectures=["MistralForCausalLM"],
    ),  # fmt: skip
    "qwen2-window": lambda: transformers.Qwen2Config(
        **LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
        max_window_layers=1, architectures=["Qwen2ForCausalLM"],
    ),  # fmt: skip
    # Gemma 3: 1 + weight norms, scaled embeddings, GeGLU, q/k norms, four norms a layer, a sliding layer (window 8,
    # local rotary base) and a full one (linear rope scaling), query_pre_attn_scalar, final logit softcapping.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        max_position_embeddings=MAX_POSITIONS, architectures=["Gemma3ForCausalLM"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
    ),  # fmt: skip
    # Granite 3: embeddings, attention scores, each block's output and the logits scaled by its multipliers
    "granite": lambda: transformers.GraniteConfig(
        **LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=3.0, residual_multiplier=0.4,
        attention_multiplier=0.3, logits_scaling=0.5, tie_word_embeddings=True, architectures=["GraniteForCausalLM"],
    ),  # fmt: skip
    # Granite 4.0's attention-only models: Granite 3's layer, the MLP as shared_mlp (gate and up fused)
    "granite4": lambda: transformers.GraniteMoeHybridConfig(
        **LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, shared_intermediate_size=96, num_local_experts=0,
        layer_types=["attention", "attention"], position_embedding_type="rope", embedding_multiplier=3.0,
        residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=0.5, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, architectures=["GraniteMoeHybridForCausalLM"],
    ),  # fmt: skip
    "granite4-nope": lambda: transformers.GraniteMoeHybridConfig(  # no rotary embedding in any layer
        **LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, shared_intermediate_size=96, num_local_experts=0,
        layer_types=["attention", "attention"], position_embedding_type="nope", pad_token_id=None,
        bos_token_id=None, eos_token_id=None, architectures=["GraniteMoeHybridForCausalLM"],
    ),  # fmt: skip
    # OLMo 2: norms after the blocks, q and k each normed whole; OLMo 3: and a sliding layer (window 8) beside a full
    # one, each kind with its own rotary base
    "olmo2": lambda: transformers.Olmo2Config(
        **LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, architectures=["Olmo2ForCausalLM"],
    ),  # fmt: skip
    "olmo3": lambda: transformers.Olmo3Config(
        **LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, sliding_window=8, pad_token_id=None,
        bos_token_id=None, eos_token_id=None, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
        architectures=["Olmo3ForCausalLM"],
    ),  # fmt: skip
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=MAX_POSITIONS, bos_token_id=0, eos_token_id=0,
        architectures=["GPT2LMHeadModel"],
    ),  # fmt: skip
}
HF_CLASSES = {
    "llama3-rope": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "smollm3": transformers.SmolLM3ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "mistral-window": transformers.MistralForCausalLM,
    "qwen2-window": transformers.Qwen2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
    "granite": transformers.GraniteForCausalLM,
    "granite4": transformers.GraniteMoeHybridForCausalLM,
    "granite4-nope": transformers.GraniteMoeHybridForCausalLM,
    "olmo2": transformers.Olmo2ForCausalLM,
    "olmo3": transformers.Olmo3ForCausalLM,
    "gpt2": transformers.GPT2LMHeadModel,
}


def tiny_hf_model(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return randomized(HF_CLASSES[arch](TINY_CONFIGS[arch]()).eval())


def randomized(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """Every parameter randomised: HF's init zeroes biases and sets norms to 1, which would hide a dropped bias or
    norm weight; larger weights also make the logits O(1), so TOL means something."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = any(part in name for part in ("norm", "ln_")) and name.endswith(".weight")
            param.copy_(1 + 0.1 * torch.randn_like(param) if is_norm else 0.15 * torch.randn_like(param))
    return model


def ours_from(hf: transformers.PreTrainedModel) -> torch.nn.Module:
    model = build_model(hf.config, torch.float32, CPU, MAX_POSITIONS)
    load_weights(model, hf.state_dict())
    return model


@torch.inference_mode()
def hf_logits(hf: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def prefill_then_decode(ours, hf, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """(a) all prompts in one flat prefill, (b) `steps` batched greedy decodes; returns both max diffs."""
    run = PagedRun(ours, len(prompts), max(map(len, prompts)) + steps)
    prefill_out = run.prefill(prompts)
    seqs = [list(p) for p in prompts]
    decode_out: list[torch.Tensor] = []
    next_tokens = [int(out[-1].argmax()) for out in prefill_out]
    for _ in range(steps):
        for seq, token in zip(seqs, next_tokens, strict=True):
            seq.append(token)
        logits = run.decode(next_tokens)
        decode_out.append(logits)
        next_tokens = logits.argmax(-1).tolist()
    prefill_diff = decode_diff = 0.0
    for i, (prompt, seq) in enumerate(zip(prompts, seqs, strict=True)):
        ref = hf_logits(hf, seq)
        prefill_diff = max(prefill_diff, max_diff(prefill_out[i], ref[: len(prompt)]))
        # Decode step j fed seq[len(prompt) + j], so its logits sit at that position.
        ours_decode = torch.stack([step[i] for step in decode_out])
        decode_diff = max(decode_diff, max_diff(ours_decode, ref[len(prompt) : len(prompt) + steps]))
    return prefill_diff, decode_diff


def random_prompts(lens: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(params=list(TINY_CONFIGS))
def tiny(request) -> tuple[transformers.PreTrainedModel, torch.nn.Module]:
    hf = tiny_hf_model(request.param)
    return hf, ours_from(hf)


def test_batched_prefill_and_decode(tiny):
    hf, ours = tiny
    prefill_diff, decode_diff = prefill_then_decode(
        ours, hf, random_prompts(PROMPT_LENS, VOCAB), DECODE_STEPS
    )
    assert prefill_diff < TOL
    assert decode_diff < TOL


def test_chunked_prefill(tiny):
    """(c) Two prompts each fed in two batched chunks; the second chunk attends to the cached first."""
    hf, ours = tiny
    prompts = random_prompts([19, 10], VOCAB, seed=2)
    splits = [7, 4]  # not on block boundaries
    run = PagedRun(ours, len(prompts), 32)
    first = run.prefill([p[:s] for p, s in zip(prompts, splits, strict=True)])
    second = run.prefill([p[s:] for p, s in zip(prompts, splits, strict=True)])
    for prompt, a, b in zip(prompts, first, second, strict=True):
        assert max_diff(torch.cat([a, b]), hf_logits(hf, prompt)) < TOL


def test_logits_are_not_trivially_small(tiny):
    """Guards the tolerance: the logits being compared must vary far more than TOL."""
    hf, _ = tiny
    assert hf_logits(hf, random_prompts([8], VOCAB)[0]).std() > 0.1


def test_gpt2_bare_checkpoint_keys():
    """Old GPT-2 checkpoints have no "transformer." prefix and carry causal-mask buffers: both handled."""
    hf = tiny_hf_model("gpt2")
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.ones(1, 1, MAX_POSITIONS, MAX_POSITIONS).tril()
    state["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    ours = build_model(hf.config, torch.float32, CPU, MAX_POSITIONS)
    load_weights(ours, state)
    prompt = random_prompts([9], VOCAB)[0]
    assert max_diff(PagedRun(ours, 1, 16).prefill([prompt])[0], hf_logits(hf, prompt)) < TOL


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_load_model_from_safetensors(arch, tmp_path):
    hf = tiny_hf_model(arch)
    hf.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    ours = load_model(tmp_path, torch.float32, CPU, MAX_POSITIONS)
    prompt = random_prompts([11], VOCAB)[0]
    assert max_diff(PagedRun(ours, 1, 16).prefill([prompt])[0], hf_logits(hf, prompt)) < TOL


# --- The default model, SmolLM2-135M-Instruct (converted from its GGUF once, then cached) ---

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module")
def smollm2():
    from common.model_source import resolve_model

    path = resolve_model(None).path
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, torch.float32, CPU, 512)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in [*SMOL_PROMPTS, chat]]
    return hf, ours, prompts


def test_smollm2_parity(smollm2):
    hf, ours, prompts = smollm2
    assert len({len(p) for p in prompts}) > 1  # different lengths in one batch
    prefill_diff, decode_diff = prefill_then_decode(ours, hf, prompts, DECODE_STEPS)
    assert prefill_diff < TOL
    assert decode_diff < TOL
