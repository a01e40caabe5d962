"""A scheduler and live `ferrum serve` servers on stories260K, bound to 127.0.0.1 on free ports."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_support import API_KEY

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
STORIES = SHARED / "assets" / "stories260K"


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"stories260K not found at {STORIES}")
    return STORIES


def open_stories(path: Path, kv_capacity: int | None = None):
    """An opener for the scheduler's thread (the env var is read when the model loads)."""

    def open_engine():
        import os

        from ferrum_mac.engine import Engine

        if kv_capacity is None:
            return Engine.open(path)
        os.environ["FERRUM_KV_CAPACITY"] = str(kv_capacity)
        try:
            return Engine.open(path)
        finally:
            del os.environ["FERRUM_KV_CAPACITY"]

    return open_engine


@pytest.fixture(scope="session")
def scheduler(stories_path):
    from ferrum_mac.serve import Scheduler

    s = Scheduler(open_stories(stories_path)).start()
    yield s
    s.stop()


class LiveServer:
    """`build_app` under uvicorn on a thread, on 127.0.0.1 and a free port."""

    def __init__(self, app):
        import socket
        import threading

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        import time

        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "the server did not start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)




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
