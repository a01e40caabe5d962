"""Hugging Face safetensors checkpoints (single file or sharded with an index), dense or
MLX-quantized (packed uint32 weights with `.scales` and `.biases`). Tensors come back as
`mx.array`s, or as `torch.Tensor`s where MLX is not installed."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from ferrum_mac.errors import CorruptModelError, ModelNotFoundError
from ferrum_mac.weights.config import read_json_object

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CorruptModelError(f"{index} is not a valid safetensors index; re-download the model")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(
                f"{folder} lacks shard(s) {', '.join(missing)} named in its index; finish the download"
            )
        return files
    # `model*.safetensors` first, as mlx-lm does: Mistral repos add a `consolidated.safetensors`
    # (the same weights under other names) and LoRA folders an `adapter_model.safetensors`.
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no .safetensors weights; ferrum reads safetensors and GGUF, not .bin")
    return files


def read_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's JSON header (tensor name -> dtype, shape, data_offsets; and
    `__metadata__`) and its length in bytes, checked to be well formed (`check_header`).
    ValueError, saying what is wrong, for a file too short for its header or a malformed
    header; OSError when it cannot be read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"is truncated ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8 or header_len > MAX_HEADER:
            raise ValueError("is truncated (header runs past the end)")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past Python's stack
            raise ValueError("has a malformed safetensors header") from None
    check_header(header)
    return header_len, header


# bytes per element of each safetensors dtype
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def check_header(header) -> None:
    """ValueError unless `header` is what the safetensors format allows: an object of tensors,
    each with a known dtype, a shape of non-negative ints and data_offsets [start, end] whose
    span holds exactly that many bytes; `__metadata__`, when present, maps strings to strings."""
    if not isinstance(header, dict):
        raise ValueError(f"has a safetensors header that is a JSON {type(header).__name__}, not an object")
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ValueError("has a malformed __metadata__ (it must map strings to strings)")
        else:
            _check_tensor_entry(name, entry)


def _check_tensor_entry(name: str, entry) -> None:
    where = f"tensor {name[:80]!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"has a malformed header: {where} is a JSON {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"has an unknown dtype {str(dtype)[:20]!r} for {where}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ValueError(f"has a malformed shape for {where} (it must be a list of non-negative integers)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise ValueError(f"has malformed data_offsets for {where} (they must be two non-negative integers)")
    start, end = offsets
    if end - start != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise ValueError(f"has data_offsets for {where} that do not match its dtype and shape")


def _is_count(value) -> bool:
    return type(value) is int and value >= 0  # not bool, not float


def tensors_end(header_len: int, header: dict) -> int:
    """The byte the file's last tensor ends at: a whole file is at least this long."""
    return 8 + header_len + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)


def check_complete(path: Path) -> None:
    """Refuse a truncated, malformed or unreadable file before MLX reads it (its own error is vague)."""
    try:
        size = path.stat().st_size
        header_len, header = read_header(path)
    except ValueError as e:
        raise CorruptModelError(f"{path} {e}; download it again") from None
    except OSError as e:  # a dangling or looping symlink, a file without read permission
        raise CorruptModelError(
            f"{path} cannot be read ({e.strerror or e}); download it again or fix the link"
        ) from None
    end = tensors_end(header_len, header)
    if end > size:
        raise CorruptModelError(f"{path} is truncated ({size} of {end} bytes); download it again")


def canonical_name(name: str) -> str | None:
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    return name[len("model.") :] if name.startswith("model.") else name


def _reader():
    """`mx.load`, or without MLX (the torch backend on a CUDA machine) safetensors' torch reader."""
    try:
        import mlx.core as mx

        return mx.load
    except ImportError:
        from safetensors.torch import load_file

        return load_file


def load_safetensors(folder: Path, read=None) -> dict:
    """The folder's tensors by canonical name, each file read by `read` (path -> tensors by
    name; default `_reader()`)."""
    read = read or _reader()
    tensors = {}
    for path in shard_files(folder):
        check_complete(path)
        try:
            loaded = read(str(path))
        except (RuntimeError, ValueError, OSError) as e:
            raise CorruptModelError(f"{path} cannot be read ({str(e).splitlines()[0]}); download it again") from None
        for name, array in loaded.items():
            canonical = canonical_name(name)
            if canonical is not None:
                tensors[canonical] = array
    return tensors
