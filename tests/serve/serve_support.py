"""Constants and helpers shared by the server tests and their fixtures (not in conftest: several test
folders have one, and `from conftest import` would pick the wrong one)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from ferrum_mac.serve.listener import uvicorn_config

API_KEY = "test-key"
REPO = "tiny-org/tiny-stories"  # the repository the fake Hub (conftest's `hub`) serves


def open_stories(path: Path, kv_capacity: int | None = None):
    """An opener for the scheduler's thread."""

    def open_engine():
        from ferrum_mac.compose import open_engine

        return open_engine(path, kv_capacity=kv_capacity)

    return open_engine


class LiveServer:
    """`build_app` under uvicorn on a thread, on 127.0.0.1 and a free port, with the settings
    `ferrum serve` uses (`limits`: header_timeout, max_connections)."""

    def __init__(self, app, **limits):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=self.port, **limits))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "the server did not start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


# -- requests and their errors, for the hostile-input tests ---------------------------------

MESSAGES = [{"role": "user", "content": "Tell me a story about Lily."}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def post_raw(server, path: str, raw: bytes, **headers) -> httpx.Response:
    """A body sent as given (httpx's json= cannot send NaN or lone surrogates)."""
    return httpx.post(
        server.url + path, content=raw, headers={"content-type": "application/json", **headers}, timeout=60
    )


def chat(server, timeout: float = 60, **fields) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(server.url + CHAT, json=body, timeout=timeout)


# -- several models --------------------------------------------------------------------------


def open_models(
    default: Path,
    default_name: str,
    others: dict[str, Path],
    kv_capacity: int | None = None,
    max_batch: int = 4,
    **registry,
):
    """A registry of `default` (opened now) plus `others` (name -> path) as the store's models,
    opened on first use, as `ferrum serve` builds it; `registry`: Models' keyword settings.
    `max_batch`: a small batch makes the schedulers' warm-up, and so each load, quick."""
    from ferrum_mac.compose import release_cached_memory
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.batching.models import LoadedModel, Models, size_of
    from ferrum_mac.store.catalog import LocalModel

    def open_scheduler(path):
        return Scheduler(open_stories(Path(path), kv_capacity=kv_capacity), max_batch=max_batch).start()

    store = [LocalModel(name, path, size_of(path), "?", "?", 0.0) for name, path in others.items()]
    first = LoadedModel(
        default_name, open_scheduler(default), size_of(default), registry.get("keep_alive_s", 300.0), default
    )
    registry.setdefault("release_memory", release_cached_memory)
    return Models(first, open_scheduler, lambda: store, **registry)
