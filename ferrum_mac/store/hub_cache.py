"""The standard Hugging Face cache layout, so mlx-lm, transformers and the hub CLI share our files.

    <cache>/models--org--name/blobs/<etag>                 file contents (etag: sha256 for LFS files,
                                                            the git blob id for the rest)
    <cache>/models--org--name/blobs/<etag>.incomplete      a download in progress (ours; resumable)
    <cache>/models--org--name/snapshots/<commit>/<path>    relative symlinks to the blobs
    <cache>/models--org--name/refs/<revision>              the commit a branch or tag pointed to

Paths are read from `huggingface_hub.constants` at call time: HF_HOME / HF_HUB_CACHE decide them.
Commits and revisions come from outside (the Hub, the user): every path written here is checked
to stay inside the repository's folder (`paths.inside`).
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

from ferrum_mac.errors import FerrumError
from ferrum_mac.store.paths import check_relative, check_revision, inside, is_hash


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def repo_dir(repo_id: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache_dir() / repo_folder_name(repo_id=repo_id, repo_type="model")


def blob_path(repo_id: str, etag: str) -> Path:
    return repo_dir(repo_id) / "blobs" / etag


def partial_path(repo_id: str, etag: str) -> Path:
    return repo_dir(repo_id) / "blobs" / f"{etag}.incomplete"


def lock_path(repo_id: str, etag: str) -> Path:
    """The lock huggingface_hub itself takes for this blob, so the two never write it at once."""
    from huggingface_hub.file_download import repo_folder_name

    return cache_dir() / ".locks" / repo_folder_name(repo_id=repo_id, repo_type="model") / f"{etag}.lock"


def snapshot_dir(repo_id: str, commit: str) -> Path:
    return repo_dir(repo_id) / "snapshots" / commit


def commit_for(repo_id: str, revision: str) -> str | None:
    """The cached commit of `revision` (a commit hash is its own answer); None when unknown."""
    if is_hash(revision):
        return revision
    refs = repo_dir(repo_id) / "refs"
    try:
        commit = inside(refs, refs / revision).read_text().strip()
    except (OSError, FerrumError):
        return None
    return commit if is_hash(commit) else None  # a damaged ref names no snapshot


def link_snapshot(repo_id: str, commit: str, files: dict[str, str]) -> Path:
    """Point snapshots/<commit>/<path> at blobs/<etag> for each `path: etag`; returns the snapshot."""
    if not is_hash(commit):
        raise FerrumError(f"refusing to make a snapshot for {commit!r}, which is not a commit hash")
    snapshot = snapshot_dir(repo_id, commit)
    for path, etag in files.items():
        link = snapshot / check_relative(path, f"in {repo_id}")
        inside(snapshot.parent, link.parent)  # the link itself is replaced, never written through
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(blob_path(repo_id, etag), link.parent)
        if (link.is_symlink() or link.exists()) and os.path.realpath(link) == os.path.realpath(
            blob_path(repo_id, etag)
        ):
            continue
        fresh = _unique_name(link)  # made aside, then renamed over: pulls of one model may run at once
        os.symlink(target, fresh)
        os.replace(fresh, link)
    return snapshot


def write_ref(repo_id: str, revision: str, commit: str) -> None:
    if revision == commit:
        return
    refs = repo_dir(repo_id) / "refs"
    ref = inside(refs, refs / check_revision(revision, f"{repo_id}@{revision}"))
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_name(ref)  # each writer its own: pulls of one model may run at once
    try:
        tmp.write_text(commit)
        os.replace(tmp, ref)
    finally:
        tmp.unlink(missing_ok=True)


def _unique_name(path: Path) -> Path:
    """A name beside `path` no other writer (process or thread) uses."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}.tmp")


def partial_files(repo_id: str) -> list[Path]:
    blobs = repo_dir(repo_id) / "blobs"
    return sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else []
