"""Names from outside that become paths, and the check that every path the store writes stays home.

A repository id and a revision come from the user, a commit hash and file names from the Hub's
answers; each becomes a folder or file name in the cache. They are checked before use, and
every path the store writes is checked to resolve inside its root, so that neither a name such
as `../../x` nor a symlink planted in the cache makes ferrum write anywhere else.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ferrum_mac.errors import FerrumError, ModelNotFoundError

HASH = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")  # a git sha1 or sha256 (commits, blob ids, LFS oids)
# One part of a repository id, as the Hub allows it: ASCII letters, digits, `_`, `.`, `-`, at
# most 96, starting and ending with a letter, digit or `_`.
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//")
MAX_REVISION = 255
SHOWN = 80  # characters of a rejected name quoted back in an error


def is_hash(text) -> bool:
    return isinstance(text, str) and HASH.fullmatch(text) is not None


def shown(text: str) -> str:
    """`text` quoted for a one-line message, cut when long."""
    return repr(text if len(text) <= SHOWN else text[:SHOWN] + "...")


def is_repo_id(repo_id: str) -> bool:
    """`org/name` as the Hub allows it (so never `org/..`, `../x`, `a--b/c` or 5,000 characters)."""
    return (
        bool(_REPO_ID.fullmatch(repo_id))
        and ".." not in repo_id
        and "--" not in repo_id
        and not repo_id.endswith(".git")
    )


def is_ref_name(revision: str) -> bool:
    """A branch or tag name by `git check-ref-format --allow-onelevel`'s rules, and no leading `-`."""
    if not revision or len(revision) > MAX_REVISION or revision == "@" or _REF_FORBIDDEN.search(revision):
        return False
    if revision.startswith(("/", "-")) or revision.endswith(("/", ".")):
        return False
    return not any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/"))


def check_revision(revision: str, name: str) -> str:
    if not is_ref_name(revision):
        raise ModelNotFoundError(
            f"{shown(revision)} in {shown(name)} is not a revision: after the @ give a branch, a tag or a commit hash"
        )
    return revision


def check_commit(commit, endpoint: str) -> str:
    """The commit hash a Hub answer carries; it names a folder, so it must be a hash and nothing else."""
    if not is_hash(commit):
        raise FerrumError(
            f"the Hub at {endpoint} answered with {shown(str(commit))} as the commit, which is not a commit hash; "
            "is HF_ENDPOINT a Hugging Face Hub?"
        )
    return commit


def exists(path: Path) -> bool:
    """`path.exists()`, False rather than an error for a text no path can be (5,000 characters)."""
    try:
        return path.exists()
    except OSError:
        return False


def is_broken_link(path: Path) -> bool:
    """A symlink whose target is missing, or a loop of links."""
    try:
        return path.is_symlink() and not path.exists()
    except OSError:
        return False


def inside(root: Path, path: Path) -> Path:
    """`path`, once sure it resolves (symlinks followed, `..` applied) to `root` or a path under it;
    else FerrumError. Check a path before anything writes to it or through it."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise FerrumError(f"refusing to write {shown(str(path))}: it leads to {shown(real)}, outside {root}")
    return Path(path)


def check_relative(path: str, where: str) -> str:
    """A file name inside a repository, from the Hub: relative, with no `.` or `..` parts."""
    if not path or path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
        raise FerrumError(f"refusing the file name {shown(path)} {where}; is HF_ENDPOINT a Hugging Face Hub?")
    return path
