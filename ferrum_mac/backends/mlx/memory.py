"""Device memory facts for MLX on Metal, CUDA or the CPU. Metal-only calls stay behind checks."""

from __future__ import annotations

import os

import mlx.core as mx

from ferrum_mac.errors import UnsupportedError


def _metal() -> bool:
    return mx.metal.is_available()


def _cuda() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def on_cuda_gpu() -> bool:
    """MLX's CUDA build with the GPU as the default device: where our CUDA kernels run."""
    return _cuda() and mx.default_device() == mx.gpu


def use_device(device: str | None) -> None:
    """Make `device` MLX's default for this process: cpu, or the GPU (gpu, or metal / cuda as
    this build of MLX has it). None leaves MLX's own default (its GPU where it has one)."""
    if device is None:
        return
    if device == "cpu":
        mx.set_default_device(mx.cpu)
        return
    has = {"gpu": _metal() or _cuda(), "metal": _metal(), "cuda": _cuda()}[device.partition(":")[0]]
    if not has:
        raise UnsupportedError(
            f"MLX has no {device} device on this machine (it runs on {device_name()}); use --device cpu or leave --device out"
        )
    mx.set_default_device(mx.gpu)


def device_name() -> str:
    if on_cpu():
        return "cpu"
    if _metal():
        return f"metal ({mx.device_info().get('device_name', 'Apple GPU')})"
    if _cuda():
        return f"cuda ({mx.device_info().get('device_name', 'NVIDIA GPU')})"
    return "cpu"


def total_memory_bytes() -> int:
    info = mx.device_info()
    if _metal():
        return int(info.get("max_recommended_working_set_size") or info.get("memory_size", 0))
    if _cuda() and info.get("total_memory"):
        return int(info["total_memory"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_memory_bytes() -> int:
    """Memory a KV cache may still take: what the device offers less what MLX holds."""
    if _metal() or _cuda():
        return max(0, total_memory_bytes() - mx.get_active_memory())
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def wire_model_memory(model_bytes: int) -> None:
    """Keep the weights resident on Metal (macOS 15+) so decode never waits on paging."""
    if _metal():
        limit = int(mx.device_info().get("max_recommended_working_set_size", 0))
        if limit and model_bytes < limit:
            mx.metal.set_wired_limit(limit)
