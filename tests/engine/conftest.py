"""Engines on real weights, opened once: stories260K (tiny, fast; a plain fallback template)
and the bundled SmolLM2-135M-Instruct GGUF (a real chat model with ChatML)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def stories_path(shared_assets) -> Path:
    folder = shared_assets / "stories260K"
    if not (folder / "model.safetensors").is_file():
        pytest.skip("stories260K is not in the shared assets")
    return folder


@pytest.fixture(scope="session")
def stories(stories_path):
    from ferrum_mac.engine import Engine

    return Engine.open(stories_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    from ferrum_mac.engine import Engine

    return Engine.open(smollm2_gguf)


@pytest.fixture
def small_context(stories_path):
    """A stories260K engine whose KV capacity is `tokens`."""
    from ferrum_mac.compose import open_engine

    def open_with(tokens: int):
        engine = open_engine(stories_path, kv_capacity=tokens)
        assert engine.model.kv_capacity() == tokens
        return engine

    return open_with
