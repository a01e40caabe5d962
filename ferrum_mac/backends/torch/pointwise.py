"""The elementwise work between a block's matmuls, in torch: q/k RMSNorm + RoPE, and SwiGLU.

Eagerly each is a handful of small kernels. In a CUDA decode step at batch 1 the matmuls
take microseconds, so those launches are a real share of the step: there `ops.TritonOps`
runs them as `triton_ops` kernels instead (and, for a few rows, with the matmul beside
each in one Triton GEMV); these stay the reference they are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def norm_and_rope(
    qk: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float, interleaved: bool
) -> torch.Tensor:
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


def one_per_row(weights: torch.Tensor | None, gate_up: torch.Tensor) -> bool:
    """No weights, or one of gate_up's dtype for each row (the Triton kernel's only case)."""
    if weights is None:
        return True
    return weights.dtype == gate_up.dtype and weights.numel() * gate_up.shape[-1] == gate_up.numel()


def torch_swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of the fused projection's output (gate first), times `weights` if given."""
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if weights is None else out * weights
