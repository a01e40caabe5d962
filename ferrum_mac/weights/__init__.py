"""Weights: any supported checkpoint -> (`ModelConfig`, canonical tensor map).

Canonical names are the Hugging Face names without the `model.` prefix
(`embed_tokens.weight`, `layers.3.self_attn.q_proj.scales`, `lm_head.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ferrum_mac.errors import CorruptModelError, ModelNotFoundError
from ferrum_mac.weights.config import SUPPORTED_TYPES, ModelConfig, config_from_dict, config_from_hf

__all__ = ["Checkpoint", "ModelConfig", "SUPPORTED_TYPES", "config_from_dict", "load_checkpoint"]


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict  # canonical name -> mx.array (GGUF: a mapping that reads the file on first use)
    path: Path
    format: str  # "safetensors", "mlx-quantized" or "gguf"
    quantized_weights: int | None = None  # weights the file stores quantized, when known without reading them


def find_gguf(folder: Path) -> Path | None:
    """The folder's one GGUF model: its only .gguf file, or the first of one set of shards."""
    from ferrum_mac.weights.gguf_header import SHARD

    files = sorted(folder.glob("*.gguf"))
    sets = {(m.group("stem"), m.group("count")) if (m := SHARD.match(f.name)) else f.name for f in files}
    return files[0] if len(sets) == 1 else None


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and find_gguf(path):
        path = find_gguf(path)
    if path.is_symlink() and not path.exists():
        raise CorruptModelError(
            f"{path} is a link to a file that is missing (or a loop of links); fix the link or download it again"
        )
    if not path.exists():
        raise ModelNotFoundError(f"{path} does not exist; give a model folder, a .gguf file or a model name")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is not a model; give a model folder (with config.json) or a .gguf file")
        from ferrum_mac.weights.gguf import load_gguf

        config, tensors, quantized = load_gguf(path)
        return Checkpoint(config, tensors, path, "gguf", quantized)
    from ferrum_mac.weights.safetensors import load_safetensors

    config = config_from_hf(path)
    tensors = load_safetensors(path)
    return Checkpoint(config, tensors, path, "mlx-quantized" if config.quantization else "safetensors")
