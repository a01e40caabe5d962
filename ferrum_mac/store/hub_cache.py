"""The standard Hugging Face cache layout, so mlx-lm, transformers and the hub CLI share our files.

    <cache>/models--org--name/blobs/<etag>                 file contents (etag: sha256 for LFS files,
                                                            the git blob id for the rest)
    <cache>/models--org--name/blobs/<etag>.incomplete      a download in progress (ours; resumable)
    <cache>/models--org--name/snapshots/<commit>/<path>    relative symlinks to the blobs
    <cache>/models--org--name/refs/<revision>              the commit a branch or tag pointed to

Paths are read from `huggingface_hub.constants` at call time: HF_HOME / HF_HUB_CACHE decide them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


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
    """The cached commit of `revision` (a commit hash is its own answer)."""
    if _COMMIT.match(revision):
        return revision
    ref = repo_dir(repo_id) / "refs" / revision
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None


def link_snapshot(repo_id: str, commit: str, files: dict[str, str]) -> Path:
    """Point snapshots/<commit>/<path> at blobs/<etag> for each `path: etag`; returns the snapshot."""
    snapshot = snapshot_dir(repo_id, commit)
    for path, etag in files.items():
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(blob_path(repo_id, etag), link.parent)
        if link.is_symlink() or link.exists():
            if os.path.realpath(link) == os.path.realpath(blob_path(repo_id, etag)):
                continue
            link.unlink()
        os.symlink(target, link)
    return snapshot


def write_ref(repo_id: str, revision: str, commit: str) -> None:
    if revision == commit:
        return
    ref = repo_dir(repo_id) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(ref.name + ".tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


def partial_files(repo_id: str) -> list[Path]:
    blobs = repo_dir(repo_id) / "blobs"
    return sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else []
