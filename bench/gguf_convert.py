"""The one-time conversion of a GGUF (common/gguf_convert.py): its wall time and the converting process's peak
resident memory, for a random-weight Llama-shaped GGUF written as llama.cpp lays one out (the default model's
tokenizer fields; tensors under gguf's names). A bring-your-own GGUF must convert within the machine's memory.

python -m bench.gguf_convert [--shape llama-1b] [--type f16 | q8_0] [--checkouts DIR,...] [--result-json F]

--shape: a Llama shape of bench/make_random_model.py (smollm2-135m, llama-1b, llama-7b, tiny). --checkouts: convert
the same file with each checkout's code in turn (PYTHONPATH=DIR), to compare commits; default: this one. The GGUF's
weights are random and its q/k are not in llama.cpp's permuted order: the file measures the conversion, not a model.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from bench.make_random_model import model_config, tensor_shapes
from bench.serve import machine
from common.model_source import _default_gguf

REPO = Path(__file__).resolve().parent.parent
TYPES = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
# Run by each checkout: the conversion alone, then its peak RSS (ru_maxrss, KiB on Linux).
CONVERT = """
import resource, sys, time
from common.model_source import resolve_model
start = time.perf_counter()
resolve_model(sys.argv[1], cache_dir=sys.argv[2])
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@functools.cache
def default_tokenizer_fields() -> list[tuple]:
    """The default model's tokenizer fields (name, value, type, array item type), for GGUFs written with its
    vocabulary; read once per process: a parse of its GGUF takes about 2 s."""
    fields = gguf.GGUFReader(str(_default_gguf())).fields.values()
    return [(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
            for f in fields if f.name.startswith("tokenizer.")]  # fmt: skip


def write_gguf(shape: str, kind: str, path: Path, seed: int = 0) -> None:
    """Tensor by tensor, so that a large shape never sits in memory whole."""
    config = model_config(shape)
    assert config.get("model_type", "llama") == "llama", "a Llama shape"
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    for name, value, value_type, sub_type in default_tokenizer_fields():
        writer.add_key_value(name, value, value_type, sub_type)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    shapes = list(tensor_shapes(config))
    rng = np.random.default_rng(seed)
    qtype = {1: gguf.GGMLQuantizationType.F32, 2: TYPES[kind]}  # by the tensor's rank: norms stay F32, as llama.cpp

    for name, shape in shapes:
        byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype[len(shape)])
        quantized = qtype[len(shape)] not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        writer.add_tensor_info(names.get_name(name, try_suffixes=(".weight",)), byte_shape if quantized else shape,
                               np.dtype(np.uint8 if quantized else np.float32 if len(shape) == 1 else np.float16),
                               int(np.prod(byte_shape)), raw_dtype=qtype[len(shape)])  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, shape in shapes:
        values = np.ones(shape, np.float32) if len(shape) == 1 else rng.standard_normal(shape, np.float32) * 0.02
        writer.write_tensor_data(gguf.quants.quantize(values, qtype[len(shape)]))
    writer.close()


def convert(checkout: Path, path: Path, cache: Path) -> dict:
    """One conversion in a fresh process; a failed one (the OOM killer's SIGKILL: returncode -9) is recorded."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CONVERT, str(path), str(cache)], env=env, cwd=tempfile.gettempdir(),
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        return {"checkout": str(checkout), "returncode": done.returncode, "seconds": round(time.perf_counter() - start),
                "stderr_tail": done.stderr.strip().splitlines()[-1:]}  # fmt: skip
    seconds, max_rss_kib = done.stdout.split()
    converted = next((cache / "models").iterdir())
    size = sum(f.stat().st_size for f in converted.iterdir())
    shutil.rmtree(cache)  # the next checkout's copy may need the disk
    return {"checkout": str(checkout), "seconds": round(float(seconds), 1),
            "peak_rss_gb": round(int(max_rss_kib) / 2**20, 2), "converted_gb": round(size / 2**30, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--type", default="q8_0", choices=list(TYPES))
    parser.add_argument("--checkouts", default=str(REPO))
    parser.add_argument("--result-json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gguf-convert-") as tmp:
        path = Path(tmp) / f"random-{args.shape}-{args.type}.gguf"
        start = time.perf_counter()
        write_gguf(args.shape, args.type, path)
        gguf_gb = round(path.stat().st_size / 2**30, 2)
        print(f"wrote {path.name}: {gguf_gb} GB in {time.perf_counter() - start:.0f} s")
        runs = []
        for i, checkout in enumerate(args.checkouts.split(",")):
            runs.append(convert(Path(checkout).resolve(), path, Path(tmp) / f"cache{i}"))
            print(json.dumps(runs[-1]))
    memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    result = {"shape": args.shape, "type": args.type, "gguf_gb": gguf_gb, "runs": runs,
              "machine": machine() | {"memory_gib": memory_gib}}
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
