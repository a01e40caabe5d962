"""The backends' switches as one frozen object, built from the settings by the composition root.

A backend reads these from the dispatch object it chose at load (`mlx/ops.py`, `torch/ops.py`),
never from the environment: a test that wants another value builds options with it. The
defaults are those of `settings.py`'s table (a test checks that they agree); most are A/B
switches a benchmark times a fast path with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

TORCH_GEMVS = frozenset({"norm_swiglu", "matmul_residual", "norm_qkv_rope"})


@dataclass(frozen=True)
class BackendOptions:
    # MLX
    compile_max_tokens: int = 16  # FERRUM_MLX_COMPILE_MAX_TOKENS
    cuda_attention: bool = True  # FERRUM_MLX_CUDA_ATTENTION
    numpy_attention: bool = True  # FERRUM_MLX_NUMPY_ATTENTION
    cuda_moe: bool = True  # FERRUM_MLX_CUDA_MOE
    cuda_heads: bool = True  # FERRUM_MLX_CUDA_HEADS
    cuda_qmm: bool = True  # FERRUM_MLX_CUDA_QMM
    dequantize_on_cpu: bool = True  # FERRUM_DEQUANTIZE_ON_CPU
    dense_cache: bool = True  # FERRUM_DENSE_CACHE
    # the prefix cache (both backends)
    prefix_cache_mb: int = 4096  # FERRUM_PREFIX_CACHE_MB
    prefix_disk_mb: int = 4096  # FERRUM_PREFIX_DISK_MB
    prefix_dir: Path | None = None  # the disk tier's folder (settings.prefix_cache_dir()); None: no disk tier
    # torch
    torch_triton: bool = True  # FERRUM_TORCH_TRITON
    torch_gemv: frozenset[str] = field(default=TORCH_GEMVS)  # FERRUM_TORCH_GEMV
    torch_dp4a: bool = True  # FERRUM_TORCH_DP4A
    torch_pdl: bool = True  # FERRUM_TORCH_PDL
    torch_moe_route: str = ""  # FERRUM_TORCH_MOE_ROUTE
    torch_cuda_graphs: bool = True  # FERRUM_TORCH_CUDA_GRAPHS


# Which setting each option is made from (`compose.backend_options`).
SETTING_OF = {
    "compile_max_tokens": "FERRUM_MLX_COMPILE_MAX_TOKENS",
    "cuda_attention": "FERRUM_MLX_CUDA_ATTENTION",
    "numpy_attention": "FERRUM_MLX_NUMPY_ATTENTION",
    "cuda_moe": "FERRUM_MLX_CUDA_MOE",
    "cuda_heads": "FERRUM_MLX_CUDA_HEADS",
    "cuda_qmm": "FERRUM_MLX_CUDA_QMM",
    "dequantize_on_cpu": "FERRUM_DEQUANTIZE_ON_CPU",
    "dense_cache": "FERRUM_DENSE_CACHE",
    "prefix_cache_mb": "FERRUM_PREFIX_CACHE_MB",
    "prefix_disk_mb": "FERRUM_PREFIX_DISK_MB",
    "torch_triton": "FERRUM_TORCH_TRITON",
    "torch_gemv": "FERRUM_TORCH_GEMV",
    "torch_dp4a": "FERRUM_TORCH_DP4A",
    "torch_pdl": "FERRUM_TORCH_PDL",
    "torch_moe_route": "FERRUM_TORCH_MOE_ROUTE",
    "torch_cuda_graphs": "FERRUM_TORCH_CUDA_GRAPHS",
}

DEFAULTS = BackendOptions()
