"""What of a model name is already on disk, without touching the network."""

from __future__ import annotations

from pathlib import Path

from ferrum_mac.errors import ModelFileError
from ferrum_mac.store import bundled, hub_cache
from ferrum_mac.store.aliases import RepoRef
from ferrum_mac.store.completeness import is_complete
from ferrum_mac.store.select import choose_gguf


def cached_model(ref: RepoRef) -> Path | None:
    """The complete cached model for `ref` (a snapshot folder or one .gguf file), or None."""
    commit = hub_cache.commit_for(ref.repo_id, ref.revision)
    if commit is None:
        return None
    snapshot = hub_cache.snapshot_dir(ref.repo_id, commit)
    ggufs = sorted(p.name for p in snapshot.glob("*.gguf") if p.is_file()) if snapshot.is_dir() else []
    if ref.gguf_quant is not None or (ggufs and not (snapshot / "config.json").is_file()):
        try:
            return snapshot / choose_gguf(ggufs, ref.gguf_quant, str(ref)) if ggufs else None
        except ModelFileError:  # that quantization is not cached
            return None
    return snapshot if is_complete(snapshot) else None


def bundled_model() -> Path | None:
    """The bundled SmolLM2 GGUF when it has been fetched (its writer renames it in only once verified)."""
    path = bundled.models_dir() / bundled.SMOLLM2.name / bundled.SMOLLM2.filename
    return path if path.is_file() else None
