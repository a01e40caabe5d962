"""Backends implement `DecoderOnlyLLM`; this module picks one and opens a checkpoint with it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ferrum_mac.backends.options import DEFAULTS, BackendOptions
from ferrum_mac.errors import FerrumError, UnsupportedError
from ferrum_mac.llm import DecoderOnlyLLM

BACKENDS = ("mlx", "torch")
DEVICES = ("cpu", "gpu", "cuda", "metal")  # cuda:N names one of several GPUs (torch)


def available(backend: str) -> bool:
    module = {"mlx": "mlx.core", "torch": "torch"}[backend]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def choose(backend: str, cpu_blas: str = "openblas") -> str:
    """The backend to use for `backend` (auto, mlx, torch); for MLX, with its CPU BLAS routed
    (`route_cpu_blas`, `cpu_blas` its mode: FERRUM_CPU_BLAS) before anything imports it."""
    chosen = automatic() if backend == "auto" else checked(backend)
    if chosen == "mlx":
        route_cpu_blas(cpu_blas)
    return chosen


def checked(backend: str) -> str:
    if backend not in BACKENDS:
        raise UnsupportedError(f"unknown backend {backend!r}; choose one of: auto, {', '.join(BACKENDS)}")
    if not available(backend):
        install = {"mlx": "pip install mlx", "torch": "pip install 'ferrum-mac[torch]' (or a torch build for your GPU)"}
        raise UnsupportedError(f"the {backend} backend is not installed; {install[backend]}")
    return backend


def automatic() -> str:
    """torch where it is installed and an NVIDIA GPU is present; else MLX (Metal on a Mac; on
    a Linux CPU its matmuls go to OpenBLAS, see mlx/cpu/blas.py); else torch on the CPU.

    Decided without importing either library (torch's import alone takes seconds), so that
    `ferrum run` starts fast."""
    if available("torch") and nvidia_gpu_present():
        return "torch"
    for candidate in BACKENDS:
        if available(candidate):
            return candidate
    raise UnsupportedError("no backend is installed; install ferrum-mac with MLX (or 'ferrum-mac[torch]' for torch)")


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
    path: Path,
    backend: str = "auto",
    dtype: str | None = None,
    device: str | None = None,
    kv_capacity: int | None = None,
    quant: str | None = None,
    options: BackendOptions = DEFAULTS,
) -> DecoderOnlyLLM:
    """Open a checkpoint with `backend` on `device` (cpu, gpu, cuda[:N], metal; None: the
    backend's default: its GPU where it has one), holding at most `kv_capacity` tokens per
    sequence (None: the model's maximum, as memory allows); `quant` ("4bit", "8bit", torch
    only) quantizes a dense checkpoint's linear layers as they load. `options`: the backends'
    switches (`compose.backend_options` makes them from the settings)."""
    chosen, device = choose(backend), check_device(device)
    if chosen == "mlx" and quant is not None:
        raise FerrumError(
            f"quantizing at load (quant {quant!r}) runs on the torch backend; "
            "on MLX open a quantized checkpoint (mlx_lm.convert -q makes one)"
        )
    if chosen == "mlx":
        from ferrum_mac.backends.mlx.memory import use_device
        from ferrum_mac.backends.mlx.runtime import MlxLLM
        from ferrum_mac.weights import load_checkpoint

        use_device(device)
        return MlxLLM(load_checkpoint(path), dtype=dtype, kv_capacity=kv_capacity, options=options)
    from ferrum_mac.backends.torch.memory import resolve_device
    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.backends.torch.weights import load_onto

    place = resolve_device(device)
    return TorchLLM(
        load_onto(path, place), dtype=dtype, device=place, kv_capacity=kv_capacity, quant=quant, options=options
    )


def describe_device(backend: str, model: DecoderOnlyLLM) -> str:
    """Where `model` (opened with `backend`, as `choose` names it) runs, for people: 'mlx · cpu',
    'torch · cuda (NVIDIA H100 80GB HBM3)'."""
    if backend == "mlx":
        from ferrum_mac.backends.mlx.memory import device_name

        return f"mlx · {device_name()}"
    from ferrum_mac.backends.torch.memory import device_name

    return f"torch · {device_name(model.device)}"


def route_cpu_blas(mode: str = "openblas") -> None:
    """Route the float32 matmuls of MLX's Linux CPU build to numpy's OpenBLAS (see
    backends/mlx/cpu/blas.py). It works only before the process first imports MLX, so `choose`
    calls it before handing out MLX (the composition root, `ferrum bench` and `open_path` all
    choose first), and tests/conftest.py before the tests import MLX; once MLX is loaded it
    does nothing. `mode`: "openblas", or FERRUM_CPU_BLAS's other values (leave MLX's BLAS)."""
    if sys.platform.startswith("linux"):
        from ferrum_mac.backends.mlx.cpu.blas import activate

        activate(mode)
