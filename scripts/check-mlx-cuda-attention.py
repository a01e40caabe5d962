#!/usr/bin/env python3
"""Checks and times the CUDA decode-attention kernel (`ferrum_mac/backends/mlx/cuda/attention.py`)
on MLX's CUDA build: its output against the fused attention over each sequence's own keys
(read through a shuffled block table),
for several head layouts, dtypes and batch sizes; then its time against the masked path it
replaces (keys gathered through the tables, fused attention under a length mask). Exits 1 on a
mismatch. Run it on the GPU machine after `scripts/bench-gpu` installed MLX CUDA:

    PYTHONPATH=/tmp/site:. python3 scripts/check-mlx-cuda-attention.py
"""

import sys
import time

import mlx.core as mx

from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS
from ferrum_mac.backends.mlx.cuda.attention import decode_attention

LAYOUTS = {"qwen3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "qwen3-30b-a3b": (32, 4, 128), "smollm2": (9, 3, 64)}
TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def pool_and_batch(layout, dtype, batch, tokens, seed):
    """A pool of blocks in a random order, each sequence's block table a shuffled share of them."""
    heads, kv_heads, dim = layout
    mx.random.seed(seed)
    blocks = -(-tokens // BLOCK_TOKENS)
    rows = 2 * batch * blocks * BLOCK_TOKENS
    keys = mx.random.normal((1, kv_heads, rows, dim)).astype(dtype)
    values = mx.random.normal((1, kv_heads, rows, dim)).astype(dtype)
    q = mx.random.normal((batch, heads, dim)).astype(dtype)
    tables = mx.random.permutation(2 * batch * blocks)[: batch * blocks].reshape(batch, blocks).astype(mx.int32)
    positions = mx.random.randint(0, tokens, (batch,)).astype(mx.int32)
    mx.eval(keys, values, q, tables, positions)
    return q, keys, values, tables, positions


def table_rows(table, length):
    """The token rows of a sequence's first `length` keys."""
    return mx.array([table[t // BLOCK_TOKENS] * BLOCK_TOKENS + t % BLOCK_TOKENS for t in range(length)])


def reference(q, keys, values, tables, positions, scale):
    rows = []
    for b, (table, p) in enumerate(zip(tables.tolist(), positions.tolist())):
        at = table_rows(table, p + 1)
        k, v = keys[:, :, at], values[:, :, at]
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


def masked(q, keys, values, tables, positions, scale):
    width = tables.shape[1] * BLOCK_TOKENS  # as the Plan gathers it
    mask = (mx.arange(width)[None, :] <= positions[:, None])[:, None, None, :]
    at = mx.stack([table_rows(table, width) for table in tables.tolist()])
    index = (0, mx.arange(keys.shape[1])[None, :, None], at[:, None, :])
    k, v = keys[index], values[index]
    return mx.fast.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=scale, mask=mask)


def timings() -> None:
    print("\nus per call (bf16, 640-token tables, positions 512..639)    kernel   masked+gather   one seq unmasked")
    for name in ("qwen3-8b", "qwen3-30b-a3b", "qwen3-0.6b"):
        layout = LAYOUTS[name]
        scale = layout[2] ** -0.5
        for batch in (1, 4, 8, 16):
            q, keys, values, tables, _ = pool_and_batch(layout, mx.bfloat16, batch, 640, seed=7)
            positions = (512 + mx.arange(batch) * (128 // batch)).astype(mx.int32)
            mx.eval(positions)
            kernel = timed(lambda: decode_attention(q, keys, values, tables, positions, scale))
            old = timed(lambda: masked(q, keys, values, tables, positions, scale))
            one = timed(
                lambda: mx.fast.scaled_dot_product_attention(
                    q[:1, :, None, :], keys[:, :, :640], values[:, :, :640], scale=scale
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
