"""Which downloaded models a process has open, so no process deletes one another holds.

A process that serves a model of the store holds a shared lock (`flock`) on that model's
mark file for as long as the model is loaded; `ferrum rm` and `/api/delete` take the lock
exclusively, without waiting, for the whole removal. So a removal fails at once while any
process has the model loaded, and a load that comes while a removal runs fails instead of
reading files that are being deleted. The kernel drops a dead process's locks, so a crash
never leaves a model marked. Mark files stay (empty, beside the cache's own locks): deleting
one could let a holder and a remover lock two different files.

A model's unit is what a removal deletes: a repository's folder in the Hugging Face cache,
or the bundled model's folder. Paths outside the store (a folder of yours) have no unit.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ferrum_mac.errors import FerrumError
from ferrum_mac.store import bundled, hub_cache

MARKS = "ferrum-in-use"  # under the store's .locks folder


class ModelInUseError(FerrumError):
    """A removal refused because a process has the model loaded, or a load refused because a
    removal of it is under way."""


def unit_of(path: Path | str) -> Path | None:
    """The store folder that holds the model at `path` (what removing it deletes), or None."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    for root in (hub_cache.cache_dir(), bundled.models_dir()):
        root = Path(os.path.abspath(root))
        if path != root and path.is_relative_to(root):
            top = root / path.relative_to(root).parts[0]
            return None if top.name.startswith(".") else top
    return None


def mark_file(unit: Path) -> Path:
    return unit.parent / ".locks" / MARKS / f"{unit.name}.lock"


class Hold:
    """A shared lock on a model's unit, kept until `release` (a no-op for paths outside the store)."""

    def __init__(self, fd: int | None):
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing drops the lock


def hold(path: Path | str) -> Hold:
    """Mark the model at `path` as loaded by this process; `ModelInUseError` while it is being removed."""
    unit = unit_of(path)
    if unit is None:
        return Hold(None)
    fd = _open_mark(unit)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ModelInUseError(f"{unit.name} is being deleted") from None
    except BaseException:
        os.close(fd)
        raise
    return Hold(fd)


@contextmanager
def exclusive(unit: Path, name: str) -> Iterator[None]:
    """Hold `unit` alone while the block runs; `ModelInUseError` at once if any process has it loaded."""
    fd = _open_mark(unit)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ModelInUseError(
                f"{name} is loaded by a running ferrum serve; stop that server (or unload the model) first"
            ) from None
        yield
    finally:
        os.close(fd)


def _open_mark(unit: Path) -> int:
    mark = mark_file(unit)
    mark.parent.mkdir(parents=True, exist_ok=True)
    return os.open(mark, os.O_RDWR | os.O_CREAT, 0o644)
