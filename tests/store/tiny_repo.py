"""Names and small file builders shared by the store tests."""

from __future__ import annotations

import json
import struct
from pathlib import Path

REPO_ID = "tiny-org/tiny-llama"


def write_gguf_header(path: Path, metadata: dict, tensors: list[tuple[str, tuple[int, ...], int]]) -> Path:
    """A GGUF v3 file with `metadata` (str/int values) and a tensor table, but no tensor data:
    enough for everything that reads only the header."""

    def string(text: str) -> bytes:
        data = text.encode()
        return struct.pack("<Q", len(data)) + data

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, value in metadata.items():
        if isinstance(value, str):
            out += string(key) + struct.pack("<I", 8) + string(value)
        elif isinstance(value, list):  # a list of strings, like tokenizer.ggml.tokens
            out += string(key) + struct.pack("<IIQ", 9, 8, len(value)) + b"".join(string(v) for v in value)
        else:
            out += string(key) + struct.pack("<II", 4, value)
    for name, shape, ggml_type in tensors:
        out += string(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape[::-1])
        out += struct.pack("<IQ", ggml_type, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(out)
    return path


def write_safetensors_header(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], truncate: int = 0) -> Path:
    """A safetensors file of zeros with `tensors` (name -> (dtype, shape)); `truncate` drops trailing bytes."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "U32": 4}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    data = struct.pack("<Q", len(blob)) + blob + bytes(offset)
    path.write_bytes(data[: len(data) - truncate] if truncate else data)
    return path
