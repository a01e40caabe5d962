"""`ferrum pull`: a model name -> a complete model in the Hugging Face cache.

Order of work: ask the Hub for the repository's files (with sizes and hashes), pick the ones
the model needs, check the disk has room for what is missing, download each into a verified
blob (resuming partial ones), and only then link the snapshot folder. A pull that stops early
leaves blobs and partial files, never a snapshot that looks like a whole model.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import contextmanager
from pathlib import Path

from ferrum_mac.errors import CorruptModelError, FerrumError, ModelNotFoundError
from ferrum_mac.store import bundled, download, hub_cache
from ferrum_mac.store.aliases import BundledRef, RepoRef, parse_name
from ferrum_mac.store.download import RemoteFile
from ferrum_mac.store.local import cached_model
from ferrum_mac.store.paths import check_commit, check_relative, is_hash, shown
from ferrum_mac.store.progress import PullProgress
from ferrum_mac.store.select import needed_files
from ferrum_mac.store.units import human_bytes

DISK_RESERVE = 100 * 1000 * 1000  # leave the system some room after the download

log = logging.getLogger("ferrum.store")


def pull(name: str, backend: str = "mlx", progress: PullProgress | None = None) -> Path:
    """Download `name` (alias or repo id) unless it is already complete; returns its local path.
    Every failure is a one-line FerrumError (one this code did not foresee too: it is logged)."""
    progress = progress or PullProgress()
    ref = parse_name(name, backend)
    if isinstance(ref, BundledRef):
        return bundled.ensure_smollm2(progress=type(progress) is not PullProgress)
    if hub_offline():
        return _cached_or_offline_error(ref, name)
    try:
        return pull_repo(ref, name, progress)
    except FerrumError:
        raise
    except Exception as e:
        log.warning("pulling %s failed", name, exc_info=True)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise FerrumError(
            f"pulling {name} failed ({type(e).__name__}{': ' + reason[:200] if reason else ''}); "
            f"`ferrum pull {name}` tries again"
        ) from None


def pull_repo(ref: RepoRef, name: str, progress: PullProgress) -> Path:
    endpoint = _endpoint()
    with hub_errors(name, ref, endpoint):
        info = _model_info(ref, endpoint)
    commit = check_commit(info.sha, endpoint)  # it names the snapshot folder
    files = remote_files(info, ref)
    todo = [f for f in files if not download.is_cached(ref.repo_id, f)]
    check_disk_space(ref.repo_id, todo, name)
    if todo:
        _download_all(ref, name, commit, todo, endpoint, progress)
    else:
        progress.note(f"{name} is up to date")
    snapshot = hub_cache.link_snapshot(ref.repo_id, commit, {f.path: f.etag for f in files})
    hub_cache.write_ref(ref.repo_id, ref.revision, commit)
    gguf = [f.path for f in files if f.path.endswith(".gguf")]
    return snapshot / gguf[0] if gguf else snapshot


def remote_files(info, ref: RepoRef) -> list[RemoteFile]:
    """The repository files the model needs, with the sizes and hashes the Hub reports."""
    siblings = {s.rfilename: s for s in info.siblings or [] if isinstance(s.rfilename, str)}
    chosen = needed_files(sorted(siblings), ref.gguf_quant, str(ref))
    return [_remote_file(siblings[path]) for path in chosen]


def _remote_file(sibling) -> RemoteFile:
    lfs = sibling.lfs
    path = check_relative(sibling.rfilename, "the Hub sent")
    if not is_hash(sibling.blob_id) or (lfs and not is_hash(lfs.sha256)):
        # the ids become file names in the cache: never let a server choose a path
        raise FerrumError(f"the Hub sent no valid hash for {shown(path)}; is HF_ENDPOINT a Hugging Face Hub?")
    size = lfs.size if lfs else (sibling.size or 0)
    if type(size) is not int or size < 0:
        raise FerrumError(f"the Hub sent no valid size for {shown(path)}; is HF_ENDPOINT a Hugging Face Hub?")
    return RemoteFile(
        path=path,
        size=size,
        blob_id=sibling.blob_id,
        sha256=lfs.sha256 if lfs else None,
    )


def free_bytes(path: Path) -> int:
    """Free space on the disk that holds `path` (or would, once created)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_disk_space(repo_id: str, todo: list[RemoteFile], name: str) -> None:
    need = sum(f.size - download.partial_size(repo_id, f) for f in todo)
    free = free_bytes(hub_cache.repo_dir(repo_id))
    if need and need + DISK_RESERVE > free:
        raise FerrumError(
            f"not enough disk space to pull {name}: it needs {human_bytes(need)}, {human_bytes(free)} is free "
            f"in {hub_cache.cache_dir()}; free some space or set HF_HOME to a folder on a larger disk"
        )


