"""`ferrum list`: the language models on this machine.

Read from the standard Hugging Face cache (so models fetched by mlx-lm, transformers or the
hub CLI show up too) plus the bundled model. A snapshot that is not a complete model, or a
pull that stopped before it made one, is reported with `complete=False`, never as a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ferrum_mac.errors import ModelFileError
from ferrum_mac.store import hub_cache
from ferrum_mac.store.completeness import missing_parts
from ferrum_mac.store.describe import format_and_quant, is_language_model, read_config
from ferrum_mac.store.local import bundled_model
from ferrum_mac.store.select import gguf_quant_of


@dataclass(frozen=True)
class LocalModel:
    name: str  # what `ferrum run/show/rm` accept
    path: Path
    size: int  # bytes on disk
    quant: str
    format: str
    modified: float  # Unix time
    complete: bool = True


def list_models() -> list[LocalModel]:
    """Every model found, complete ones and (with complete=False) unfinished ones, by name."""
    models = _bundled()
    cache = _scan()
    if cache is not None:
        for repo in cache.repos:
            if repo.repo_type == "model":
                for revision in repo.revisions:
                    models += _snapshot_models(repo.repo_id, revision)
        models += _unfinished_pulls(cache, {m.name for m in models if m.complete})
    return sorted(models, key=lambda m: (not m.complete, m.name.lower()))


def _scan():
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir(hub_cache.cache_dir())
    except CacheNotFound:
        return None


def _bundled() -> list[LocalModel]:
    path = bundled_model()
    if path is None:
        return []
    return [_gguf_model("smollm2:135m", path, path.stat().st_size, path.stat().st_mtime)]


def _snapshot_models(repo_id: str, revision) -> list[LocalModel]:
    name = _snapshot_name(repo_id, revision)
    folder = revision.snapshot_path
    ggufs = sorted(
        (f for f in revision.files if f.file_name.endswith(".gguf") and "/" not in _relative(f, folder)),
        key=lambda f: f.file_name,
    )
    config = read_config(folder)
    if ggufs and not config:
        return [
            _gguf_model(
                name if len(ggufs) == 1 else f"{name}:{gguf_quant_of(f.file_name) or f.file_name}",
                f.file_path,
                f.size_on_disk,
                f.blob_last_modified,
            )
            for f in ggufs
        ]
    if not is_language_model(config):
        return []
    fmt, quant = format_and_quant(folder)
    return [
        LocalModel(
            name, folder, revision.size_on_disk, quant, fmt, revision.last_modified, complete=not missing_parts(folder)
        )
    ]


def _gguf_model(name: str, path: Path, size: int, modified: float) -> LocalModel:
    try:
        _, quant = format_and_quant(path)
    except ModelFileError:  # a damaged header: not a model to offer
        return LocalModel(name, path, size, "?", "gguf", modified, complete=False)
    return LocalModel(name, path, size, quant, "gguf", modified)


def _snapshot_name(repo_id: str, revision) -> str:
    if "main" in revision.refs:
        return repo_id
    return f"{repo_id}@{sorted(revision.refs)[0] if revision.refs else revision.commit_hash}"


def _relative(file, folder: Path) -> str:
    return file.file_path.relative_to(folder).as_posix()


def _unfinished_pulls(cache, complete_names: set[str]) -> list[LocalModel]:
    """Repositories holding `.incomplete` downloads and no complete model: a pull to resume."""
    sizes: dict[str, list] = {}
    for partial in cache.incomplete_files:
        repo_folder = partial.file_path.parent.parent.name  # models--org--name
        if repo_folder.startswith("models--"):
            entry = sizes.setdefault(repo_folder, [0, 0.0])
            entry[0] += partial.size_on_disk
            entry[1] = max(entry[1], partial.file_path.stat().st_mtime)
    unfinished = []
    for repo_folder, (size, mtime) in sorted(sizes.items()):
        repo_id = repo_folder.removeprefix("models--").replace("--", "/", 1)
        if repo_id not in complete_names:
            blobs = hub_cache.repo_dir(repo_id) / "blobs"
            size += sum(p.stat().st_size for p in blobs.iterdir() if not p.name.endswith(".incomplete"))
            unfinished.append(LocalModel(repo_id, hub_cache.repo_dir(repo_id), size, "?", "?", mtime, complete=False))
    return unfinished
