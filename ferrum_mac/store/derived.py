"""Files ferrum derives from a model and keeps in the user cache: the dense copies of
quantized checkpoints that MLX's CPU build loads (`backends/mlx/cpu/dense_cache.py` writes them).

Each copy records the model file it was made from (safetensors metadata `ferrum_source`), so
copies whose model is gone, removed by `ferrum rm` or by hand, can be swept. The folder is
`settings.dense_weights_dir()` (FERRUM_CACHE_DIR moves it).
"""

from __future__ import annotations

from pathlib import Path

from ferrum_mac.settings import dense_weights_dir
from ferrum_mac.errors import FerrumError
from ferrum_mac.weights import Checkpoint
from ferrum_mac.weights.safetensors import read_header, shard_files

SOURCE_KEY = "ferrum_source"


def dense_dir() -> Path:
    return dense_weights_dir()


def checkpoint_files(checkpoint: Checkpoint) -> list[Path]:
    """The files a checkpoint's weights come from (resolved): what a derived file is keyed by."""
    path = Path(checkpoint.path)
    if checkpoint.format == "gguf":
        return [path.resolve()] if path.is_file() else []
    if path.is_dir():
        try:
            return [f.resolve() for f in [path / "config.json", *shard_files(path)] if f.is_file()]
        except FerrumError:
            return []
    return []


def recorded_source(entry: Path) -> str | None:
    """The model file a copy was made from, from its safetensors header (None if unrecorded or unreadable)."""
    try:
        _, header = read_header(entry)
    except (OSError, ValueError):
        return None
    return (header.get("__metadata__") or {}).get(SOURCE_KEY)


def copies_of(model: Path, folder: Path | None = None) -> list[Path]:
    """The copies made from a file of `model` (a model file, or a folder searched through its links)."""
    folder = dense_dir() if folder is None else folder
    if not folder.is_dir():
        return []
    files = model.rglob("*") if model.is_dir() else [model]
    sources = {str(f.resolve()) for f in files if f.is_file()}
    return sorted(entry for entry in folder.glob("*.safetensors") if recorded_source(entry) in sources)


def sweep_orphans(folder: Path | None = None) -> int:
    """Delete the copies whose model file no longer exists; returns the bytes freed."""
    folder = dense_dir() if folder is None else folder
    freed = 0
    if not folder.is_dir():
        return 0
    for entry in folder.glob("*.safetensors"):
        source = recorded_source(entry)
        if source is not None and not Path(source).exists():
            try:
                size = entry.stat().st_size
                entry.unlink()
                freed += size
            except OSError:
                continue
    return freed
