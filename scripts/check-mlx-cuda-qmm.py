#!/usr/bin/env python3
"""Checks and times the one-row and few-row quantized matmuls (`ferrum_mac/backends/mlx/cuda/qmatmul.py`)
against MLX's `quantized_matmul` on MLX's CUDA build: the projections of Qwen3-30B-A3B and
Qwen3-8B as mlx-community quantizes them (4-bit, group 64; the MoE router's gate 8-bit), at
1 to 8 rows, random weights. Exits 1 on a mismatch. On the GPU machine, after
`scripts/bench-gpu` installed MLX:

    PYTHONPATH=/tmp/site:. python3 scripts/check-mlx-cuda-qmm.py
"""

import sys

import mlx.core as mx

from _mlx_check import chained_us, close
from ferrum_mac.backends.mlx.cuda import qmatmul as cuda_qmatmul

SHAPES = [  # (what, N, K, bits)
    ("30b-a3b qkv", 5120, 2048, 4),
    ("30b-a3b o_proj", 2048, 4096, 4),
    ("30b-a3b router gate", 128, 2048, 8),
    ("30b-a3b lm_head", 151936, 2048, 4),
    ("8b qkv", 6144, 4096, 4),
    ("8b gate_up", 24576, 4096, 4),
    ("8b down", 4096, 12288, 4),
]


L2_BYTES = 50e6  # an H100's: timed calls cycle through enough weight copies to pass it


def check_swiglu() -> bool:
    """The SwiGLU after Qwen3-8B's gate_up against MLX's ops (`cuda_qmatmul.reference`: the
    same product, then MLX's SwiGLU); and the time of the fused call against its parts."""
    ok, K, N = True, 4096, 24576
    print(f"\n{'gate_up + swiglu':22s} {'rows':>4s} {'ours us':>8s} {'mlx us':>8s}  equal bit for bit")
    w, scales, biases = mx.quantize((mx.random.normal((N, K)) * 0.02).astype(mx.bfloat16), group_size=64, bits=4)
    copies = [(w, scales, biases)] + [tuple(a + 0 for a in (w, scales, biases)) for _ in range(7)]
    mx.eval(copies)
    for rows in (1, 2, 4, 8):
        x = (mx.random.normal((1, rows, K)) * 3).astype(mx.bfloat16)
        ours = lambda x, c: cuda_qmatmul.quantized_matmul(x, *c, 64, 4, swiglu=True)  # noqa: E731
        theirs = lambda x, c: cuda_qmatmul.reference(x, *c, 64, 4, swiglu=True)  # noqa: E731
        got, want = ours(x, copies[0]), theirs(x, copies[0])
        ok &= got.shape == want.shape and close(f"gate_up + swiglu rows={rows}", got, want, 2e-2)
        same = (got == want).astype(mx.float32).mean().item()
        us, ref_us = chained_us(ours, x, copies), chained_us(theirs, x, copies)
        print(f"{'gate_up + swiglu':22s} {rows:4d} {us:8.1f} {ref_us:8.1f}  {same:.1%}")
    return ok


def launch(rows: int, N: int, K: int, bits: int) -> str:
    """Which kernel took the call, and its launch shape."""
    if rows == 1 and cuda_qmatmul.one_row_fits(K, 64, bits, mx.bfloat16):
        return f"one-row {cuda_qmatmul.one_row_launch(N)}"
    return f"few-row {cuda_qmatmul.launch_shape(N)}"


def main() -> int:
    print("device:", mx.default_device())
    ok = True
    print(
        f"{'shape':22s} {'rows':>4s} {'ours us':>8s} {'mlx us':>8s} {'ours GB/s':>9s}  (launch: warps, rows per warp)"
    )
    for what, N, K, bits in SHAPES:
        mx.random.seed(0)
        w, scales, biases = mx.quantize((mx.random.normal((N, K)) * 0.02).astype(mx.bfloat16), group_size=64, bits=bits)
        nbytes = w.nbytes + scales.nbytes + biases.nbytes
        copies = [(w, scales, biases)] + [
            tuple(a + 0 for a in (w, scales, biases)) for _ in range(min(47, int(2 * L2_BYTES / nbytes)))
        ]
        mx.eval(copies)
        for rows in (1, 2, 4, 8):
            x = mx.random.normal((rows, K)).astype(mx.bfloat16)
            ours = lambda x, c: cuda_qmatmul.quantized_matmul(x, *c, 64, bits)  # noqa: E731
            theirs = lambda x, c: mx.quantized_matmul(x, *c, transpose=True, group_size=64, bits=bits)  # noqa: E731
            ok &= close(f"{what} rows={rows}", ours(x, copies[0]), theirs(x, copies[0]), 1e-2)
            us, ref_us = chained_us(ours, x, copies), chained_us(theirs, x, copies)
            print(f"{what:22s} {rows:4d} {us:8.1f} {ref_us:8.1f} {nbytes / us / 1e3:9.0f}  {launch(rows, N, K, bits)}")
        del copies
    ok &= check_swiglu()
    if mx.default_device() == mx.gpu:
        x = mx.random.normal((8, 2048)).astype(mx.float32)
        w, scales, biases = mx.quantize(mx.random.normal((256, 2048)), group_size=64, bits=4)
        ok &= close("float32 rows=8", cuda_qmatmul.quantized_matmul(x, w, scales, biases, 64, 4),
                    mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64, bits=4), 1e-4)  # fmt: skip
    print("\nall match" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
