"""Causal attention by numpy for MLX's CPU build: a long segment's softmax is numpy's work there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

NUMPY_BLOCK_SCORES = 1 << 24  # scores numpy holds at once (64 MB of float32): queries go in blocks


def numpy_causal_attention(
    q: mx.array, keys: mx.array, values: mx.array, scale: float, block_scores: int = NUMPY_BLOCK_SCORES
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention(q, keys, values, mask="causal")` computed by numpy,
    for the CPU: q `(1, heads, n, dim)` over keys and values `(1, kv_heads, T, dim)`, the last
    n keys the queries' own (query i sees keys up to T - n + i). A long chunk's work is mostly
    its scores' softmax, and MLX's CPU `exp` takes some 20 ns a value where numpy's takes about
    1 (`scripts/probe-cpu-attention.py`); the products go to OpenBLAS. In float32, the queries of a KV head's
    group stacked into one product, a block of queries at a time (`block_scores` scores)."""
    _, heads, n, dim = q.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    queries = np.array(q.astype(mx.float32)).reshape(kv_heads, group, n, dim) * np.float32(scale)
    k_t = np.array(keys.astype(mx.float32))[0].transpose(0, 2, 1)  # (kv_heads, dim, T)
    v = np.array(values.astype(mx.float32))[0]
    out = np.empty((kv_heads, group, n, dim), np.float32)
    block = max(1, block_scores // (heads * total))
    for start in range(0, n, block):
        end = min(n, start + block)
        rows = queries[:, :, start:end].reshape(kv_heads, group * (end - start), dim)
        scores = np.matmul(rows, k_t).reshape(kv_heads, group, end - start, total)
        scores += causal_mask(start, end, total - n, total)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        weighted = np.matmul(scores.reshape(kv_heads, group * (end - start), total), v)
        out[:, :, start:end] = weighted.reshape(kv_heads, group, end - start, dim)
    return mx.array(out.reshape(1, heads, n, dim)).astype(q.dtype)


def causal_mask(start: int, end: int, first: int, total: int) -> np.ndarray:
    """`(end - start, total)`: 0 where query i (from `start`) sees key j (j <= first + i), else -inf."""
    hidden = np.arange(total)[None, :] > (first + np.arange(start, end))[:, None]
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0))
