"""Pulls through the fake Hub: the whole path, resume, and each failure's one-line message."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from fake_hub import FakeRepo
from tiny_repo import REPO_ID
from ferrum_mac.errors import FerrumError, ModelNotFoundError
from ferrum_mac.store import hub_cache, list_models, resolve_model
from ferrum_mac.store import pull_model as pull

WANTED = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "README.md",
}


def downloaded(hub) -> set[str]:
    return {r["file"] for r in hub.requests if r["method"] == "GET" and r["file"]}


def listed(name: str) -> list:
    return [m for m in list_models() if m.name == name]


def test_pull_fetches_only_needed_files_and_the_model_runs(hub):
    import mlx.core as mx

    import ferrum_mac

    path = pull(REPO_ID)
    assert downloaded(hub) == WANTED  # no .bin, no .gguf, nothing under original/
    assert {p.name for p in path.iterdir()} == WANTED
    [model] = listed(REPO_ID)
    assert model.complete and model.format == "safetensors" and model.quant == "fp32"

    llm = ferrum_mac.open_model(REPO_ID, dtype="float32", pull=False)
    logits = llm.prefill("t", [1, 5, 9, 14])
    assert logits.shape[-1] == 512 and bool(mx.all(mx.isfinite(logits)))

    hub.requests.clear()
    assert resolve_model(REPO_ID) == path and not hub.requests  # cached: no network at all
    pull(REPO_ID)  # an explicit pull asks the Hub, finds everything there, downloads nothing
    assert not downloaded(hub)


def test_interrupted_pull_resumes_without_resending(hub):
    size = len(hub.repos[REPO_ID].files["model.safetensors"])
    cut = size // 2
    hub.cut[(REPO_ID, "model.safetensors")] = cut
    with pytest.raises(FerrumError, match=r"answered 503 .*`ferrum pull tiny-org/tiny-llama` resumes"):
        pull(REPO_ID)
    assert not listed(REPO_ID) or not listed(REPO_ID)[0].complete
    with pytest.raises(ModelNotFoundError, match="not downloaded"):
        resolve_model(REPO_ID, pull=False)

    [partial] = hub_cache.partial_files(REPO_ID)
    kept = partial.stat().st_size
    assert 0 < kept <= cut

    hub.heal()
    hub.requests.clear()
    hub.sent.clear()
    path = pull(REPO_ID)
    assert [r["range"] for r in hub.file_requests("model.safetensors")] == [f"bytes={kept}-"] * 2  # resolve, then CDN
    assert hub.sent[(REPO_ID, "model.safetensors")] == size - kept  # what was kept is not sent again
    assert not hub_cache.partial_files(REPO_ID)
    assert (path / "model.safetensors").stat().st_size == size
    assert listed(REPO_ID)[0].complete


def test_missing_repository(hub):
    with pytest.raises(ModelNotFoundError, match=r"^no model tiny-org/nope on the Hub; check the name"):
        pull("tiny-org/nope")


def test_private_repository_names_the_login_fix_and_honours_HF_TOKEN(hub, monkeypatch):
    hub.deny[REPO_ID] = (401, "RepoNotFound")
    hub.tokens[REPO_ID] = "hf_good"
    with pytest.raises(FerrumError, match=r"not found or needs a login.*`hf auth login` or set HF_TOKEN"):
        pull(REPO_ID)
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    hub.requests.clear()
    assert pull(REPO_ID).is_dir()
    to_repo = [r for r in hub.requests if r["path"].startswith(("/api/models/", f"/{REPO_ID}/"))]
    assert to_repo and all(r["auth"] == "Bearer hf_good" for r in to_repo)


@pytest.mark.parametrize(
    "code, expected",
    [
        ("GatedRepo", r"is gated: accept its terms at http://127\.0\.0\.1:\d+/tiny-org/tiny-llama, then log in"),
        (None, r"access to tiny-org/tiny-llama is denied \(403\): log in with `hf auth login`"),
    ],
)
def test_forbidden_repository(hub, code, expected):
    hub.deny[REPO_ID] = (403, code)
    with pytest.raises(FerrumError, match=expected):
        pull(REPO_ID)
    assert not downloaded(hub)


def test_corrupted_file_is_deleted_and_never_listed(hub):
    hub.corrupt.add((REPO_ID, "model.safetensors"))
    with pytest.raises(FerrumError, match=r"model.safetensors from tiny-org/tiny-llama arrived damaged"):
        pull(REPO_ID)
    assert not listed(REPO_ID)
    with pytest.raises(ModelNotFoundError):
        resolve_model(REPO_ID, pull=False)

    hub.corrupt.clear()
    hub.requests.clear()
    pull(REPO_ID)
    assert [r["range"] for r in hub.file_requests("model.safetensors")] == [
        None,
        None,
    ]  # from byte 0: nothing damaged kept
    assert listed(REPO_ID)[0].complete


def test_not_enough_disk_space_stops_before_downloading(hub, monkeypatch):
    monkeypatch.setattr("ferrum_mac.store.pull.free_bytes", lambda path: 50_000)
    with pytest.raises(FerrumError, match=r"not enough disk space to pull tiny-org/tiny-llama: it needs .* is free"):
        pull(REPO_ID)
    assert not downloaded(hub)


def test_no_network(hf_home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(FerrumError, match=r"cannot reach the Hub at http://127\.0\.0\.1:9 \(ConnectError\)"):
        pull(REPO_ID)


def test_offline_mode_uses_only_the_cache(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE=1 forbids downloading"):
        pull(REPO_ID)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    path = pull(REPO_ID)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    assert pull(REPO_ID) == path and resolve_model(REPO_ID) == path
    assert not hub.requests


def test_models_fetched_by_the_hub_library_are_listed(hub):
    """What mlx-lm or `hf download` put in the cache shows up, judged by the same completeness rule."""
    from huggingface_hub import snapshot_download

    snapshot_download(REPO_ID, allow_patterns=["*.json", "*.safetensors", "tokenizer.model"], endpoint=hub.url)
    assert not [r for r in hub.requests if "xet" in r["path"].lower()]  # plain HTTP, as the fake Hub intends
    [model] = listed(REPO_ID)
    assert model.complete
    hub.add(FakeRepo("tiny-org/half", {k: v for k, v in hub.repos[REPO_ID].files.items() if k.endswith(".json")}))
    snapshot_download("tiny-org/half", endpoint=hub.url)
    assert [m.complete for m in listed("tiny-org/half")] == [False]  # config but no weights
    with pytest.raises(ModelNotFoundError):
        resolve_model("tiny-org/half", pull=False)


def test_gguf_repository_takes_one_quantization(hub):
    files = {
        "README.md": b"---\nlicense: apache-2.0\n---\n",
        "m-Q4_K_M.gguf": b"x" * 100,
        "m-Q8_0.gguf": b"y" * 100,
        "m-Q4_0.gguf": b"z" * 100,
    }
    hub.add(FakeRepo("tiny-org/gguf", files))
    assert pull("tiny-org/gguf").name == "m-Q4_0.gguf"  # the first type ferrum loads
    assert pull("tiny-org/gguf:q8_0").name == "m-Q8_0.gguf"
    assert downloaded(hub) == {"README.md", "m-Q4_0.gguf", "m-Q8_0.gguf"}
    with pytest.raises(ModelNotFoundError, match="has no Q6_K GGUF; it has: Q4_0, Q4_K_M, Q8_0"):
        pull("tiny-org/gguf:Q6_K")


def test_pull_at_a_revision(hub):
    sha = hub.repos[REPO_ID].sha
    path = pull(f"{REPO_ID}@{sha}")
    assert path.name == sha
    assert [m.name for m in list_models()] == [f"{REPO_ID}@{sha}"]
    assert resolve_model(f"{REPO_ID}@{sha}", pull=False) == path
    with pytest.raises(ModelNotFoundError, match=r"tiny-org/tiny-llama has no revision 'v9'"):
        pull(f"{REPO_ID}@v9")


def test_a_hub_answering_with_a_web_page_is_a_one_line_error(hub):
    hub.portal.add(REPO_ID)
    with pytest.raises(FerrumError, match=r"answered with something other than a Hugging Face Hub's") as caught:
        pull(REPO_ID)
    assert "\n" not in str(caught.value) and not downloaded(hub)


def test_an_unforeseen_failure_is_a_one_line_ferrum_error(hub, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr("ferrum_mac.store.hub_cache.link_snapshot", broken)
    with pytest.raises(FerrumError, match=r"^pulling tiny-org/tiny-llama failed \(ZeroDivisionError: division"):
        pull(REPO_ID)


def test_writers_of_one_ref_and_one_snapshot_never_share_a_temporary_file(hub):
    sha, go = hub.repos[REPO_ID].sha, threading.Barrier(8)
    files = {"a.json": "0" * 40, "b.json": "1" * 40}

    def write(_):
        go.wait()
        for _ in range(100):
            hub_cache.write_ref(REPO_ID, "main", sha)
            hub_cache.link_snapshot(REPO_ID, sha, files)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(8)))
    refs = hub_cache.repo_dir(REPO_ID) / "refs"
    assert [p.name for p in refs.iterdir()] == ["main"] and (refs / "main").read_text() == sha
    assert sorted(p.name for p in hub_cache.snapshot_dir(REPO_ID, sha).iterdir()) == ["a.json", "b.json"]


def test_four_pulls_of_one_model_at_once_all_succeed(hub):
    go = threading.Barrier(4)

    def pull_when_all_are_ready(_):
        go.wait()
        return pull(REPO_ID)

    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(pull_when_all_are_ready, range(4)))
    assert len(set(paths)) == 1 and listed(REPO_ID)[0].complete
    assert {p.name for p in paths[0].iterdir()} == WANTED