def _download_all(ref: RepoRef, name: str, commit: str, todo: list[RemoteFile], endpoint: str, progress) -> None:
    partial = {f.path: download.partial_size(ref.repo_id, f) for f in todo}
    progress.start(f"pulling {name}", [(f.path, f.size, partial[f.path]) for f in todo])
    try:
        for f in todo:
            progress.file_started(f.path, f.size, partial[f.path])
            with hub_errors(name, ref, endpoint, downloading=f.path):
                download.fetch(ref.repo_id, commit, f, endpoint=endpoint, on_bytes=progress.advance)
            progress.file_done(f.path)
    except KeyboardInterrupt:
        progress.stop()
        progress.note(f"stopped; `ferrum pull {name}` resumes where this left off")
        raise
    finally:
        progress.stop()


@contextmanager
def hub_errors(name: str, ref: RepoRef, endpoint: str, downloading: str | None = None):
    """Turn huggingface_hub and network exceptions into one-line messages that say what to do."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = ref.repo_id
    login = "log in with `hf auth login` or set HF_TOKEN"
    retry = f"; `ferrum pull {name}` resumes the download" if downloading else ""
    try:
        yield
    except CorruptModelError:
        raise CorruptModelError(
            f"{downloading} from {repo} arrived damaged (its checksum does not match) and was deleted; "
            f"run `ferrum pull {name}` again"
        ) from None
    except GatedRepoError:
        raise FerrumError(f"{repo} is gated: accept its terms at {endpoint}/{repo}, then {login}") from None
    except RepositoryNotFoundError as e:
        if _status(e) == 404:
            raise ModelNotFoundError(
                f"no model {repo} on the Hub; check the name (`ferrum list --available` shows aliases)"
            ) from None
        raise FerrumError(f"{repo} was not found or needs a login: check the name, or {login}") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo} has no revision {ref.revision!r}; check the name after the @") from None
    except OfflineModeIsEnabled:
        raise _offline_error(name) from None
    except HfHubHTTPError as e:
        status = _status(e)
        if status == 401:
            raise FerrumError(f"the Hub rejected your token for {repo} (401): {login} with a valid token") from None
        if status == 403:
            raise FerrumError(f"access to {repo} is denied (403): {login} with an account that may read it") from None
        raise FerrumError(f"the Hub answered {status} for {downloading or repo}; try again later{retry}") from None
    except _network_errors() as e:
        raise FerrumError(
            f"cannot reach the Hub at {endpoint} ({type(e).__name__}); check the network connection{retry} "
            "(HF_HUB_OFFLINE=1 uses only downloaded models)"
        ) from None
    except OSError as e:  # a short read that http_get could not recover, a full disk
        reason = e.strerror or str(e).splitlines()[0]
        raise FerrumError(f"downloading {downloading or repo} failed ({reason}){retry}") from None


def _status(error) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def _network_errors() -> tuple[type[BaseException], ...]:
    """The transport errors of the HTTP client huggingface_hub uses (they reach us unwrapped),
    found from its session rather than imported by name: the hub chooses that library, and
    pinning it would tie ferrum to one hub release."""
    import sys

    from huggingface_hub import get_session

    client = sys.modules.get(type(get_session()).__module__.split(".")[0])
    transport = getattr(client, "TransportError", None)
    return (transport,) if isinstance(transport, type) and issubclass(transport, Exception) else (ConnectionError,)


def _model_info(ref: RepoRef, endpoint: str):
    from huggingface_hub import HfApi, constants

    try:
        return HfApi(endpoint=endpoint).model_info(
            ref.repo_id, revision=ref.revision, files_metadata=True, timeout=constants.HF_HUB_ETAG_TIMEOUT
        )
    except (ValueError, TypeError, KeyError, AttributeError):  # a 200 that is not the Hub's JSON
        raise FerrumError(
            f"{endpoint} answered with something other than a Hugging Face Hub's model information for "
            f"{ref.repo_id} (a proxy's or a network's login page?); check the network, or HF_ENDPOINT"
        ) from None


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def hub_offline() -> bool:
    """Whether the hub is off (HF_HUB_OFFLINE, as huggingface_hub reads it): no pull can work."""
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _cached_or_offline_error(ref: RepoRef, name: str) -> Path:
    local = cached_model(ref)
    if local is None:
        raise _offline_error(name)
    return local


def _offline_error(name: str) -> FerrumError:
    return ModelNotFoundError(
        f"{name} is not downloaded and HF_HUB_OFFLINE=1 forbids downloading it; unset HF_HUB_OFFLINE and run `ferrum pull {name}`"
    )
