"""Device facts for torch on CUDA or the CPU."""

from __future__ import annotations

import os

import torch

from ferrum_mac.errors import UnsupportedError


def default_device() -> torch.device:
    """CUDA when present, else the CPU (FERRUM_DEVICE, which names another, reaches
    `resolve_device` through the composition root)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device for a `--device` value (gpu means cuda); None: `default_device()`."""
    if device is None:
        return default_device()
    if isinstance(device, torch.device):
        return device
    if device == "metal":
        raise UnsupportedError("the torch backend runs on cuda or cpu; for Metal use --backend mlx")
    name = "cuda" if device == "gpu" else device
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UnsupportedError(
            f"torch sees no CUDA GPU on this machine, so it cannot use --device {device}; use --device cpu"
        )
    return torch.device(name)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def free_memory_bytes(device: torch.device) -> int:
    """Memory a KV cache may still take: what the device has free, plus what torch's
    allocator holds in reserve but no tensor uses."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
