#!/usr/bin/env python3
"""Checks and times the MoE decode kernels (`ferrum_mac/backends/mlx/cuda/moe.py`) on MLX's
CUDA build, on one Qwen3-30B-A3B MoE layer (128 experts, top 8, hidden 2048, expert width
768) with random weights quantized as mlx-community converts them (4-bit, group 64; also
8-bit): router, gate/up + SwiGLU and down + sum, each against MLX's own ops. Then the whole
block timed both ways over 48 chained layers (one eval, so per-kernel costs, not syncs,
dominate). Exits 1 on a mismatch. On the GPU machine, after `scripts/bench-gpu` installed MLX:

    PYTHONPATH=/tmp/site:. python3 scripts/check-mlx-cuda-moe.py
"""

import sys
import time

import mlx.core as mx
import mlx.nn as nn

from _mlx_check import close
from ferrum_mac.backends.mlx.cuda import moe as cuda_moe
from ferrum_mac.backends.mlx.models.qwen3_moe import ExpertLinear, Router, stack_outputs
from ferrum_mac.backends.mlx.ops import Ops

E, K, H, I = 128, 8, 2048, 768


def quantized(shape, bits, seed):
    mx.random.seed(seed)
    w = (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)
    q, scales, biases = mx.quantize(w, group_size=64, bits=bits)
    return ExpertLinear(q, scales, biases, 64, bits)


def mlx_route(logits, renormalise):
    return Router(lambda x: x, K, renormalise, Ops()).route(logits, logits.dtype)


def mlx_experts(x, gate_up, down, experts, weights):
    y = gate_up(x[:, None, None, :], experts, sorted_indices=False)
    a = nn.silu(y[..., :I]) * y[..., I:] * weights[..., None, None]
    return a[:, :, 0, :], down(a, experts, sorted_indices=False).sum(axis=1)[:, 0, :]


def check(bits) -> bool:
    gate_up = stack_outputs(quantized((E, I, H), bits, 1), quantized((E, I, H), bits, 2))
    down = quantized((E, H, I), bits, 3)
    ok = True
    for T in (1, 8, 16):
        x = mx.random.normal((T, H)).astype(mx.bfloat16)
        logits = mx.random.normal((T, E)).astype(mx.bfloat16)
        for renorm in (True, False):
            ids, w = cuda_moe.route(logits, K, renorm, mx.bfloat16)
            ref_ids, ref_w = mlx_route(logits, renorm)
            # bf16 logits tie often: compare the chosen logits (and weights), not the ids
            chosen = mx.sort(mx.take_along_axis(logits, ids.astype(mx.int32), -1), axis=-1)
            ref_chosen = mx.sort(mx.take_along_axis(logits, ref_ids.astype(mx.int32), -1), axis=-1)
            same = mx.array_equal(chosen, ref_chosen).item()
            print(f"check router T={T:2d} renorm={renorm!s:5s} same top-k logits: {same}")
            ok &= same and close(
                f"router weights T={T} renorm={renorm}", mx.sort(w, axis=-1), mx.sort(ref_w, axis=-1), 1e-2
            )
        a = cuda_moe.gate_up_swiglu(x, gate_up, ids, w, I)
        y = cuda_moe.down_sum(a, down, ids, H)
        ref_a, ref_y = mlx_experts(x, gate_up, down, ids, w)
        ok &= close(f"{bits}-bit gate_up+swiglu T={T}", a, ref_a, 2e-2)
        ok &= close(f"{bits}-bit down+sum T={T}", y, ref_y, 2e-2)
    return ok


def block_time(T, bits, fused, layers=48, reps=20) -> float:
    gate = (mx.random.normal((E, H)) * 0.02).astype(mx.bfloat16)
    gate_up = stack_outputs(quantized((E, I, H), bits, 1), quantized((E, I, H), bits, 2))
    down = quantized((E, H, I), bits, 3)
    x0 = mx.random.normal((T, H)).astype(mx.bfloat16)
    mx.eval(gate, x0)

    def step(x):
        x = mx.fast.rms_norm(x, mx.ones((H,), mx.bfloat16), 1e-6)  # as the block's norm keeps the chain finite
        logits = x @ gate.T
        if fused:
            ids, w = cuda_moe.route(logits, K, True, x.dtype)
            return x + cuda_moe.down_sum(cuda_moe.gate_up_swiglu(x, gate_up, ids, w, I), down, ids, H)
        ids, w = mlx_route(logits, True)
        return x + mlx_experts(x, gate_up, down, ids, w)[1]

    def chain():
        x = x0
        for _ in range(layers):
            x = step(x)
        return x

    mx.eval(chain())
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(chain())
    return (time.perf_counter() - start) / reps / layers * 1e6


if __name__ == "__main__":
    print("device:", mx.default_device())
    passed = check(4) and check(8)
    print("\nus per MoE block (router + experts + residual), 48 chained layers, 4-bit:")
    print("tokens   cuda_moe   mlx ops")
    for T in (1, 8, 16):
        print(f"{T:6d}   {block_time(T, 4, True):8.1f}   {block_time(T, 4, False):7.1f}")
    sys.exit(0 if passed else 1)
