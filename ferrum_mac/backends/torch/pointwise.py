"""The elementwise work between a block's matmuls: q/k RMSNorm + RoPE, and SwiGLU.

Eagerly each is a handful of small kernels. In a CUDA decode step at batch 1 the matmuls
take microseconds, so those launches are a real share of the step. FERRUM_TORCH_COMPILE=1
turns each function into one fused kernel with torch.compile (shapes dynamic: compiled
once for every token count). Off by default: it is an A/B knob until measured on the GPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

COMPILE = os.environ.get("FERRUM_TORCH_COMPILE", "0") == "1"


def maybe_compiled(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True) if COMPILE else fn


@maybe_compiled
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


@maybe_compiled
def swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up from the fused projection's output (gate first), times `weights` if given."""
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if weights is None else out * weights
