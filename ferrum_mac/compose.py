"""The composition root: where a model name becomes a model, and a model a chat engine.

The interfaces (CLI, REPL, chat app, server, bench) open models only through here; this is
the one module that puts the store (names -> files), the backends (files -> a
`DecoderOnlyLLM`), the text layer and the settings together. The engine itself depends only
on the contract, the text layer and the errors.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ferrum_mac import settings
from ferrum_mac.backends import choose, describe_device, open_path, recommended_dtype
from ferrum_mac.backends.options import SETTING_OF, BackendOptions
from ferrum_mac.llm import DecoderOnlyLLM

if TYPE_CHECKING:
    from ferrum_mac.serve.response_store import ResponseStore
    from ferrum_mac.engine import Engine


def open_model(
    name_or_path: str | Path,
    backend: str = "auto",
    dtype: str | None = None,
    pull: bool = True,
    device: str | None = None,
    kv_capacity: int | None = None,
    quant: str | None = None,
) -> DecoderOnlyLLM:
    """Open a model folder (config.json + safetensors) or a .gguf file with a backend.

    Any other name (an alias such as "qwen3:0.6b", a Hugging Face repo id) goes through the
    model store: a cached copy is used, a missing one is downloaded unless `pull` is false.
    `dtype` ("float32", "float16", "bfloat16") overrides the compute dtype; `device` (cpu, gpu,
    cuda[:N], metal) the backend's default device; `kv_capacity` caps the tokens one sequence
    holds (default: FERRUM_KV_CAPACITY, else the model's maximum as memory allows). `quant`
    ("4bit", "8bit"; torch backend) quantizes a bf16 or fp16 checkpoint as it loads (affine,
    group 64), for those who only have the full model.
    """
    chosen = choose_backend(backend)  # first: on MLX, `route_cpu_blas` runs before anything imports it
    device = device_or_setting(chosen, device)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        from ferrum_mac.store import resolve_model

        path = resolve_model(str(name_or_path), backend=chosen, pull=pull)
    return open_path(
        path,
        backend=chosen,
        dtype=dtype,
        device=device,
        kv_capacity=kv_capacity_or_setting(kv_capacity),
        quant=quant,
        options=backend_options(),
    )


def open_engine(
    name: str | Path | None = None,
    *,
    backend: str = "auto",
    device: str | None = None,
    dtype: str | None = None,
    pull: bool = True,
    template: str | None = None,
    kv_capacity: int | None = None,
) -> "Engine":
    """A chat engine on the model called `name` (a path, alias or repo id; default:
    FERRUM_MODEL, else the bundled smollm2:135m), downloaded first if needed and `pull`
    allows; its tokenizer, chat template, sampling defaults and answer limit from the model's
    files. `kv_capacity` as for `open_model`."""
    chosen = choose_backend(backend)  # first: on MLX, `route_cpu_blas` runs before anything imports it
    device = device_or_setting(chosen, device)
    from ferrum_mac.engine import Engine
    from ferrum_mac.engine.defaults import max_tokens_default, sampling_defaults
    from ferrum_mac.store import resolve_model
    from ferrum_mac.store.bundled import bundled_sampling
    from ferrum_mac.text import load_chat_template, load_tokenizer

    name = str(name or default_model_name())
    path = resolve_model(name, backend=chosen, pull=pull)
    model = open_path(
        path,
        backend=chosen,
        dtype=dtype or recommended_dtype(chosen, device),
        device=device,
        kv_capacity=kv_capacity_or_setting(kv_capacity),
        options=backend_options(),
    )
    tokenizer = load_tokenizer(path)
    return Engine(
        model,
        tokenizer,
        load_chat_template(path, tokenizer, template),
        name=name,
        path=path,
        sampling=sampling_defaults(path, bundled_sampling(path)),
        max_tokens=max_tokens_default(path),
        device=describe_device(chosen, model),
    )


def choose_backend(backend: str) -> str:
    """`backends.choose` with MLX's CPU BLAS routed as FERRUM_CPU_BLAS says: the interfaces
    choose through here, so that the first choice in a process honours it."""
    return choose(backend, settings.value("FERRUM_CPU_BLAS"))


def default_model_name() -> str:
    """The model opened when none is named: FERRUM_MODEL, else the bundled model."""
    return settings.value("FERRUM_MODEL")


def ollama_host() -> str | None:
    """OLLAMA_HOST, as Ollama reads it: where `ferrum serve --ollama` listens (None: its default)."""
    return settings.value("OLLAMA_HOST")


def serve_any_model() -> bool:
    """FERRUM_SERVE_ANY_MODEL: whether `ferrum serve` answers names it does not have with its default model."""
    return settings.value("FERRUM_SERVE_ANY_MODEL")


def device_or_setting(backend: str, device: str | None) -> str | None:
    """The device asked for, else on torch FERRUM_DEVICE's (None: the backend's default)."""
    if device is None and backend == "torch":
        return settings.value("FERRUM_DEVICE") or None
    return device


def backend_options() -> BackendOptions:
    """The backends' switches as the settings (FERRUM_MLX_*, FERRUM_TORCH_*, ...) say now."""
    switches = {option: settings.value(name) for option, name in SETTING_OF.items()}
    return BackendOptions(**switches, prefix_dir=settings.prefix_cache_dir())


def response_store() -> "ResponseStore":
    """Where `ferrum serve` keeps /v1/responses answers: the data folder's file for
    FERRUM_RESPONSES_DAYS days (0: in memory, until the server stops)."""
    from ferrum_mac.serve.response_store import ResponseStore

    days = settings.value("FERRUM_RESPONSES_DAYS")
    if not days:
        return ResponseStore(None, ttl_s=float("inf"))
    return ResponseStore(settings.responses_db_path(), ttl_s=days * 24 * 3600)


def kv_capacity_or_setting(kv_capacity: int | None) -> int | None:
    """The KV capacity asked for, else FERRUM_KV_CAPACITY's (None: the model's maximum)."""
    return kv_capacity if kv_capacity is not None else settings.value("FERRUM_KV_CAPACITY")


def free_memory_bytes(backend: str = "auto", device: str | None = None) -> int:
    """Memory a model about to be opened on `backend` (and `device`) may still take. On a CPU
    that is Linux's MemAvailable where it can be read: free pages alone leave out the page
    cache, which gives way to a model's weights."""
    if choose_backend(backend) == "mlx":
        from ferrum_mac.backends.mlx.memory import free_memory_bytes as mlx_free
        from ferrum_mac.backends.mlx.memory import on_cpu

        return max(mlx_free(), available_memory_bytes()) if on_cpu() else mlx_free()
    from ferrum_mac.backends.torch.memory import free_memory_bytes as torch_free
    from ferrum_mac.backends.torch.memory import resolve_device

    chosen = resolve_device(device_or_setting("torch", device))
    free = torch_free(chosen)
    return max(free, available_memory_bytes()) if chosen.type == "cpu" else free


def available_memory_bytes() -> int:
    """Linux's MemAvailable (0 where /proc/meminfo says nothing of it)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def release_cached_memory() -> None:
    """Give memory back once a model's last reference is gone: collect it, then empty the
    allocators' caches of freed buffers (MLX's, torch's on CUDA, and on Linux the C heap's)."""
    gc.collect()
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        mx.clear_cache()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None
    if trim is not None:
        trim(0)  # glibc keeps freed heap pages mapped otherwise
