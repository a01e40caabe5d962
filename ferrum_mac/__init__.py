"""ferrum_mac: local LLM chat, Apple-Silicon-first.

`open_model` is the one public entry to a model; everything else goes through the engine.
"""

from __future__ import annotations

from pathlib import Path

from ferrum_mac.errors import (
    FerrumError,
    KvCapacityError,
    ModelFileError,
    ModelNotFoundError,
    UnsupportedError,
)
from ferrum_mac.llm import DecodeItem, DecoderOnlyLLM, ForwardItem, LlmRuntimeConfig

__all__ = [
    "DecodeItem",
    "DecoderOnlyLLM",
    "FerrumError",
    "ForwardItem",
    "KvCapacityError",
    "LlmRuntimeConfig",
    "ModelFileError",
    "ModelNotFoundError",
    "UnsupportedError",
    "open_model",
]
__version__ = "0.1.0"


def open_model(name_or_path: str | Path, backend: str = "auto", dtype: str | None = None) -> DecoderOnlyLLM:
    """Open a model folder (config.json + safetensors) or a .gguf file with a backend.

    `dtype` ("float32", "float16", "bfloat16") overrides the compute dtype.
    """
    from ferrum_mac.backends import open_path

    return open_path(Path(name_or_path), backend=backend, dtype=dtype)
