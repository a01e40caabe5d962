"""The heads kernel's Python edge (`ferrum_mac/backends/mlx/cuda_heads.py`): where it runs, the
RoPE constants it is given, and the calls it refuses. The kernel itself runs only on MLX's
CUDA build: `scripts/check-mlx-cuda-heads.py` checks it there against MLX's ops, bit for bit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import mlx.core as mx
import pytest

from ferrum_mac.backends.mlx import cuda_heads
from ferrum_mac.backends.mlx.layers import Projections, Rope


def rope(scaling=None, traditional=False):
    config = SimpleNamespace(head_dim=64, rope_traditional=traditional, rope_theta=1e6, rope_scaling=scaling)
    return Rope(config)


def test_runs_on_cuda_only_for_heads_of_whole_warps(monkeypatch):
    assert not cuda_heads.runs(128)  # this machine: MLX's CPU build
    monkeypatch.setattr(cuda_heads, "on_cuda_gpu", lambda: True)
    assert cuda_heads.runs(64) and cuda_heads.runs(128) and cuda_heads.runs(256)
    assert not cuda_heads.runs(96)  # 48 threads a head: a warp's shuffle would read idle lanes
    monkeypatch.setattr(cuda_heads, "ENABLED", False)  # FERRUM_MLX_CUDA_HEADS=0
    assert not cuda_heads.runs(128)


def test_rope_constants_are_those_mlx_rope_uses():
    spec = cuda_heads.RopeSpec(rope(), 1e-6)
    eps, log2_base, scale = spec.consts.tolist()
    assert eps == pytest.approx(1e-6) and log2_base == pytest.approx(math.log2(1e6)) and scale == 1.0
    assert spec.freqs is None and not spec.traditional
    linear = cuda_heads.RopeSpec(rope({"rope_type": "linear", "factor": 4.0}, traditional=True), 1e-6)
    assert linear.consts.tolist()[2] == 0.25 and linear.traditional
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    with_freqs = cuda_heads.RopeSpec(rope(llama3), 1e-6)
    assert with_freqs.freqs.dtype == mx.float32 and with_freqs.freqs.shape == (32,)


def test_several_tokens_need_a_position_each():
    with pytest.raises(ValueError, match="a position each"):
        cuda_heads.heads(mx.zeros((1, 2, 8 * 64)), mx.array(5), 4, 2, 64, None, None, cuda_heads.RopeSpec(rope(), 1e-6))


def test_attention_takes_the_heads_kernel_where_it_runs(zoo, monkeypatch):
    """With the kernel standing in as MLX's ops, a model routed through it decodes (one
    sequence, a batch) exactly as the plain path: its arguments and layouts are the right ones."""
    import numpy as np

    import ferrum_mac
    from ferrum_mac.llm import DecodeItem
    from helpers import ferrum_greedy, random_tokens

    def batch_steps(tag: str) -> list:
        for name, tokens in prompts.items():
            model.prefill(f"{tag}-{name}", tokens)
        steps = [
            np.array(model.decode_batch([DecodeItem(f"{tag}-{n}", 3 + i, len(p) + i) for n, p in prompts.items()]))
            for i in range(2)
        ]
        for name in prompts:
            model.release(f"{tag}-{name}")
        return steps

    model = ferrum_mac.open_model(zoo.path("qwen3"), backend="mlx", dtype="float32")
    layers = model.model.layers
    for block in layers:  # q/k/v as one matmul, as on a GPU (the kernel reads its output)
        block.attn.qkv = Projections(block.attn.qkv.parts, fuse=True)
        block.compiled_pre = mx.compile(block.pre)
    prompt = random_tokens(7, seed=5)
    prompts = {"a": random_tokens(5, seed=1), "b": random_tokens(9, seed=2)}
    want_tokens = ferrum_greedy(model, "plain", prompt, 6)
    want_batch = batch_steps("plain")

    calls = []
    eps = layers[0].attn.eps

    def fake_heads(qkv, positions, *rest):
        calls.append(positions.ndim)
        heads, kv_heads, dim, q_norm, k_norm, _ = rest
        return cuda_heads.reference(qkv, positions, heads, kv_heads, dim, q_norm, k_norm, layers[0].attn.rope, eps)

    monkeypatch.setattr(cuda_heads, "heads", fake_heads)
    for block in layers:
        block.attn.fused_heads = True
        block.attn.rope_spec = cuda_heads.RopeSpec(block.attn.rope, block.attn.eps)
        block.compiled_pre = mx.compile(block.pre)
    assert ferrum_greedy(model, "fused", prompt, 6) == want_tokens
    for got, want in zip(batch_steps("fused"), want_batch):
        np.testing.assert_array_equal(got, want)
    assert 0 in calls and 1 in calls  # one token at its offset; a batch's rows at their own positions
    calls.clear()
    layers[0].attn.warm_up_kernels(mx.float32)
    layers[0].attn.warm_up_kernels(mx.float32)
    assert calls == [1]  # the batch's build, once
