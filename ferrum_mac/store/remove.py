"""`ferrum rm`: delete a downloaded model. Planned first, so the caller can ask before acting."""

from __future__ import annotations

import difflib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ferrum_mac.errors import FerrumError, ModelNotFoundError
from ferrum_mac.store import bundled, hub_cache, in_use
from ferrum_mac.store.aliases import BundledRef, RepoRef, parse_name
from ferrum_mac.store.derived import copies_of, sweep_orphans
from ferrum_mac.store.paths import exists
from ferrum_mac.store.units import human_bytes


@dataclass(frozen=True)
class Removal:
    name: str
    what: str  # for the question: "mlx-community/Qwen3-0.6B-4bit (all cached files)"
    size: int
    folder: Path
    commit: str | None = None  # remove only this snapshot, not the whole repository
    copies: tuple[Path, ...] = ()  # the dense copies made from it (store/derived.py), removed with it

    @property
    def copies_size(self) -> int:
        return sum(p.stat().st_size for p in self.copies if p.is_file())

    def question(self) -> str:
        copies = f" and its dense copy, {human_bytes(self.copies_size)}" if self.copies else ""
        return f"Remove {self.what}, {human_bytes(self.size)}{copies}?"

    def covers(self, path: Path | str) -> bool:
        """Whether removing deletes the model at `path` (a snapshot folder or a file in one)."""
        scope = self.folder / "snapshots" / self.commit if self.commit is not None else self.folder
        return any(Path(form(path)).is_relative_to(form(scope)) for form in (os.path.abspath, os.path.realpath))

    def execute(self) -> int:
        """Delete the model and its dense copies; returns the bytes freed. `ModelInUseError`
        (nothing deleted) while any process has it loaded (`store.in_use`)."""
        with in_use.exclusive(self.folder, self.name):
            freed = self.size + self.copies_size
            if self.commit is not None:
                _delete_revisions(self.folder, [self.commit])
            else:
                _delete_revisions(self.folder, None)
                shutil.rmtree(self.folder, ignore_errors=True)  # partial downloads, refs, what hf left
                shutil.rmtree(self.folder.parent / ".locks" / self.folder.name, ignore_errors=True)
            for copy in self.copies:
                copy.unlink(missing_ok=True)
        return freed + sweep_orphans()


def plan_removal(name: str, backend: str = "mlx") -> Removal:
    if exists(Path(name).expanduser()):
        raise FerrumError(f"{name} is a path of yours, not a downloaded model; ferrum rm leaves it alone")
    return plan_stored_removal(name, backend)


def plan_stored_removal(name: str, backend: str = "mlx") -> Removal:
    """The removal of the stored model `name` names, never looking at `name` as a path (a
    server's client may not learn what exists on its machine)."""
    try:
        ref = parse_name(name, backend)
        return _plan_bundled(name) if isinstance(ref, BundledRef) else _plan_repo(name, ref)
    except ModelNotFoundError as e:
        close = _closest_local_name(name)
        if close is None:
            raise
        raise ModelNotFoundError(
            f"{name} is not downloaded; did you mean {close}? (`ferrum list` shows what is)"
        ) from e


def _closest_local_name(name: str) -> str | None:
    from ferrum_mac.store.catalog import list_models

    names = {m.name.lower(): m.name for m in list_models()}
    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.6)
    return names[close[0]] if close else None


def _plan_bundled(name: str) -> Removal:
    folder = bundled.models_dir() / bundled.SMOLLM2.name
    if not folder.is_dir():
        raise ModelNotFoundError(f"{name} is not downloaded")
    return Removal(name, f"{name} ({folder})", _size(folder), folder, copies=tuple(copies_of(folder)))


def _plan_repo(name: str, ref: RepoRef) -> Removal:
    folder = hub_cache.repo_dir(ref.repo_id)
    if not folder.is_dir():
        raise ModelNotFoundError(f"{name} is not downloaded (`ferrum list` shows what is)")
    if ref.revision != "main":
        commit = hub_cache.commit_for(ref.repo_id, ref.revision)
        snapshot = hub_cache.snapshot_dir(ref.repo_id, commit) if commit else None
        if snapshot is None or not snapshot.is_dir():
            raise ModelNotFoundError(f"{name} is not downloaded (`ferrum list` shows what is)")
        size = sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())  # through the links
        kept = {c for other in (folder / "snapshots").iterdir() if other != snapshot for c in copies_of(other)}
        copies = tuple(c for c in copies_of(snapshot) if c not in kept)  # a blob another snapshot shares stays
        return Removal(name, f"{ref.repo_id} at {ref.revision}", size, folder, commit, copies)
    return Removal(
        name, f"{ref.repo_id} (all its cached files)", _size(folder), folder, copies=tuple(copies_of(folder))
    )


def _size(folder: Path) -> int:
    """Bytes of real files under `folder` (symlinks not followed, so blobs count once)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _delete_revisions(folder: Path, commits: list[str] | None) -> None:
    """Let huggingface_hub delete what it tracks (it also sweeps blobs shared between repositories)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(hub_cache.cache_dir())
    except CacheNotFound:
        return
    for repo in cache.repos:
        if repo.repo_path.resolve() == folder.resolve():
            chosen = [r.commit_hash for r in repo.revisions if commits is None or r.commit_hash in commits]
            if chosen:
                cache.delete_revisions(*chosen).execute()
