"""How a GGUF stored its layers' weights, recorded beside its converted copy at conversion. A file quantized to 4 or
8 bits is served dequantized (bf16) unless `--quantization` says otherwise; the engine uses this record to say at
start which `--quantization` serves the file's own grid: int4 for Q4_1 (the default model's) exactly, and for
Q4_0 and Q4_K within half a step of it; int8 for Q8_0 exactly."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

RECORD = "gguf_weight_types.json"
GRIDS = {"int4": {"Q4_0", "Q4_1", "Q4_K"}, "int8": {"Q8_0"}}


def record_weight_types(gguf_path: Path, out_dir: Path) -> None:
    """Counts the file's layer matrices (and expert stacks) by their GGUF type: {"Q4_1": 210, ...}."""
    import gguf  # imported here: resolving an already-converted model stays cheap

    reader = gguf.GGUFReader(gguf_path)
    kinds = Counter(t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) >= 2)
    (out_dir / RECORD).write_text(json.dumps(dict(kinds), sort_keys=True))


def matching_quantization(model_dir: Path) -> tuple[str, str] | None:
    """("int4" or "int8", the types as "Q4_1 210 of 210") where most of the layers' matrices are on that grid; None
    for a model that did not come from a GGUF (or was converted before the record existed)."""
    path = model_dir / RECORD
    if not path.is_file():
        return None
    kinds: dict[str, int] = json.loads(path.read_text())
    total = sum(kinds.values())
    for method, grid in GRIDS.items():
        on_grid = {kind: n for kind, n in kinds.items() if kind in grid}
        if 2 * sum(on_grid.values()) > total:
            return method, ", ".join(f"{kind} {n} of {total}" for kind, n in sorted(on_grid.items()))
    return None
