"""A GGUF model's tensors, from one file or its shards, read with numpy in the backends' layouts.

Shards are `-0000k-of-0000n` files; each ggml type is decoded by `ggml_blocks` into MLX's affine
layout or a dense array and handed to a backend through `wrap(array, dtype name)`. Everything
is checked from the headers before any tensor is read (`check_tensors`): a model loads whole
or not at all."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ferrum_mac.errors import CorruptModelError, UnsupportedModelError
from ferrum_mac.weights import ggml_blocks
from ferrum_mac.weights.gguf_header import BLOCKS, GgufInfo, cached_gguf_info, shard_paths

# values decoded at a time: bounds the float32 and code buffers of one huge tensor
CHUNK_VALUES = 1 << 22

Shards = list[tuple[Path, GgufInfo]]


def read_shards(path: Path) -> Shards:
    """Each shard's path and header, the first shard's (which holds the metadata) first."""
    return [(p, cached_gguf_info(p)) for p in shard_paths(path)]


def check_tensors(shards: Shards) -> None:
    """Refuse, in one line naming the tensor, a type ferrum cannot read, a row that is not a
    whole number of its type's blocks and a file shorter than its tensors."""
    for path, info in shards:
        for name, shape, kind in info.tensors:
            if kind not in ggml_blocks.LAYOUTS:
                raise UnsupportedModelError(
                    f"{path}: tensor {name} is {kind}, which ferrum cannot load (supported GGUF types: "
                    f"{', '.join(ggml_blocks.LAYOUTS)}); use a Q4_K_M, Q8_0 or F16 file"
                )
            per_block = BLOCKS[kind][0]
            if not shape or shape[-1] % per_block:
                raise CorruptModelError(
                    f"{path}: tensor {name} of shape {shape} is not whole {kind} blocks of {per_block} values; "
                    "the file is damaged, download it again"
                )
        size = path.stat().st_size
        if info.data_end > size:
            raise CorruptModelError(f"{path} is truncated ({size} of {info.data_end} bytes); download it again")


def read_tensors(shards: Shards, rename: Callable[[str], str | None], wrap: Callable) -> dict:
    """The tensors `rename` gives a name (None: skipped) as `wrap(numpy array, dtype name)`:
    an affine type's `name` (uint32 words) with `<module>.scales` and `<module>.biases`
    (float16 or float32), a dense one as stored (BF16 as its uint16 bits, "bfloat16")."""
    tensors = {}
    for path, info in shards:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, shape, kind in info.tensors:
            canonical = rename(name)
            if canonical is not None:
                parts = read_tensor(data, info.offsets[name], shape, kind, f"{path}: tensor {name}")
                module = canonical.rsplit(".", 1)[0]
                for part, (array, dtype) in parts.items():
                    tensors[canonical if part == "weight" else f"{module}.{part}"] = wrap(array, dtype)
    return tensors


def read_tensor(data: np.ndarray, offset: int, shape: tuple, kind: str, where: str) -> dict:
    """One tensor: {"weight": (array, dtype name)} dense, or words, scales and biases."""
    per_block, block_bytes = BLOCKS[kind]
    layout = ggml_blocks.LAYOUTS[kind]
    k = shape[-1]
    rows = math.prod(shape[:-1])
    raw = data[offset : offset + rows * k // per_block * block_bytes].reshape(rows, -1)
    if isinstance(layout, str):  # dense
        if kind in ("F32", "F16", "BF16"):
            stored = np.uint16 if kind == "BF16" else np.dtype(layout)
            return {"weight": (raw.view(stored).reshape(shape).copy(), layout)}
        dense = np.empty((rows, k), dtype=layout)
        for start, stop in _chunks(rows, k):
            values = ggml_blocks.decode(raw[start:stop].reshape(-1, block_bytes), kind)
            dense[start:stop] = values.reshape(stop - start, k)
        return {"weight": (dense.reshape(shape), layout)}
    bits, group = layout
    words = np.empty((rows, k * bits // 32), dtype=np.uint32)
    scales = biases = None
    for start, stop in _chunks(rows, k):
        affine = ggml_blocks.decode(raw[start:stop].reshape(-1, block_bytes), kind)
        if scales is None:
            scales = np.empty((rows, k // group), dtype=affine.scales.dtype)
            biases = np.empty_like(scales)
        words[start:stop] = ggml_blocks.pack(affine.codes.reshape(stop - start, k), bits)
        scales[start:stop] = affine.scales.reshape(stop - start, -1)
        biases[start:stop] = affine.biases.reshape(stop - start, -1)
    if not (np.isfinite(scales).all() and np.isfinite(biases).all()):
        raise UnsupportedModelError(
            f"{where} ({kind}) has block scales beyond float16's range, where ferrum keeps them"
        )
    lead = tuple(shape[:-1])
    return {
        "weight": (words.reshape(*lead, -1), "uint32"),
        "scales": (scales.reshape(*lead, -1), scales.dtype.name),
        "biases": (biases.reshape(*lead, -1), biases.dtype.name),
    }


def _chunks(rows: int, k: int):
    step = max(1, CHUNK_VALUES // k)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def stored_quantized(kind: str) -> bool:
    return kind not in ("F32", "F16", "BF16")
