"""A scheduler and live `ferrum serve` servers on stories260K, bound to 127.0.0.1 on free ports,
and a model folder of random Qwen3 weights with Qwen3's own tokenizer and template."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from serve_support import API_KEY, REPO, LiveServer, open_stories

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))
from fake_hub import FakeHub, FakeRepo  # noqa: E402  (the store tests' Hub look-alike)

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
STORIES = SHARED / "assets" / "stories260K"


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"stories260K not found at {STORIES}")
    return STORIES


@pytest.fixture(scope="session")
def scheduler(stories_path):
    from ferrum_mac.serve import Scheduler

    s = Scheduler(open_stories(stories_path)).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def server(scheduler):
    from ferrum_mac.serve.app import build_app

    live = LiveServer(build_app(scheduler, "stories260K"))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def keyed_server(scheduler):
    from ferrum_mac.serve.app import build_app

    live = LiveServer(build_app(scheduler, "stories260K", api_key=API_KEY))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def small_server(stories_path):
    """A server whose model holds 48 tokens per sequence."""
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(stories_path, kv_capacity=48)).start()
    live = LiveServer(build_app(scheduler, "stories260K-small"))
    yield live
    live.stop()
    scheduler.stop()


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def qwen3_random(tmp_path_factory, shared_assets) -> Path:
    """A tiny Qwen3 with random weights and Qwen3's real tokenizer and chat template (its tool
    call format and its <think> section), built once a session."""
    import shutil

    import helpers
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("qwen3-random")
    torch.manual_seed(0)
    config = Qwen3Config(**{**helpers.TINY, "vocab_size": 151936}, head_dim=32, tie_word_embeddings=True)
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(shared_assets / "tokenizers" / "qwen3" / name, folder / name)
    return folder


@pytest.fixture
def hub(stories_path, tmp_path, monkeypatch):
    """The fake Hub serving stories260K's files as a repository, set as the endpoint, and an empty
    Hugging Face cache for the pull to fill."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    files = {p.name: p.read_bytes() for p in stories_path.iterdir() if p.is_file()}
    server = FakeHub()
    server.add(FakeRepo(REPO, files))
    server.start()
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    yield server
    server.stop()
