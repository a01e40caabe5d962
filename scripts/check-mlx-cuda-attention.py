#!/usr/bin/env python3
"""Checks and times the CUDA decode-attention kernel (`ferrum_mac/backends/mlx/cuda_attention.py`)
on MLX's CUDA build: its output against the fused attention over each sequence's own keys,
for several head layouts, dtypes and batch sizes; then its time against the masked path it
replaces (keys gathered out of the pool, fused attention under a length mask). Exits 1 on a
mismatch. Run it on the GPU machine after `scripts/bench-gpu` installed MLX CUDA:

    PYTHONPATH=/tmp/site:. python3 scripts/check-mlx-cuda-attention.py
"""

import sys
import time

import mlx.core as mx

from ferrum_mac.backends.mlx.cuda_attention import decode_attention

LAYOUTS = {"qwen3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "qwen3-30b-a3b": (32, 4, 128), "smollm2": (9, 3, 64)}
TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def pool_and_batch(layout, dtype, batch, tokens, seed):
    heads, kv_heads, dim = layout
    mx.random.seed(seed)
    slots = 2 * batch
    keys = mx.random.normal((slots, kv_heads, tokens, dim)).astype(dtype)
    values = mx.random.normal((slots, kv_heads, tokens, dim)).astype(dtype)
    q = mx.random.normal((batch, heads, dim)).astype(dtype)
    chosen = mx.random.permutation(slots)[:batch].astype(mx.int32)
    positions = mx.random.randint(0, tokens, (batch,)).astype(mx.int32)
    mx.eval(keys, values, q, chosen, positions)
    return q, keys, values, chosen, positions


def reference(q, keys, values, slots, positions, scale):
    rows = []
    for b, (s, p) in enumerate(zip(slots.tolist(), positions.tolist())):
        k, v = keys[s : s + 1, :, : p + 1], values[s : s + 1, :, : p + 1]
        rows.append(mx.fast.scaled_dot_product_attention(q[b : b + 1, :, None, :], k, v, scale=scale)[0, :, 0])
    return mx.stack(rows)


def check() -> bool:
    ok = True
    for name, layout in LAYOUTS.items():
        scale = layout[2] ** -0.5
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            for batch in (1, 3, 16):
                args = pool_and_batch(layout, dtype, batch, 300, seed=batch)
                got = decode_attention(*args, scale).astype(mx.float32)  # split over blocks where batch is small
                whole = decode_attention(*args, scale, longest=1).astype(mx.float32)  # one block a sequence
                want = reference(*args, scale).astype(mx.float32)
                err = max(mx.abs(got - want).max().item(), mx.abs(whole - want).max().item())
                good = err <= TOLERANCE[dtype]
                ok &= good
                print(
                    f"check {name:14s} {str(dtype):14s} batch {batch:2d}: max err {err:.2e} {'ok' if good else 'MISMATCH'}"
                )
    return ok


def timed(fn, reps=200):
    for _ in range(5):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - start) / reps * 1e6


def masked(q, keys, values, slots, positions, scale):
    width = positions.max().item() + 1  # as the Plan knows it on the host
    mask = (mx.arange(width)[None, :] <= positions[:, None])[:, None, None, :]
    k, v = keys[slots, :, :width], values[slots, :, :width]
    return mx.fast.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=scale, mask=mask)


def timings() -> None:
    print("\nus per call (bf16, 1024-token pool, positions 512..639)    kernel   masked+gather   one seq unmasked")
    for name in ("qwen3-8b", "qwen3-30b-a3b", "qwen3-0.6b"):
        layout = LAYOUTS[name]
        scale = layout[2] ** -0.5
        for batch in (1, 4, 8, 16):
            q, keys, values, slots, _ = pool_and_batch(layout, mx.bfloat16, batch, 1024, seed=7)
            positions = (512 + mx.arange(batch) * (128 // batch)).astype(mx.int32)
            mx.eval(positions)
            kernel = timed(lambda: decode_attention(q, keys, values, slots, positions, scale))
            old = timed(lambda: masked(q, keys, values, slots, positions, scale))
            one = timed(
                lambda: mx.fast.scaled_dot_product_attention(
                    q[:1, :, None, :], keys[:1, :, :640], values[:1, :, :640], scale=scale
                )
            )
            print(
                f"{name:14s} batch {batch:2d}                                     {kernel:7.1f}   {old:13.1f}   {one:16.1f}"
            )


if __name__ == "__main__":
    print("device:", mx.default_device())
    passed = check()
    timings()
    sys.exit(0 if passed else 1)
