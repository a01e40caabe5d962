"""One repository file -> one verified blob in the Hugging Face cache, resumable.

huggingface_hub's own `hf_hub_download` deletes a partial file when a download fails, so an
interrupted 5 GB pull would start over. Here the bytes go to `blobs/<etag>.incomplete`, which
outlives the process: the next attempt asks only for the rest (an HTTP Range request, made by
huggingface_hub's `http_get`). The blob takes its final name only after its hash matches.
"""

from __future__ import annotations

import hashlib
import os
from urllib.parse import quote
from dataclasses import dataclass
from typing import Callable

from ferrum_mac.errors import CorruptModelError
from ferrum_mac.store import hub_cache
from ferrum_mac.store.paths import inside

CHUNK = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    blob_id: str  # git blob id
    sha256: str | None  # LFS files only

    @property
    def etag(self) -> str:
        """The blob's name in the cache, as huggingface_hub names it."""
        return self.sha256 or self.blob_id


def is_cached(repo_id: str, file: RemoteFile) -> bool:
    return hub_cache.blob_path(repo_id, file.etag).is_file()


def partial_size(repo_id: str, file: RemoteFile) -> int:
    try:
        return hub_cache.partial_path(repo_id, file.etag).stat().st_size
    except OSError:
        return 0


def fetch(
    repo_id: str, commit: str, file: RemoteFile, *, endpoint: str, on_bytes: Callable[[int], None] = lambda n: None
) -> None:
    """Download `file` into its blob unless it is already there; `on_bytes(n)` per chunk received."""
    from huggingface_hub.utils import WeakFileLock

    lock = inside(hub_cache.cache_dir(), hub_cache.lock_path(repo_id, file.etag))
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if not is_cached(repo_id, file):
            _fetch_unlocked(repo_id, commit, file, endpoint, on_bytes)


def _fetch_unlocked(repo_id: str, commit: str, file: RemoteFile, endpoint: str, on_bytes) -> None:
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    blobs = hub_cache.repo_dir(repo_id) / "blobs"
    partial = inside(blobs, hub_cache.partial_path(repo_id, file.etag))
    blob = inside(blobs, hub_cache.blob_path(repo_id, file.etag))
    partial.parent.mkdir(parents=True, exist_ok=True)
    if partial_size(repo_id, file) > file.size:
        partial.unlink()
    url = f"{endpoint}/{repo_id}/resolve/{commit}/{quote(file.path)}"
    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"  # byte offsets must mean the same thing on resume
    with open(partial, "ab") as out:
        http_get(
            url,
            out,
            resume_size=out.tell(),
            headers=headers,
            expected_size=file.size,
            displayed_filename=file.path,
            tqdm_class=_progress_adapter(on_bytes),
        )
    if not matches(partial, file):
        partial.unlink()
        raise CorruptModelError(f"{file.path} from {repo_id} does not match its checksum")
    os.chmod(partial, 0o644)
    os.replace(partial, blob)


def matches(path, file: RemoteFile) -> bool:
    """The file's content hash: sha256 for LFS files, the git blob id for the others."""
    if file.sha256:
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1()
        digest.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == (file.sha256 or file.blob_id)


def _progress_adapter(on_bytes: Callable[[int], None]):
    """http_get reports through a tqdm-like object; forward its byte counts to `on_bytes`."""

    class _Bar:
        def __init__(self, *args, **kwargs):
            pass

        def update(self, n=1):
            on_bytes(int(n or 0))

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    return _Bar
