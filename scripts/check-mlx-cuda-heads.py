#!/usr/bin/env python3
"""Checks the heads kernel (`ferrum_mac/backends/mlx/cuda/heads.py`) against MLX's own ops
on MLX's CUDA build: q/k/v heads with q/k RMSNorm and RoPE (Qwen3-8B's and Qwen3-0.6B's
heads, a Llama-3 frequency schedule, the traditional rotation, no norms; one token at a
position, and four at their own). Prints each one's relative error and the share of values
equal bit for bit; exits 1 on a mismatch. On the GPU machine, after `scripts/bench-gpu`
installed MLX:

    PYTHONPATH=/tmp/site:. python3 scripts/check-mlx-cuda-heads.py
"""

import sys
from types import SimpleNamespace

import mlx.core as mx

from _mlx_check import close
from ferrum_mac.backends.mlx.cuda import heads as cuda_heads
from ferrum_mac.backends.mlx.layers import Rope

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip
CASES = [  # (what, heads, kv_heads, head_dim, q/k norms, traditional, rope_scaling)
    ("qwen3-8b", 32, 8, 128, True, False, None),
    ("qwen3-0.6b", 16, 8, 128, True, False, None),
    ("llama-3 freqs, no norms", 32, 8, 128, False, False, LLAMA3),
    ("traditional, dim 64", 8, 2, 64, True, True, None),
]


def exact_share(got, want) -> float:
    return (got == want).astype(mx.float32).mean().item()


def check_heads() -> bool:
    ok, eps = True, 1e-6
    for what, heads, kv_heads, dim, norms, traditional, scaling in CASES:
        config = SimpleNamespace(head_dim=dim, rope_traditional=traditional, rope_theta=1e6, rope_scaling=scaling)
        rope = Rope(config)
        spec = cuda_heads.RopeSpec(rope, eps)
        q_norm = (1 + 0.1 * mx.random.normal((dim,))).astype(mx.bfloat16) if norms else None
        k_norm = (1 + 0.1 * mx.random.normal((dim,))).astype(mx.bfloat16) if norms else None
        for positions in (mx.array(517), mx.array([3, 90, 4000, 31000], mx.int32)):
            T = 1 if positions.ndim == 0 else positions.shape[0]
            qkv = mx.random.normal((1, T, (heads + 2 * kv_heads) * dim)).astype(mx.bfloat16)
            got = cuda_heads.heads(qkv, positions, heads, kv_heads, dim, q_norm, k_norm, spec)
            want = cuda_heads.reference(qkv, positions, heads, kv_heads, dim, q_norm, k_norm, rope, eps)
            for name, g, w in zip("qkv", got, want):
                label = f"heads {what}, {T} token(s): {name}"
                ok &= g.shape == w.shape and close(label, g, w, 1e-2)
                print(f"      {'':40s} shape {g.shape}, equal bit for bit: {exact_share(g, w):.1%}")
    return ok


def main() -> int:
    print("device:", mx.default_device())
    mx.random.seed(0)
    ok = check_heads()
    print("\nall match" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
