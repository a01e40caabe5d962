"""Dense copies of quantized checkpoints for MLX's CPU build, kept on disk.

On the CPU, MlxLLM loads quantized checkpoints dense (`CpuOps.dequantize`), and dequantizing
is slow there too: opening SmolLM2-135M's Q4_1 GGUF dense takes ~1.3 s on 2 cores (reading
the file and dequantizing), against ~0.3 s from its 540 MB dense copy in the page cache (a
GGUF whose copy is found is never read at all; writing the copy adds ~0.25 s once). So the first open writes the dense tensors (quantized linears dequantized to the
compute dtype, everything else as stored) to the user cache folder, and later opens of the
same files read them instead.

An entry is named by the checkpoint's path and keyed by its files (path, size, mtime), the
dtype and FORMAT. It is written atomically (a temporary file renamed into place), only while
the disk keeps MIN_FREE_BYTES free; a hit refreshes its mtime and the least recently used
entries go once the folder passes MAX_BYTES, and so do entries whose model file is gone
(`store/derived.py`, which `ferrum rm` also runs). FERRUM_CACHE_DIR moves the folder
(`<it>/dense-weights`); FERRUM_DENSE_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import mlx.core as mx

from ferrum_mac.backends.mlx.layers import dequantized
from ferrum_mac.errors import FerrumError
from ferrum_mac.store.derived import SOURCE_KEY, checkpoint_files, sweep_orphans
from ferrum_mac.store.derived import dense_dir as cache_dir
from ferrum_mac.store.paths import inside
from ferrum_mac.weights import Checkpoint

FORMAT = "1"  # bump when what an entry holds changes
MAX_BYTES = 8 << 30  # older entries go once the folder holds more
MIN_FREE_BYTES = 2 << 30  # never fill the disk past this
STALE_TEMP_SECONDS = 3600  # temporary files older than this are a crashed writer's


def dense_tensors(checkpoint: Checkpoint, dtype: mx.Dtype, cached: bool = True) -> dict:
    """`checkpoint`'s tensors with its quantized linears dense in `dtype` (`layers.dequantized`):
    the cached copy when there is one, else dequantized now and (if `cached`) cached."""
    entry = entry_path(checkpoint, dtype) if cached else None
    cached = load(entry) if entry is not None else None
    if cached is not None:
        return cached
    tensors = dequantized(checkpoint.tensors, checkpoint.config, dtype)
    mx.eval(list(tensors.values()))
    if entry is not None:
        store(entry, tensors, source=checkpoint_files(checkpoint)[0])
    return tensors


def entry_path(checkpoint: Checkpoint, dtype: mx.Dtype) -> Path | None:
    """Where the dense copy of `checkpoint` in `dtype` lives, or None when it has no files to key it by."""
    files = checkpoint_files(checkpoint)
    if not files:
        return None
    try:
        stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    except OSError:
        return None
    key = hashlib.sha256(json.dumps([FORMAT, str(dtype), stats]).encode()).hexdigest()[:20]
    return cache_dir() / f"{_source_prefix(checkpoint)}-{key}.safetensors"


def load(entry: Path) -> dict | None:
    """The tensors of a cache entry (read lazily, as `mx.load` does), or None if it is missing or damaged."""
    if not entry.is_file():
        return None
    from ferrum_mac.weights.safetensors import check_complete

    try:
        check_complete(entry)
        tensors, meta = mx.load(str(entry), return_metadata=True)
    except (FerrumError, OSError, RuntimeError, ValueError):
        entry.unlink(missing_ok=True)
        return None
    if meta.get("ferrum_dense_format") != FORMAT:
        return None
    try:
        os.utime(entry)  # most recently used
    except OSError:
        pass
    return tensors


def store(entry: Path, tensors: dict, source: Path) -> bool:
    """Write evaluated `tensors` as the entry made from model file `source`, atomically; False
    when skipped (no room) or failed."""
    size = sum(a.nbytes for a in tensors.values())
    folder = entry.parent
    temp = folder / f".{entry.stem}-{os.getpid()}.tmp.safetensors"  # mx.save_safetensors wants the suffix
    inside(folder, temp)  # written through: a link planted under that name must not lead elsewhere
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(folder).free - size < MIN_FREE_BYTES:
            return False
        mx.save_safetensors(str(temp), tensors, metadata={"ferrum_dense_format": FORMAT, SOURCE_KEY: str(source)})
        os.replace(temp, entry)
    except (OSError, RuntimeError, ValueError):
        temp.unlink(missing_ok=True)
        return False
    prune(folder, keep=entry)
    return True


def prune(folder: Path, keep: Path) -> None:
    """Drop older copies of `keep`'s checkpoint, copies whose model is gone, crashed writers'
    temporary files, and the least recently used entries past MAX_BYTES."""
    sweep_orphans(folder)
    prefix = keep.name.split("-", 1)[0] + "-"
    entries = []
    for path in folder.iterdir():
        try:
            stat = path.stat()
            if path.name.startswith("."):
                if time.time() - stat.st_mtime > STALE_TEMP_SECONDS:
                    path.unlink()
            elif path.suffix == ".safetensors" and path != keep:
                if path.name.startswith(prefix):
                    path.unlink()  # the same checkpoint, since changed
                else:
                    entries.append((stat.st_mtime, stat.st_size, path))
        except OSError:
            continue
    total = keep.stat().st_size if keep.exists() else 0
    for _, size, path in sorted(entries, reverse=True):
        total += size
        if total > MAX_BYTES:
            path.unlink(missing_ok=True)


def _source_prefix(checkpoint: Checkpoint) -> str:
    return hashlib.sha256(str(Path(checkpoint.path).resolve()).encode()).hexdigest()[:12]
