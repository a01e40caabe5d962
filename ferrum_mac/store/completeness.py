"""Is a model folder whole? A download that stopped half-way must never pass for a model.

Checked from the files alone, so it also judges folders other tools filled (mlx-lm, the hub
CLI): a config, every weight shard the index names (or at least one safetensors file), each
safetensors file as long as its header says, a tokenizer, no dangling symlinks.
"""

from __future__ import annotations

import json
from pathlib import Path

from ferrum_mac.weights.safetensors import read_header, tensors_end

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def missing_parts(folder: Path) -> list[str]:
    """What keeps `folder` from being a complete model; empty when it is complete."""
    folder = Path(folder)
    if not folder.is_dir():
        return [str(folder)]
    ggufs = list(folder.glob("*.gguf"))
    if ggufs and not (folder / "config.json").is_file():
        return [p.name for p in ggufs if not p.is_file()]
    missing = [p.name for p in folder.iterdir() if p.is_symlink() and not p.exists()]
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    missing += _missing_weights(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer")
    return missing


def is_complete(folder: Path) -> bool:
    return not missing_parts(folder)


def _missing_weights(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError):
            return [index.name]
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
        if not shards:
            return ["weights"]
    return [name for name in shards if not safetensors_is_whole(folder / name)]


def safetensors_is_whole(path: Path) -> bool:
    """True when the file is at least as long as its header says its tensors reach."""
    try:
        return path.stat().st_size >= tensors_end(*read_header(path))
    except (OSError, ValueError):
        return False
