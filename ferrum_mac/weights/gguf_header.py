"""Read a GGUF file's tensor table (names and ggml types) without loading any data.

MLX's loader silently casts tensor types it cannot keep quantized to float16; reading the
table first lets us refuse those by name. (The `gguf` package can do this too, but parses
every metadata value and takes seconds on a tokenizer-sized vocabulary.)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ferrum_mac.errors import CorruptModelError

GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    shape: tuple[int, ...]
    type_name: str


class _Reader:
    def __init__(self, f: BinaryIO, path: Path):
        self.f, self.path = f, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise CorruptModelError(f"{self.path} ends inside its GGUF header; the file is truncated, download it again")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.take("<Q")
        return self.f.read(n).decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            self.f.seek(self.take("<Q"), 1)
        elif kind == _ARRAY:
            item_kind, count = self.take("<I"), self.take("<Q")
            if item_kind in _SCALAR_SIZES:
                self.f.seek(_SCALAR_SIZES[item_kind] * count, 1)
            else:
                for _ in range(count):
                    self.skip_value(item_kind)
        elif kind in _SCALAR_SIZES:
            self.f.seek(_SCALAR_SIZES[kind], 1)
        else:
            raise CorruptModelError(f"{self.path} has an unknown GGUF metadata type {kind}; the file is damaged")


def read_tensor_table(path: Path) -> list[GgufTensorInfo]:
    with open(path, "rb") as f:
        r = _Reader(f, path)
        if f.read(4) != b"GGUF":
            raise CorruptModelError(f"{path} is not a GGUF file (bad magic); check the path or download it again")
        version = r.take("<I")
        if version < 2:
            raise CorruptModelError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported")
        tensor_count, kv_count = r.take("<Q"), r.take("<Q")
        for _ in range(kv_count):
            r.string()
            r.skip_value(r.take("<I"))
        tensors = []
        for _ in range(tensor_count):
            name = r.string()
            dims = tuple(r.take("<Q") for _ in range(r.take("<I")))
            kind = r.take("<I")
            r.take("<Q")  # data offset
            tensors.append(GgufTensorInfo(name, dims[::-1], GGML_TYPES.get(kind, f"type {kind}")))
        return tensors
