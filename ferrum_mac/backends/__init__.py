"""Backends implement `DecoderOnlyLLM`; this module picks one and opens a checkpoint with it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ferrum_mac.errors import UnsupportedError
from ferrum_mac.llm import DecoderOnlyLLM

BACKENDS = ("mlx", "torch")
DEVICES = ("cpu", "gpu", "cuda", "metal")  # cuda:N names one of several GPUs (torch)


def available(backend: str) -> bool:
    module = {"mlx": "mlx.core", "torch": "torch"}[backend]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def choose(backend: str) -> str:
    if backend == "auto":
        return automatic()
    if backend not in BACKENDS:
        raise UnsupportedError(f"unknown backend {backend!r}; choose one of: auto, {', '.join(BACKENDS)}")
    if not available(backend):
        install = {"mlx": "pip install mlx", "torch": "pip install 'ferrum-mac[cuda]' (or a torch build for your GPU)"}
        raise UnsupportedError(f"the {backend} backend is not installed; {install[backend]}")
    return backend


def automatic() -> str:
    """torch where it is installed and an NVIDIA GPU is present; else MLX (Metal on a Mac; on
    a Linux CPU its matmuls go to OpenBLAS, see cpu_blas); else torch on the CPU.

    Decided without importing either library (torch's import alone takes seconds), so that
    `ferrum run` starts fast."""
    if available("torch") and nvidia_gpu_present():
        return "torch"
    for candidate in BACKENDS:
        if available(candidate):
            return candidate
    raise UnsupportedError("no backend is installed; install ferrum-mac with MLX (or 'ferrum-mac[cuda]' for torch)")


def nvidia_gpu_present() -> bool:
    """An NVIDIA driver with at least one GPU (Linux's /proc entry, or a device node)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or Path("/dev/nvidia0").exists()


def check_device(device: str | None) -> str | None:
    """`device` as given when it is one we know (None: the backend's default), else a clear error."""
    if device is None:
        return None
    kind, _, index = device.partition(":")
    if kind not in DEVICES or (index and not (kind == "cuda" and index.isdigit())):
        raise UnsupportedError(f"unknown device {device!r}; choose cpu, gpu, cuda (or cuda:N) or metal")
    return device


def recommended_dtype(backend: str = "auto", device: str | None = None) -> str | None:
    """The compute dtype to ask for when the user names none: float32 where the device has no
    fast half-precision kernels (MLX's CPU build runs float16 many times slower), else None
    (the checkpoint's own)."""
    if check_device(device) == "cpu":
        return "float32"
    if choose(backend) == "mlx":
        from ferrum_mac.backends.mlx.memory import device_name

        return "float32" if device_name() == "cpu" else None
    from ferrum_mac.backends.torch.memory import resolve_device

    return "float32" if resolve_device(device).type == "cpu" else None  # torch's CPU half-precision matmuls are slow


def open_path(
    path: Path, backend: str = "auto", dtype: str | None = None, device: str | None = None, kv_capacity: int | None = None
) -> DecoderOnlyLLM:
    """Open a checkpoint with `backend` on `device` (cpu, gpu, cuda[:N], metal; None: the
    backend's default: its GPU where it has one), holding at most `kv_capacity` tokens per
    sequence (None: the model's maximum, as memory allows)."""
    from ferrum_mac.llm import kv_capacity_from_env
    from ferrum_mac.weights import load_checkpoint

    kv_capacity = kv_capacity_from_env() if kv_capacity is None else kv_capacity  # until the callers pass it

    chosen, device = choose(backend), check_device(device)
    if chosen == "mlx":
        from ferrum_mac.backends.mlx.memory import use_device
        from ferrum_mac.backends.mlx.runtime import MlxLLM

        use_device(device)
        return MlxLLM(load_checkpoint(path), dtype=dtype, kv_capacity=kv_capacity)
    from ferrum_mac.backends.torch.memory import resolve_device
    from ferrum_mac.backends.torch.runtime import TorchLLM

    return TorchLLM(load_checkpoint(path), dtype=dtype, device=resolve_device(device), kv_capacity=kv_capacity)
