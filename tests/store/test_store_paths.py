"""Names from outside never lead the store's writes out of the cache: a hostile Hub's commit
hash and file names, a revision or repository id typed by the user, symlinks planted in the cache."""

from __future__ import annotations

import hashlib
import os

import pytest

from tiny_repo import REPO_ID
from ferrum_mac.errors import FerrumError, ModelNotFoundError
from ferrum_mac.store import hub_cache, plan_removal, resolve_model
from ferrum_mac.store import pull_model as pull
from ferrum_mac.store.aliases import parse_name


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text and len(text) < 400, text
    return text


def test_a_commit_that_is_not_a_hash_is_refused_before_anything_is_linked(hub, hf_home, tmp_path):
    pull(REPO_ID)  # the blobs are cached, so the second pull only links
    victim = tmp_path / "planted" / "config.json"
    victim.parent.mkdir()
    victim.write_text("the user's own file")
    hub.repos[REPO_ID].sha = "../../../../planted"  # snapshots/<sha> would be tmp_path/planted
    with pytest.raises(FerrumError, match=r"not a commit hash") as e:
        pull(REPO_ID)
    one_line(e)
    assert not victim.is_symlink() and victim.read_text() == "the user's own file"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["config.json"]


@pytest.mark.parametrize("sha", ["a" * 39, "A" * 40, "a" * 40 + "\n", "a" * 40 + "/../x", "", None], ids=repr)
def test_only_a_40_or_64_digit_hash_is_a_commit(hub, sha):
    hub.repos[REPO_ID].sha = sha
    with pytest.raises(FerrumError, match=r"not a commit hash") as e:
        pull(REPO_ID)
    one_line(e)
    assert not (hub_cache.repo_dir(REPO_ID) / "snapshots").exists()


def test_a_revision_that_climbs_out_of_refs_is_refused_before_asking_the_hub(hub, hf_home):
    revision = "../../../escaped"  # refs/<revision> would be the HF home's escaped
    hub.repos[REPO_ID].revisions.add(revision)  # a Hub that answers to anything
    hub.requests.clear()
    with pytest.raises(ModelNotFoundError, match=r"is not a revision: after the @ give a branch") as e:
        pull(f"{REPO_ID}@{revision}")
    one_line(e)
    assert not hub.requests
    assert not (hf_home / "escaped").exists()
    with pytest.raises(ModelNotFoundError, match=r"is not a revision"):
        resolve_model(f"{REPO_ID}@{revision}", pull=False)


@pytest.mark.parametrize(
    "revision",
    [
        "../x",
        "a/../b",
        "/abs",
        "-rf",
        "a\\b",
        "a b",
        "a\nb",
        "a\x00b",
        "a~1",
        "a^",
        "a?",
        "a*",
        "a[",
        "a@{1}",
        "@",
        ".hidden",
        "a/.b",
        "a.lock",
        "a/",
        "a.",
        "a//b",
        "",
        "x" * 300,
    ],
    ids=repr,
)
def test_revisions_follow_git_ref_name_rules(revision):
    with pytest.raises(ModelNotFoundError, match=r"is not a revision|is not a model name"):
        parse_name(f"org/name@{revision}")


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "release-2024_01", "a" * 40])
def test_ordinary_revisions_pass(revision):
    assert parse_name(f"org/name@{revision}").revision == revision


@pytest.mark.parametrize(
    "name",
    [
        "org/..",
        "org/.",
        "../x",
        "./x",
        "a/" + "b" * 5000,
        "b" * 5000,
        "a--b/c",
        "org/name.git",
        "-org/name",
        "org/name-",
        "org/na me",
        "org/námé",
        "org/x\ny",
    ],
    ids=lambda name: repr(name[:24]),
)
def test_bad_repository_ids_are_one_line_errors(hf_home, name):
    for action in (lambda: pull(name), lambda: resolve_model(name, pull=False), lambda: plan_removal(name)):
        with pytest.raises(ModelNotFoundError, match=r"is not a model name|does not exist") as e:
            action()
        one_line(e)


