"""GPTQ, AWQ and compressed-tensors checkpoints (engine_core/models/prequantized.py): the packed layouts read as
their tools define them, a whole checkpoint read as the float weights it stands for (transformers on those weights
is the reference), the default model served from its GPTQ form on the int4 kernel, and a clear error for what is
not supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from bench.make_random_model import write_model
from bench.quantize_checkpoint import convert
from common.checkpoint_quant import QuantScheme, read_scheme
from common.model_errors import ModelSourceError
from common.model_source import resolve_model
from engine_core.core import EngineCore
from engine_core.models.loader import load_model
from engine_core.models.prequantized import unpack
from engine_core.models.quant import Int4Weights, QuantizedLinear, dequantize, prepare_linears
from tests.cpu_features import HAS_INT4_LINEAR
from tests.engine_helpers import fp32_config, greedy_request, mixed_prompts, run_engine
from tests.model_harness import PagedRun
from tests.test_model_parity import TOL, hf_logits, max_diff

CPU = torch.device("cpu")
WORD = 0x76543210  # nibbles 0, 1, ..., 7 from the lowest bits up


def _word_tensor(rows: int, cols: int) -> torch.Tensor:
    return torch.full((rows, cols), WORD, dtype=torch.int32)


def test_gptq_packs_eight_input_features_a_word_lowest_first() -> None:
    """qweight [K / 8, N]: feature 8r + i of output n is nibble i of word [r, n]; qzeros [groups, N / 8] pack the
    outputs the same way, and the original format ("gptq") stores zero - 1."""
    parts = {"qweight": _word_tensor(4, 8), "qzeros": _word_tensor(1, 1), "scales": torch.ones(1, 8).half()}
    q, scale, mins = unpack(parts, QuantScheme("gptq", -1, 1))
    assert q.shape == (8, 32) and torch.equal(q[3], torch.arange(8, dtype=torch.uint8).repeat(4))
    assert torch.equal(mins[:, 0], -(torch.arange(8) + 1).float())  # stored zero 0..7 -> 1..8
    assert torch.equal(scale, torch.ones(8, 1))
    _, _, mins_v2 = unpack(parts, QuantScheme("gptq", -1, 0))
    assert torch.equal(mins_v2[:, 0], -torch.arange(8).float())


def test_awq_packs_eight_outputs_a_word_in_its_own_order() -> None:
    """AWQ's qweight [K, N / 8] packs the outputs, a word's nibbles holding columns 0 2 4 6 1 3 5 7; its zeros the
    same, stored as they are."""
    parts = {"qweight": _word_tensor(32, 1), "qzeros": _word_tensor(1, 1), "scales": torch.full((1, 8), 0.5).half()}
    q, scale, mins = unpack(parts, QuantScheme("awq", 32, 0))
    column_of_nibble = [0, 2, 4, 6, 1, 3, 5, 7]
    expected = torch.tensor([column_of_nibble.index(c) for c in range(8)], dtype=torch.uint8)
    assert torch.equal(q[:, 0], expected) and torch.equal(q[:, 31], expected)
    assert torch.equal(mins[:, 0], -0.5 * expected.float()) and torch.equal(scale, torch.full((8, 1), 0.5))


def test_compressed_tensors_packs_eight_input_features_a_word_each_its_signed_value_plus_8() -> None:
    """weight_packed [N, K / 8] packs along the input features; weight_zero_point [N / 8, groups] along the outputs;
    symmetric checkpoints store no zero points: every zero is 8 (a signed 0)."""
    parts = {"weight_packed": _word_tensor(8, 4), "weight_zero_point": _word_tensor(1, 1),
             "weight_scale": torch.ones(8, 1, dtype=torch.bfloat16)}  # fmt: skip
    q, _, mins = unpack(parts, QuantScheme("compressed-tensors", -1))
    assert torch.equal(q[5], torch.arange(8, dtype=torch.uint8).repeat(4))
    assert torch.equal(mins[:, 0], -torch.arange(8).float())
    _, _, mins_sym = unpack(parts, QuantScheme("compressed-tensors", -1, symmetric=True))
    assert torch.equal(mins_sym, torch.full((8, 1), -8.0))


def test_each_run_of_32_takes_its_groups_scale_and_zero() -> None:
    """Group 64 over 128 features: runs 0-1 are group 0's, runs 2-3 group 1's; a g_idx that splits a run fails."""
    scales = torch.tensor([[1.0] * 8, [2.0] * 8]).half()
    zeros = torch.tensor([[0x33333333], [0x55555555]], dtype=torch.int32)  # every zero 3, then 5 (stored)
    parts = {"qweight": _word_tensor(16, 8), "qzeros": zeros, "scales": scales,
             "g_idx": (torch.arange(128) // 64).int()}  # fmt: skip
    _, scale, mins = unpack(parts, QuantScheme("gptq", 64, 0))
    assert torch.equal(scale[0], torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert torch.equal(mins[0], torch.tensor([-3.0, -3.0, -10.0, -10.0]))
    parts["g_idx"] = torch.arange(128).int() % 2  # activation order: neighbours in different groups
    with pytest.raises(ModelSourceError, match="desc_act"):
        unpack(parts, QuantScheme("gptq", 64, 0))


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64])  # one block, streamed chunk by chunk; panels widened once
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (100, 1536)])
def test_runs_of_chunks_sharing_scales_sum_before_scaling(rows, out_features, in_features) -> None:
    """A checkpoint's group of 128 is four of our chunks of 32 with the same scale and min: the AMX kernel sums such
    a run in its tiles and scales it once (576 features: runs of 4, 4, 4, 4 and 2). Within bf16 of the exact float
    matmul, and each row bit for bit what it is beside others."""
    torch.manual_seed(rows)
    iw = Int4Weights(torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16))
    chunks = in_features // 32
    iw.weight_q.data = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    per_group = torch.rand(out_features, -(-chunks // 4)) * 0.01
    iw.weight_scale.data = per_group.repeat_interleave(4, dim=1)[:, :chunks].contiguous()
    iw.weight_min.data = (-8 * iw.weight_scale.data).contiguous()
    exact_weight = dequantize(*iw.parts())
    layer = QuantizedLinear(iw, "int4")
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    exact = x.float() @ exact_weight.T
    out = layer(x)
    assert torch.allclose(out.float(), exact, atol=2e-2 * exact.abs().max().item(), rtol=1e-2)
    for r in range(rows):
        assert torch.equal(layer(x[r : r + 1]), out[r : r + 1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model("tiny", tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("method, group_size, sym, fmt", [
    ("gptq", 64, True, "gptq"),  # most GPTQ checkpoints: symmetric, the original format
    ("gptq", 32, False, "gptq"),
    ("gptq", -1, False, "gptq_v2"),  # one group a row, zeros stored as they are
    ("awq", 64, False, ""),
    ("compressed-tensors", 32, True, ""),  # llm-compressor's W4A16: symmetric, no zero points stored
    ("compressed-tensors", -1, False, ""),  # per channel, zero points packed along the outputs
])  # fmt: skip
def test_a_checkpoint_reads_as_the_weights_it_stands_for(tiny, tmp_path, method, group_size, sym, fmt) -> None:
    """In fp32 the quantized linears run torch's matmul on the dequantized weights: our logits equal
    transformers' on the float32 weights the packed values stand for (computed before packing), where the
    original float weights are far off (a misread layout is off by as much)."""
    quantized, reference = tmp_path / "q", tmp_path / "ref"
    convert(tiny, quantized, method, group_size, sym, fmt or "gptq", reference)
    ours = load_model(quantized, torch.float32, CPU, 256)
    prepare_linears(ours, "none", CPU, torch.float32)
    layers = [m for m in ours.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4 and not isinstance(ours.lm_head, QuantizedLinear)  # qkv, o, gate_up, down
    prompt = list(range(5, 45))
    logits = PagedRun(ours, 1, 64).prefill([prompt])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    assert max_diff(logits, hf_logits(hf, prompt)) < TOL
    assert max_diff(logits, hf_logits(plain, prompt)) > 20 * TOL


@pytest.mark.parametrize("method, side_file", [("gptq", "quantize_config.json"), ("awq", "quant_config.json")])
def test_older_checkpoints_keep_their_quantization_config_beside_config_json(tiny, tmp_path, method, side_file) -> None:
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json (with its own key names), no quant_method."""
    convert(tiny, tmp_path / "q", method, 64, method == "gptq", "gptq", tmp_path / "ref")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = config.pop("quantization_config")
    qc.pop("quant_method")
    if method == "awq":
        qc = {"w_bit": qc["bits"], "q_group_size": qc["group_size"], "zero_point": True, "version": "GEMM"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    (tmp_path / "q" / side_file).write_text(json.dumps(qc))
    assert resolve_model(str(tmp_path / "q")).architecture == "LlamaForCausalLM"
    ours = load_model(tmp_path / "q", torch.float32, CPU, 256)
    prepare_linears(ours, "none", CPU, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    prompt = list(range(5, 45))
    assert max_diff(PagedRun(ours, 1, 64).prefill([prompt])[0], hf_logits(hf, prompt)) < TOL


def test_a_mixtures_experts_read_as_the_weights_they_stand_for(tmp_path) -> None:
    """Qwen2-MoE with its experts and shared expert quantized too (each one linear per expert here)."""
    config = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=128, experts_implementation="eager",
                                         architectures=["Qwen2MoeForCausalLM"])  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(tmp_path / "plain")
    convert(tmp_path / "plain", tmp_path / "q", "awq", 32, False, "gptq", tmp_path / "ref")
    ours = load_model(tmp_path / "q", torch.float32, CPU, 256)
    prepare_linears(ours, "none", CPU, torch.float32)
    assert sum(isinstance(m, QuantizedLinear) for m in ours.modules()) == 2 * (4 + 4 * 2)  # + experts' 2 each
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32,
                                                           experts_implementation="eager").eval()  # fmt: skip
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32,
                                                              experts_implementation="eager").eval()  # fmt: skip
    prompt = list(range(5, 30))
    logits = PagedRun(ours, 1, 64).prefill([prompt])[0]
    assert max_diff(logits, hf_logits(hf, prompt)) < TOL < max_diff(logits, hf_logits(plain, prompt)) / 20


