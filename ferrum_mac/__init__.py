"""ferrum_mac: local LLM chat, Apple-Silicon-first.

`open_model` is the one public entry to a model; everything else goes through the engine.
Both are opened by the composition root, `ferrum_mac.compose`.
"""

from __future__ import annotations

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


def __getattr__(name: str):
    # `open_model` lives in the composition root, imported on first use: `import ferrum_mac`
    # (and the engine, the text layer) stay free of the backends and the store.
    if name == "open_model":
        from ferrum_mac.compose import open_model

        return open_model
    raise AttributeError(f"module 'ferrum_mac' has no attribute {name!r}")
