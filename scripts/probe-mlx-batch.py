#!/usr/bin/env python3
"""Where an MLX batched decode step's time goes: each piece of a Qwen3-8B-shaped layer timed
alone at batch 1, 4 and 16 (bf16), on whatever device MLX has (run it on the GPU machine).

    python3 scripts/probe-mlx-batch.py
"""

import time

import mlx.core as mx


def timed(fn, *args, reps=50):
    for _ in range(3):
        mx.eval(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn(*args))
    return (time.perf_counter() - start) / reps * 1e6


def written_out(q, keys, values, bias, scale):
    """The attention as plain ops, GQA folded into the query length (no repeated keys)."""
    B, heads, _, dim = q.shape
    grouped = (q * scale).reshape(B, keys.shape[1], -1, dim)
    weights = mx.softmax(grouped @ keys.swapaxes(-1, -2) + bias, axis=-1, precise=True)
    return weights @ values


def main():
    print("device:", mx.default_device())
    hidden, heads, kv_heads, dim, inter, width, slots = 4096, 32, 8, 128, 12288, 640, 16
    w_up = mx.random.normal((2 * inter, hidden)).astype(mx.bfloat16)
    w_down = mx.random.normal((hidden, inter)).astype(mx.bfloat16)
    pool = mx.random.normal((slots, kv_heads, 1024, dim)).astype(mx.bfloat16)
    mx.eval(w_up, w_down, pool)
    for B in (1, 4, 16):
        x = mx.random.normal((1, B, hidden)).astype(mx.bfloat16)
        h = mx.random.normal((1, B, inter)).astype(mx.bfloat16)
        q = mx.random.normal((B, heads, 1, dim)).astype(mx.bfloat16)
        idx = mx.arange(B)
        mask = (mx.arange(width)[None, :] <= mx.array([width - 1 - i for i in range(B)])[:, None])[:, None, None, :]
        full_mask = (mx.arange(1024)[None, :] <= mx.array([width - 1 - i for i in range(B)])[:, None])[:, None, None, :]
        bias = mx.where(mask, 0.0, -mx.inf)
        mx.eval(x, h, q, idx, mask, full_mask, bias)
        rows = {
            "gate_up matmul": timed(lambda: x @ w_up.T),
            "down matmul": timed(lambda: h @ w_down.T),
            "gather keys[slots,:,:w]": timed(lambda: pool[idx, :, :width, :]),
            "slice keys[:B] (view)": timed(lambda: pool[:B] + 0),
            "sdpa gathered + bool mask": timed(
                lambda: mx.fast.scaled_dot_product_attention(
                    q, pool[idx, :, :width, :], pool[idx, :, :width, :], scale=0.08, mask=mask
                )
            ),
            "sdpa slice[:B] full width + mask": timed(
                lambda: mx.fast.scaled_dot_product_attention(q, pool[:B], pool[:B], scale=0.08, mask=full_mask)
            ),
            "sdpa slice[:B, :, :w] no mask": timed(
                lambda: mx.fast.scaled_dot_product_attention(q, pool[:B, :, :width], pool[:B, :, :width], scale=0.08)
            ),
            "written out (scores, bias, softmax)": timed(
                lambda: written_out(q, pool[idx, :, :width, :], pool[idx, :, :width, :], bias, 0.08)
            ),
        }
        for name, us in rows.items():
            print(f"B={B:2d} {name:36s} {us:8.1f} us")


if __name__ == "__main__":
    main()
