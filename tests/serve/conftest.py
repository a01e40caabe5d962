"""A scheduler and live `ferrum serve` servers on stories260K, bound to 127.0.0.1 on free ports."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_support import API_KEY, LiveServer, open_stories

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
