"""A GGUF file's metadata and tensor table, read from its header without touching tensor data.

Scalar and string values (arrays such as the vocabulary are skipped, not decoded) and each
tensor's shape and ggml type: what `ferrum list`/`show` print, and what the loader checks
before MLX reads the file (MLX silently casts tensor types it cannot keep quantized to
float16; reading the table first lets us refuse those by name).
"""

from __future__ import annotations

import collections
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ferrum_mac.errors import CorruptModelError

# ggml tensor type ids -> names (the ones seen in published files)
TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M", 30: "BF16", 39: "MXFP4",
}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufInfo:
    metadata: dict  # key -> scalar or string (arrays omitted)
    tensors: list  # (name, shape, type name)

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.tensors)

    @property
    def quantization(self) -> str:
        """The type holding most of the weights, e.g. "Q4_1"."""
        weight = collections.Counter()
        for _, shape, kind in self.tensors:
            weight[kind] += math.prod(shape)
        return weight.most_common(1)[0][0] if weight else "?"


def read_gguf_info(path: Path) -> GgufInfo:
    with open(path, "rb") as f:
        reader = _Reader(f, path)
        if f.read(4) != b"GGUF":
            raise CorruptModelError(f"{path} is not a GGUF file; download it again")
        reader.take("<I")  # version
        tensor_count, kv_count = reader.take("<Q"), reader.take("<Q")
        metadata = {}
        for _ in range(kv_count):
            key = reader.string()
            value = reader.value(reader.take("<I"))
            if value is not _SKIPPED:
                metadata[key] = value
        tensors = []
        for _ in range(tensor_count):
            name = reader.string()
            shape = tuple(reader.take("<Q") for _ in range(reader.take("<I")))
            kind = reader.take("<I")
            reader.take("<Q")  # data offset
            tensors.append((name, shape[::-1], TYPES.get(kind, f"type {kind}")))
    return GgufInfo(metadata, tensors)


_SKIPPED = object()


class _Reader:
    def __init__(self, f, path: Path):
        self.f, self.path = f, path
        self.size = os.fstat(f.fileno()).st_size

    def take(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def read(self, size: int) -> bytes:
        # A damaged length field can claim more bytes than the file has: do not try to read them.
        data = self.f.read(size) if size <= self.size else b""
        if len(data) != size:
            raise CorruptModelError(f"{self.path} ends inside its GGUF header; the file is truncated, download it again")
        return data

    def string(self) -> str:
        return self.read(self.take("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _ARRAY:
            item_kind, count = self.take("<I"), self.take("<Q")
            if item_kind in _SCALARS:
                self.f.seek(struct.calcsize(_SCALARS[item_kind]) * count, 1)
            elif item_kind == _STRING:
                for _ in range(count):
                    self.f.seek(self.take("<Q"), 1)
            else:
                for _ in range(count):
                    self.value(item_kind)
            return _SKIPPED
        raise CorruptModelError(f"{self.path} has an unknown GGUF metadata type {kind}; the file is damaged")
