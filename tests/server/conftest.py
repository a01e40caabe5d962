"""A scheduler and live `ferrum serve` servers on stories260K, bound to 127.0.0.1 on free ports."""

from __future__ import annotations

from pathlib import Path

import pytest

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