@pytest.fixture(scope="module")
def smollm2_gptq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model as a symmetric GPTQ checkpoint, groups of 64 (its 576 features are 9 of them)."""
    out = tmp_path_factory.mktemp("smollm2") / "gptq"
    convert(resolve_model(None).path, out, "gptq", 64, True, "gptq", None)
    return out


def _prompt_logprobs(model: Path, dtype: str) -> tuple[EngineCore, list[list[float]]]:
    core = EngineCore(fp32_config(model=str(model), dtype=dtype, max_num_batched_tokens=512, device="cpu"))
    reqs = [greedy_request(f"p{i}", p, 4, prompt_logprobs=0) for i, p in enumerate(mixed_prompts())]
    results = run_engine(core, reqs)
    return core, [results[r.request_id][0].prompt_logprobs.token_logprobs for r in reqs]


@pytest.mark.skipif(not HAS_INT4_LINEAR, reason="without the int4 kernel, bf16 runs the same torch path as fp32")
def test_the_default_models_gptq_form_runs_on_the_int4_kernel(smollm2_gptq) -> None:
    """Served in bf16, every quantized linear is packed for our int4 kernel (and the one-call decode stack takes
    them) and the prompts' tokens get the logprobs the exact weights give them in fp32 (torch's matmul on the
    dequantized weights), within bf16's rounding. Measured: 0.044 nats apart on average over 1809 tokens; the
    default model's own bf16 weights (another set of weights, as a misread layout would be) 0.83."""
    core, bf16 = _prompt_logprobs(smollm2_gptq, "bfloat16")
    model = core.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * model.config.num_hidden_layers
    assert all(m.kernels is not None and m.packed_weight.dtype == torch.uint8 for m in layers)
    assert model.decode_stack is not None
    _, fp32 = _prompt_logprobs(smollm2_gptq, "float32")
    pairs = [(x, y) for a, b in zip(bf16, fp32, strict=True) for x, y in zip(a, b, strict=True)]
    assert len(pairs) > 1000
    assert sum(abs(x - y) for x, y in pairs) / len(pairs) < 0.1


