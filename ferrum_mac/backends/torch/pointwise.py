"""The elementwise work between a block's matmuls: q/k RMSNorm + RoPE, and SwiGLU; and the
switches that hand it to `triton_ops` on CUDA (and, for a few rows, the matmuls beside it to
`triton_gemv`).

Eagerly each is a handful of small kernels. In a CUDA decode step at batch 1 the matmuls
take microseconds, so those launches are a real share of the step. Inside a decode step on
CUDA (`decode_step`), where triton imports, SwiGLU is one `triton_ops` kernel (and the q/k
norm and RoPE one more, fused with the KV write: see `DecodePlan`); FERRUM_TORCH_TRITON=0
keeps torch, for A/B timing. For a few rows the matmul beside each joins it in one Triton
kernel (`gemv_runs`: gate_up with SwiGLU; qkv with the block's norm, q/k norm, RoPE and KV
write), each kernel on or off by name in FERRUM_TORCH_GEMV.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from ferrum_mac import settings

TRITON = settings.value("FERRUM_TORCH_TRITON")
# The fused GEMV kernels in use, by name: "norm_swiglu" (RMSNorm + gate_up + SwiGLU),
# "matmul_residual" (o_proj and down plus the residual), "norm_qkv_rope" (RMSNorm + qkv + q/k
# norm + RoPE + KV write: `triton_qkv`), "norm_matmul" (RMSNorm + qkv projection, where
# norm_qkv_rope is off; off unless named: it lost to F.rms_norm + cuBLAS, docs/BENCHMARKS.md,
# torch session 3).
GEMV = settings.value("FERRUM_TORCH_GEMV")
GEMV_MAX_ROWS = 4  # the GEMVs take up to 16 rows; past a few, cuBLAS reads a weight once as well


_IN_DECODE_STEP = False


@contextlib.contextmanager
def decode_step():
    """Marks a decode step's forward (`steps.DecodeStep`), the only place Triton kernels run:
    there they are captured once in a CUDA graph. Launched eagerly (prefill, unified steps)
    each Triton call costs tens of microseconds of Python, more than the torch op it replaces."""
    global _IN_DECODE_STEP
    outer, _IN_DECODE_STEP = _IN_DECODE_STEP, True
    try:
        yield
    finally:
        _IN_DECODE_STEP = outer


def triton_runs(x: torch.Tensor) -> bool:
    """Whether `triton_ops` does the work on `x`: in a decode step on CUDA, with triton
    installed, unless turned off."""
    return TRITON and _IN_DECODE_STEP and x.is_cuda and triton_imports()


def gemv_runs(kernel: str, x: torch.Tensor) -> bool:
    """Whether the Triton GEMV `kernel` (named as in GEMV) takes x `(rows, K)`: a few rows on CUDA."""
    return kernel in GEMV and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and triton_runs(x)


@functools.cache
def triton_imports() -> bool:
    try:  # imported only here, and only for CUDA tensors: the CPU path never pays for it
        from ferrum_mac.backends.torch import triton_ops
    except ImportError:
        return False
    return triton_ops.triton is not None


def norm_and_rope(qk: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float, interleaved: bool) -> torch.Tensor:  # fmt: skip
    """q and k heads `(T, heads, dim)`: RMSNorm with per-head weights (when given), then each
    pair of dims (i, partner(i)) turned by its row's angle: x * cos + partner(x) * signed sin.

    Pairs are (i, i + dim/2) in the Hugging Face layout, (2i, 2i+1) where the checkpoint
    permuted q/k rows for an interleaved rope (GGUF llama). Rounded as transformers rounds it.
    """
    if weight is not None:
        qk = F.rms_norm(qk, qk.shape[-1:], None, eps) * weight
    if interleaved:
        partner = qk.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    else:
        partner = qk.roll(qk.shape[-1] // 2, dims=-1)
    return qk * cos + partner * sin


def swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up from the fused projection's output (gate first), times `weights` (one per
    row) if given."""
    if triton_runs(gate_up) and one_per_row(weights, gate_up):
        from ferrum_mac.backends.torch import triton_ops

        return triton_ops.swiglu(gate_up, weights)
    return torch_swiglu(gate_up, weights)


def one_per_row(weights: torch.Tensor | None, gate_up: torch.Tensor) -> bool:
    """No weights, or one of gate_up's dtype for each row (the Triton kernel's only case)."""
    if weights is None:
        return True
    return weights.dtype == gate_up.dtype and weights.numel() * gate_up.shape[-1] == gate_up.numel()


def torch_swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if weights is None else out * weights
