"""A plain HF checkpoint -> the same model as a GPTQ, AWQ or compressed-tensors (W4A16) checkpoint, laid out as
those tools save them, for benchmarks and tests without a model hub. The weights are rounded to the nearest point
of each group's grid (no calibration: the layout, not the quality of the rounding, is what the engine reads),
every decoder layer's linear quantized, the embeddings and LM head left as they are.

python -m bench.quantize_checkpoint SRC DST --method gptq|awq|compressed-tensors [--group-size 128] [--sym]
    [--format gptq|gptq_v2] [--reference DIR]

--reference also writes the model with each quantized weight as the float32 it stands for, scale * (q - zero),
computed here before packing: what transformers runs to check the engine's reading of the packed layout.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(\w+\.)*\w+_proj\.weight$")  # experts too
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the column of a word of eight held in its nibbles 0..7, lowest first


def quantize(w: torch.Tensor, group_size: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> q [K, N] and zeros [G, N] (int32, 0..15), fp16 scales [G, N], by rounding to nearest."""
    n, k = w.shape
    size = k if group_size == -1 else group_size
    groups = w.float().view(n, k // size, size)
    low, high = groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)
    if sym:
        high = torch.maximum(high, -low)
        low = -high
    scale = ((high - low) / 15).clamp(min=1e-6).half()  # the fp16 scale is the one both sides use
    zero = torch.full_like(low, 8) if sym else torch.round(-low / scale.float()).clamp(1, 15)
    q = torch.round(groups / scale.float()[..., None]) + zero[..., None]
    q = q.clamp(0, 15).to(torch.int32).view(n, k)
    return q.T.contiguous(), zero.to(torch.int32).T.contiguous(), scale.T.contiguous()


def dequantized(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 [N, K] weight that q [K, N], zeros and scales [G, N] stand for."""
    k = q.shape[0]
    group = torch.arange(k) // (k if group_size == -1 else group_size)
    return ((q - zero[group]).float() * scale.float()[group]).T.contiguous()


def pack_words(values: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 values in 0..15 -> int32 words of eight along `dim`, value i of each eight in bits 4i."""
    values = values.movedim(dim, -1)
    eight = values.reshape(*values.shape[:-1], -1, 8).to(torch.int64)
    words = sum(eight[..., i] << (4 * i) for i in range(8))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the bits of an int32
    return words.movedim(-1, dim).contiguous()


def packed(method: str, q: torch.Tensor, zero: torch.Tensor, offset: int, sym: bool) -> dict[str, torch.Tensor]:
    if method == "compressed-tensors":  # [N, ...] as torch stores a linear; each value its signed self + 8
        parts = {"weight_packed": pack_words(q.T, 1), "weight_shape": torch.tensor([q.shape[1], q.shape[0]])}
        return parts if sym else parts | {"weight_zero_point": pack_words(zero.T, 0)}
    if method == "gptq":
        return {"qweight": pack_words(q, 0), "qzeros": pack_words(zero - offset, 1),
                "g_idx": torch.empty(0)}  # fmt: skip
    order = torch.tensor(AWQ_ORDER)
    interleave = lambda t: t.view(t.shape[0], -1, 8)[:, :, order].reshape(t.shape)  # noqa: E731
    return {"qweight": pack_words(interleave(q), 1), "qzeros": pack_words(interleave(zero), 1)}


def convert(src: Path, dst: Path, method: str, group_size: int, sym: bool, fmt: str, reference: Path | None) -> None:
    offset = 1 if method == "gptq" and fmt == "gptq" else 0
    for out in filter(None, (dst, reference)):
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, out / f.name)
    maps: dict[Path, dict[str, str]] = {dst: {}, **({reference: {}} if reference else {})}
    for i, file in enumerate(sorted(src.glob("*.safetensors"))):
        tensors, ref = {}, {}
        name = f"model-{i:05d}.safetensors"
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = f.get_tensor(key)
                if not LINEAR.search(key):
                    tensors[key] = ref[key] = t
                    continue
                q, zero, scale = quantize(t, group_size, sym)
                prefix = key.removesuffix(".weight")
                parts = packed(method, q, zero, offset, sym)
                if "g_idx" in parts:
                    parts["g_idx"] = (torch.arange(q.shape[0]) // (q.shape[0] if group_size == -1 else group_size)
                                      ).to(torch.int32)  # fmt: skip
                if method == "compressed-tensors":
                    parts["weight_scale"] = scale.T.contiguous()
                else:
                    parts["scales"] = scale
                tensors |= {f"{prefix}.{name}": p for name, p in parts.items()}
                ref[key] = dequantized(q, zero, scale, group_size)
        for out, written in ((dst, tensors), (reference, ref)):
            if out is not None:
                save_file(written, str(out / name), metadata={"format": "pt"})
                maps[out] |= dict.fromkeys(written, name)
    for out, weight_map in maps.items():  # transformers reads several files through their index
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": sym,
              "checkpoint_format": fmt}  # fmt: skip
    elif method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "channel" if group_size == -1 else
                   "group", "group_size": None if group_size == -1 else group_size, "actorder": None}  # fmt: skip
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
              "quantization_status": "compressed"}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": qc}, indent=2))
    if reference:
        (reference / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--method", choices=["gptq", "awq", "compressed-tensors"], required=True)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--sym", action="store_true", help="symmetric (zero 8), as most GPTQ and compressed-tensors "
                        "checkpoints")
    parser.add_argument("--format", choices=["gptq", "gptq_v2"], default="gptq", help="GPTQ's checkpoint_format")
    parser.add_argument("--reference", type=Path, default=None)
    args = parser.parse_args()
    if args.method == "awq" and args.sym:
        parser.error("AWQ stores zero points: --sym is GPTQ's")
    convert(args.src, args.dst, args.method, args.group_size, args.sym, args.format, args.reference)
    print(f"wrote {args.method} 4-bit, group {args.group_size}, to {args.dst}")


if __name__ == "__main__":
    main()
