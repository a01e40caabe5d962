"""ferrum_mac: local LLM chat, Apple-Silicon-first.

`open_model` is the one public entry to a model; everything else goes through the engine.
"""

from __future__ import annotations

import sys
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


class _BeforeMlx:
    """An import hook that finds nothing: just before the process first imports MLX, it routes
    MLX's CPU matmuls to numpy's OpenBLAS (Linux; see ferrum_mac/backends/mlx/cpu_blas.py),
    which has to happen before libmlx is loaded. Costs nothing until then."""

    done = False

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if not cls.done and (name == "mlx" or name.startswith("mlx.")):
            cls.done = True
            from ferrum_mac.backends.mlx.cpu_blas import activate

            activate()
        return None


if sys.platform.startswith("linux") and "mlx.core" not in sys.modules:
    sys.meta_path.insert(0, _BeforeMlx)


def open_model(
    name_or_path: str | Path, backend: str = "auto", dtype: str | None = None, pull: bool = True,
    device: str | None = None,
) -> DecoderOnlyLLM:
    """Open a model folder (config.json + safetensors) or a .gguf file with a backend.

    Any other name (an alias such as "qwen3:0.6b", a Hugging Face repo id) goes through the
    model store: a cached copy is used, a missing one is downloaded unless `pull` is false.
    `dtype` ("float32", "float16", "bfloat16") overrides the compute dtype; `device` (cpu, gpu,
    cuda[:N], metal) the backend's default device.
    """
    from ferrum_mac.backends import choose, open_path

    path = Path(name_or_path).expanduser()
    if not path.exists():
        from ferrum_mac.store import resolve_model

        path = resolve_model(str(name_or_path), backend=choose(backend), pull=pull)
    return open_path(path, backend=backend, dtype=dtype, device=device)