CT_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": CT_WEIGHTS}}}  # fmt: skip


def _with_quant_config(tmp_path: Path, **fields) -> dict:
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    qc = (CT if fields.get("quant_method") == "compressed-tensors" else gptq) | fields
    return {"architectures": ["LlamaForCausalLM"], "quantization_config": qc}


@pytest.mark.parametrize("fields, message", [
    ({"bits": 8}, "bits=8 is not supported"),
    ({"group_size": 48}, "group_size=48"),
    ({"desc_act": True}, "desc_act=true"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "awq", "zero_point": False}, "zero_point=false"),
    (CT | {"format": "float-quantized"}, "format \\['float-quantized'\\]"),
    (CT | {"config_groups": {"g": {"weights": CT_WEIGHTS, "input_activations": {"num_bits": 8}}}},
     "quantized activations"),
    (CT | {"config_groups": {"g": {"weights": CT_WEIGHTS | {"actorder": "group"}}}}, "actorder='group'"),
    (CT | {"config_groups": {"g": {"weights": CT_WEIGHTS | {"num_bits": 8}}}}, "bits=8"),
])  # fmt: skip
def test_what_cannot_be_served_fails_before_the_engine_starts(tmp_path, fields: dict, message) -> None:
    shutil.copytree(resolve_model(None).path, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | _with_quant_config(tmp_path, **fields)))
    with pytest.raises(ModelSourceError, match=message):
        resolve_model(str(tmp_path / "m"))


def test_quantization_flag_against_the_checkpoint(tmp_path) -> None:
    """vLLM's names for the checkpoint's own method are taken (and must be right); int4 quantizes only what the
    checkpoint left in floats (its LM head); int8 would quantize it again, on another grid, and is refused."""
    gptq, plain = _with_quant_config(tmp_path), {"architectures": ["LlamaForCausalLM"]}
    for flag in ("none", "int4", "gptq", "gptq_marlin"):
        assert read_scheme(gptq, flag) == QuantScheme("gptq", 128, 1)
    with pytest.raises(ModelSourceError, match="already quantized to 4 bits by GPTQ"):
        read_scheme(gptq, "int8")
    with pytest.raises(ModelSourceError, match="--quantization awq: this checkpoint is quantized by GPTQ"):
        read_scheme(gptq, "awq")
    with pytest.raises(ModelSourceError, match="--quantization gptq: this checkpoint is not quantized"):
        read_scheme(plain, "gptq")
    assert read_scheme(plain, "int8") is None
    ct = {"quantization_config": CT}
    assert read_scheme(ct, "compressed-tensors") == QuantScheme("compressed-tensors", 128, symmetric=True)
    with pytest.raises(ModelSourceError, match="gptq: this checkpoint is quantized by compressed-tensors"):
        read_scheme(ct, "gptq")
