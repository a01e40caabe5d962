"""The heads kernel's Python edge (`ferrum_mac/backends/mlx/cuda/heads.py`): where it runs, the
RoPE constants it is given, and the calls it refuses. The kernel itself runs only on MLX's
CUDA build: `scripts/check-mlx-cuda-heads.py` checks it there against MLX's ops, bit for bit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import mlx.core as mx
import pytest

from ferrum_mac.backends.mlx.cuda import heads as cuda_heads
from ferrum_mac.backends.mlx.cuda.ops import CudaOps
from ferrum_mac.backends.mlx.layers import Rope
from ferrum_mac.backends.mlx.ops import Ops
from ferrum_mac.backends.options import BackendOptions


def rope(scaling=None, traditional=False, dims=64):
    config = SimpleNamespace(
        head_dim=64,
        rope_dims=dims,
        rope_traditional=traditional,
        rope_theta=1e6,
        rope_scaling=scaling,
        max_position_embeddings=4096,
    )
    return Rope(config)


def test_runs_for_heads_of_whole_warps():
    assert cuda_heads.runs(64) and cuda_heads.runs(128) and cuda_heads.runs(256)
    assert not cuda_heads.runs(96)  # 48 threads a head: a warp's shuffle would read idle lanes


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


def test_the_kernel_leaves_ropes_it_does_not_compute():
    """It turns every dim of a head, unscaled: a partial rope (Phi-4-mini), LongRoPE's scaled
    dims and a layer without RoPE (SmolLM3) keep MLX's ops."""
    from ferrum_mac.backends.mlx.layers import NoRope

    ops = CudaOps()
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 24,
        "long_factor": [2.0] * 24,
        "original_max_position_embeddings": 1024,
        "factor": 4.0,
    }
    assert ops.heads_kernel_takes(SimpleNamespace(head_dim=64, rope=rope()))
    for other in (rope(dims=48), rope(longrope, dims=48), NoRope()):
        assert not ops.heads_kernel_takes(SimpleNamespace(head_dim=64, rope=other))


def test_several_tokens_need_a_position_each():
    with pytest.raises(ValueError, match="a position each"):
        cuda_heads.heads(mx.zeros((1, 2, 8 * 64)), mx.array(5), 4, 2, 64, None, None, cuda_heads.RopeSpec(rope(), 1e-6))


def test_attention_takes_the_heads_kernel_where_it_runs(zoo):
    """With the kernel standing in as MLX's ops, a model routed through it decodes (one
    sequence, a batch) exactly as the plain path: its arguments and layouts are the right ones.
    FERRUM_MLX_CUDA_HEADS=0 keeps MLX's ops."""
    import numpy as np

    from ferrum_mac.llm import DecodeItem
    from helpers import ferrum_greedy, open_mlx, random_tokens

    calls = []

    class HeadsOnTheCpu(CudaOps):
        """CUDA's projection route, MLX's attention; the kernel stands in as MLX's ops."""

        def heads(self, attn, qkv, positions, spec):
            calls.append(positions.ndim)
            args = (attn.heads, attn.kv_heads, attn.head_dim, attn.q_norm, attn.k_norm, attn.rope, attn.eps)
            return cuda_heads.reference(qkv, positions, *args)

        def attend_segment(self, attn, q, k, v, seg):
            return attn.attend_segment(q, k, v, seg)

        def heads_kernel_takes(self, attn) -> bool:
            return self.options.cuda_heads  # (the tiny model's heads are smaller than the kernel's)

    def batch_steps(model, tag: str) -> list:
        for name, tokens in prompts.items():
            model.prefill(f"{tag}-{name}", tokens)
        steps = [
            np.array(model.decode_batch([DecodeItem(f"{tag}-{n}", 3 + i, len(p) + i) for n, p in prompts.items()]))
            for i in range(2)
        ]
        for name in prompts:
            model.release(f"{tag}-{name}")
        return steps

    prompt = random_tokens(7, seed=5)
    prompts = {"a": random_tokens(5, seed=1), "b": random_tokens(9, seed=2)}
    plain = open_mlx(zoo.path("qwen3"), Ops())  # q/k/v as one matmul, as on a GPU (the kernel reads its output)
    want_tokens = ferrum_greedy(plain, "plain", prompt, 6)
    want_batch = batch_steps(plain, "plain")

    ops = HeadsOnTheCpu(BackendOptions(cuda_attention=False))
    model = open_mlx(zoo.path("qwen3"), ops)
    assert ferrum_greedy(model, "fused", prompt, 6) == want_tokens
    for got, want in zip(batch_steps(model, "fused"), want_batch):
        np.testing.assert_array_equal(got, want)
    assert 0 in calls and 1 in calls  # one token at its offset; a batch's rows at their own positions
    calls.clear()
    attn = model.model.layers[0].attn
    ops.warm_up(attn, mx.float32)
    ops.warm_up(attn, mx.float32)
    assert calls == [1]  # the batch's build, once
    off = HeadsOnTheCpu(BackendOptions(cuda_attention=False, cuda_heads=False))
    assert off.kernels(open_mlx(zoo.path("qwen3"), off).model.layers[0].attn).heads is None
