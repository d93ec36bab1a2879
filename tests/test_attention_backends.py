"""The three attention backends agree on a tiny random Llama: torch (the reference), our C kernels, and Triton
(on CPU through Triton's interpreter, fp32). One mixed step holds decodes, a prefill chunk over a cached prefix, a
fresh prefill and padding rows; with full attention, and with a sliding window that most of its contexts pass.
Also: CUDA-graph-style padding (seq_len 0, fixed wide tables), select_backend.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch
import transformers

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:  # the interpreter is picked when the kernels are decorated: before their module is imported
    os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from engine_core.attention import (  # noqa: E402
    AttentionMetadata,
    CpuKernelBackend,
    TorchBackend,
    select_backend,
    triton_kernels,
)
from engine_core.attention.triton_backend import TritonBackend  # noqa: E402
from engine_core.cpu_kernels import cpu_kernels  # noqa: E402
from engine_core.models.loader import build_model  # noqa: E402
from tests.cpu_features import HAS_PREFILL  # noqa: E402
from tests.model_harness import BLOCK_SIZE, PagedRun  # noqa: E402

if not ON_CUDA and not isinstance(triton_kernels._decode_kernel, InterpretedFunction):
    importlib.reload(triton_kernels)  # imported earlier in this process without the interpreter

CPU = torch.device("cpu")
TOL = 1e-4


@pytest.fixture(scope="module", params=[None, 20], ids=["full", "window"])
def model(request) -> torch.nn.Module:
    """With a window of 20 keys (Mistral's sliding window), narrower than most contexts of the steps below."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=96,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        sliding_window=request.param, architectures=["MistralForCausalLM"])  # fmt: skip
    ours = build_model(config, torch.float32, CPU, 128)
    assert all(a.window == request.param for a in ours.attention_layers())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    return ours


class OnCuda(TritonBackend):
    """The Triton backend under these CPU-built runs on a GPU machine: inputs go to the GPU, the caches it wrote
    and its output come back."""

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:  # fmt: skip
        gpu = torch.device("cuda")
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        chunks = [dataclasses.replace(c, block_ids=c.block_ids.to(gpu)) for c in meta.prefills]
        moved = AttentionMetadata.build(meta.slot_mapping.to(gpu), None if tables is None else tables.to(gpu),
                                        None if lens is None else lens.to(gpu), chunks, meta.block_size)  # fmt: skip
        k_gpu, v_gpu = k_cache.to(gpu), v_cache.to(gpu)
        out = super().forward(q.to(gpu), k.to(gpu), v.to(gpu), k_gpu, v_gpu, moved, scale, window)
        k_cache.copy_(k_gpu)
        v_cache.copy_(v_gpu)
        return out.cpu()


def backends() -> dict[str, object]:
    kernels = cpu_kernels()
    assert kernels is not None, "the C compiler is part of the supported setup; the kernels must build"
    triton = OnCuda() if ON_CUDA else TritonBackend()
    return {"torch": TorchBackend(), "cpu": CpuKernelBackend(kernels, kernel_prefill=HAS_PREFILL), "triton": triton}


def three_steps(model, backend) -> list[torch.Tensor]:
    """Prefills (one leaves a cached prefix), a mixed step, then a decode of every sequence."""
    g = torch.Generator().manual_seed(1)
    prompt = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 66, 70, 11)]
    run = PagedRun(model, 4, 80, backend=backend)
    first = run.prefill([prompt[0], prompt[1], prompt[2][:48]], seqs=[0, 1, 2])
    # 2 decodes, seq 2's last 22 tokens over its 48 cached ones (70 keys: two 64-key tiles), seq 3 fresh, 3 pads
    mixed = run.mixed([5, 7], [prompt[2][48:], prompt[3]], seqs=[2, 3], pad=3)
    last = run.decode([1, 2, 3, 4])
    return [*first, mixed, last]


def test_backends_agree_on_a_mixed_step(model) -> None:
    results = {name: three_steps(model, backend) for name, backend in backends().items()}
    reference = results.pop("torch")
    assert reference[3].shape == (2 + 22 + 11 + 3, 96)
    for name, steps in results.items():
        for i, (ours, ref) in enumerate(zip(steps, reference, strict=True)):
            assert torch.allclose(ours, ref, atol=TOL, rtol=TOL), (name, i, (ours - ref).abs().max().item())


