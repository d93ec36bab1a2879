"""One parse of a GGUF file for its whole conversion (common/gguf_convert.py).

transformers reads a GGUF's config, its weights and its tokenizer each through a `gguf.GGUFReader` of its own, and
the conversion reads the file's fields and weight types twice more: five parses, each of which walks every string
of the vocabulary in Python (2 s apiece for the default model's 49152 tokens and merges). Its weight loader also
builds gguf's tensor-name map once per submodule of the model (397 times for the default model, 4 s in all), though
the map depends only on the architecture and the layer count. Inside `one_parse`, `gguf.GGUFReader(path)` of this
file returns one shared parse and `gguf.get_tensor_name_map` remembers its maps: the first start of the default
model converts in about half the time. Both stay read-only (transformers and our code only read fields, tensors and
names); both are looked up in `gguf` at call time by transformers (`from gguf import ...` inside its functions)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import gguf


@contextlib.contextmanager
def one_parse(gguf_path: Path) -> Iterator[gguf.GGUFReader]:
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    shared = reader_class(gguf_path)

    def reader(path, *args, **kwargs):  # any other file (or mode) gets its own parse, as before
        return shared if not args and not kwargs and Path(path).resolve() == Path(gguf_path).resolve() else \
            reader_class(path, *args, **kwargs)  # fmt: skip

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield shared
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
