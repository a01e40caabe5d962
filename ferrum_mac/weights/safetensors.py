"""Hugging Face safetensors checkpoints (single file or sharded with an index), dense or
MLX-quantized (packed uint32 weights with `.scales` and `.biases`). Tensors come back as
`mx.array`s, or as `torch.Tensor`s where MLX is not installed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ferrum_mac.errors import CorruptModelError, ModelNotFoundError

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise CorruptModelError(f"{index} is not a valid safetensors index; re-download the model") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"{folder} lacks shard(s) {', '.join(missing)} named in its index; finish the download")
        return files
    # `model*.safetensors` first, as mlx-lm does: Mistral repos add a `consolidated.safetensors`
    # (the same weights under other names) and LoRA folders an `adapter_model.safetensors`.
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no .safetensors weights; ferrum reads safetensors and GGUF, not .bin")
    return files


def read_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's JSON header (tensor name -> dtype, shape, data_offsets; and
    `__metadata__`) and its length in bytes. ValueError, saying what is wrong, for a file too
    short for its header or a header that is not JSON; OSError when it cannot be read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"is truncated ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8 or header_len > MAX_HEADER:
            raise ValueError("is truncated (header runs past the end)")
        try:
            return header_len, json.loads(f.read(header_len))
        except ValueError:  # not JSON, or not UTF-8
            raise ValueError("has a malformed safetensors header") from None


def tensors_end(header_len: int, header: dict) -> int:
    """The byte the file's last tensor ends at: a whole file is at least this long."""
    return 8 + header_len + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)


def check_complete(path: Path) -> None:
    """Refuse a truncated or malformed file before MLX reads it (its own error is vague)."""
    size = path.stat().st_size
    try:
        header_len, header = read_header(path)
    except ValueError as e:
        raise CorruptModelError(f"{path} {e}; download it again") from None
    end = tensors_end(header_len, header)
    if end > size:
        raise CorruptModelError(f"{path} is truncated ({size} of {end} bytes); download it again")


def canonical_name(name: str) -> str | None:
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    return name[len("model."):] if name.startswith("model.") else name


def _reader():
    """`mx.load`, or without MLX (the torch backend on a CUDA machine) safetensors' torch reader."""
    try:
        import mlx.core as mx

        return mx.load
    except ImportError:
        from safetensors.torch import load_file

        return load_file


def load_safetensors(folder: Path) -> dict:
    read = _reader()
    tensors = {}
    for path in shard_files(folder):
        check_complete(path)
        try:
            loaded = read(str(path))
        except (RuntimeError, ValueError) as e:
            raise CorruptModelError(f"{path} cannot be read ({str(e).splitlines()[0]}); download it again") from None
        for name, array in loaded.items():
            canonical = canonical_name(name)
            if canonical is not None:
                tensors[canonical] = array
    return tensors