def test_padding_rows_of_a_graph_batch(model) -> None:
    """A graph batch: real rows then rows with seq_len 0, tables at a fixed width far beyond any sequence and
    stale ids past each one's blocks. Real rows match the unpadded call; padding rows come out finite."""
    torch.manual_seed(2)
    q_heads, kv_heads, head_dim, num_blocks = 4, 2, 16, 40
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    lens = torch.tensor([3, 17, 9, 0, 0])
    tables = torch.randint(0, num_blocks - 1, (5, 32))  # width 32 blocks: 128 keys
    q = torch.randn(5, q_heads, head_dim)
    k_new, v_new = torch.randn(5, kv_heads, head_dim), torch.randn(5, kv_heads, head_dim)
    scratch = torch.full((5,), (num_blocks - 1) * BLOCK_SIZE)
    for name, backend in backends().items():
        index = backend.index_dtype
        padded = AttentionMetadata.build(scratch, tables.to(index), lens.to(index), [], BLOCK_SIZE)
        out = backend.forward(q, k_new, v_new, k_cache.clone(), v_cache.clone(), padded, 0.25)
        exact = AttentionMetadata.build(scratch[:3], tables[:3, :5].to(index), lens[:3].to(index), [], BLOCK_SIZE)
        want = backend.forward(q[:3], k_new[:3], v_new[:3], k_cache.clone(), v_cache.clone(), exact, 0.25)
        assert torch.allclose(out[:3], want, atol=TOL, rtol=TOL), name
        assert torch.isfinite(out).all(), name


def test_select_backend(monkeypatch) -> None:
    monkeypatch.delenv("ROSEINFER_ATTENTION_BACKEND", raising=False)
    f32 = torch.float32

    def pick(choice: str, dtype=f32, device=CPU, heads=(9, 3, 64)):
        return select_backend(choice, device, dtype, *heads, 16)

    auto = pick("auto")
    assert isinstance(auto, CpuKernelBackend) and auto.kernel_prefill == HAS_PREFILL  # see cpu_features
    assert isinstance(pick("auto", torch.bfloat16), CpuKernelBackend)
    # head_dim 24: the decode kernel takes it, the prefill kernel (multiples of 16) does not
    odd = pick("auto", heads=(6, 2, 24))
    assert isinstance(odd, CpuKernelBackend) and not odd.kernel_prefill
    assert type(pick("auto", torch.float16)) is TorchBackend  # no fp16 kernels: the torch path
    with pytest.raises(ValueError, match="CPU attention kernels"):
        pick("cpu", torch.float16)
    assert type(pick("torch")) is TorchBackend
    assert isinstance(pick("triton", device=torch.device("cuda")), TritonBackend)
    assert isinstance(pick("auto", device=torch.device("cuda")), TritonBackend)  # no GPU touched to choose
    with pytest.raises(ValueError, match="expected one of"):
        pick("flash")
    monkeypatch.setenv("ROSEINFER_ATTENTION_BACKEND", "torch")
    assert type(pick("auto")) is TorchBackend
    assert isinstance(pick("cpu"), CpuKernelBackend)  # the flag wins over the environment
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="interpreter"):
        pick("triton")
    assert TritonBackend.graphable and not TorchBackend.graphable and not CpuKernelBackend.graphable


def test_torch_decode_gathers_a_slice_of_rows_at_a_time(monkeypatch) -> None:
    """Many decode rows over wide tables (a recompute of a request's outputs) gather in slices under the byte
    bound, with the result of one gather: each row attends on its own."""
    from engine_core.attention import torch_backend

    torch.manual_seed(3)
    k_cache, v_cache = torch.randn(2, 30, BLOCK_SIZE, 2, 16).unbind(0)
    rows = 11
    tables = torch.randint(0, 30, (rows, 7))
    lens = torch.randint(1, 7 * BLOCK_SIZE + 1, (rows,))
    q = torch.randn(rows, 4, 16)
    meta = AttentionMetadata.build(torch.zeros(rows, dtype=torch.long), tables, lens, [], BLOCK_SIZE)
    whole = TorchBackend().decode(q, k_cache, v_cache, meta, 0.25)
    gathered: list[int] = []
    decode_rows = torch_backend._decode_rows
    monkeypatch.setattr(torch_backend, "_decode_rows", lambda q, *a: gathered.append(q.shape[0]) or decode_rows(q, *a))
    monkeypatch.setattr(torch_backend, "MAX_DECODE_GATHER_BYTES", 4 * 2 * 7 * k_cache[0].numel() * 4)  # 4 rows' worth
    meta = AttentionMetadata.build(torch.zeros(rows, dtype=torch.long), tables, lens, [], BLOCK_SIZE)
    sliced = TorchBackend().decode(q, k_cache, v_cache, meta, 0.25)
    assert gathered == [4, 4, 3]
    assert torch.allclose(sliced, whole, atol=TOL, rtol=TOL)