def test_file_names_with_dot_dot_from_the_hub_are_never_written(hub, hf_home, tmp_path):
    repo = hub.repos[REPO_ID]
    repo.files["../../../escape.safetensors"] = b"x" * 100
    repo.files["sub/../../../escape2.json"] = b"{}"
    path = pull(REPO_ID)
    assert (path / "model.safetensors").is_file()
    assert not list(tmp_path.rglob("escape*"))


@pytest.mark.parametrize("size", [-1, "100", 1.5])
def test_a_file_size_from_the_hub_that_is_no_size_is_refused(hub, size, monkeypatch):
    import fake_hub

    sibling = fake_hub.FakeRepo.sibling

    def odd_size(repo, path):
        entry = sibling(repo, path)
        if path == "config.json":
            entry["size"] = size
        return entry

    monkeypatch.setattr(fake_hub.FakeRepo, "sibling", odd_size)
    with pytest.raises(FerrumError, match="no valid size for 'config.json'") as e:
        pull(REPO_ID)
    one_line(e)


def test_a_snapshot_path_that_leaves_the_snapshot_is_refused(hf_home, tmp_path):
    commit = "a" * 40
    for name in ("../../../../escape", "sub/../../x", "/abs/x", "a/./b", ".."):
        with pytest.raises(FerrumError, match="refusing the file name") as e:
            hub_cache.link_snapshot(REPO_ID, commit, {name: "b" * 40})
        one_line(e)
    assert not list(tmp_path.rglob("escape"))


def test_a_planted_symlink_in_the_cache_is_not_written_through(hf_home, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    snapshots = hub_cache.repo_dir(REPO_ID) / "snapshots"
    snapshots.mkdir(parents=True)
    commit = "c" * 40
    os.symlink(outside, snapshots / commit)  # snapshots/<commit> -> a folder of the user's
    with pytest.raises(FerrumError, match="refusing to write") as e:
        hub_cache.link_snapshot(REPO_ID, commit, {"config.json": "b" * 40})
    one_line(e)
    assert not list(outside.iterdir())


def test_a_planted_partial_download_link_is_not_appended_to(hub, hf_home, tmp_path):
    data = hub.repos[REPO_ID].files["model.safetensors"]
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    blobs = hub_cache.repo_dir(REPO_ID) / "blobs"
    blobs.mkdir(parents=True)
    os.symlink(victim, blobs / f"{hashlib.sha256(data).hexdigest()}.incomplete")
    with pytest.raises(FerrumError, match="refusing to write") as e:
        pull(REPO_ID)
    one_line(e)
    assert victim.read_bytes() == b"precious"


def test_a_ref_that_is_not_a_commit_names_no_snapshot(hub, hf_home):
    pull(REPO_ID)
    (hub_cache.repo_dir(REPO_ID) / "refs" / "main").write_text("../../../../etc\n")
    assert hub_cache.commit_for(REPO_ID, "main") is None
    with pytest.raises(ModelNotFoundError, match="not downloaded"):
        resolve_model(REPO_ID, pull=False)


def test_the_dense_copy_is_not_written_through_a_planted_link(tmp_path):
    mx = pytest.importorskip("mlx.core")
    from ferrum_mac.backends.mlx.cpu import dense_cache

    folder = tmp_path / "dense-weights"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    entry = folder / "abc-123.safetensors"
    os.symlink(victim, folder / f".{entry.stem}-{os.getpid()}.tmp.safetensors")
    with pytest.raises(FerrumError, match="refusing to write") as e:
        dense_cache.store(entry, {"w": mx.zeros((2, 2))}, tmp_path / "model.gguf")
    one_line(e)
    assert victim.read_bytes() == b"precious" and not entry.exists()
