"""gpt-oss (20b, 120b): attention with sinks in alternating windows, experts with biases.

A pre-norm decoder of 128-token sliding-window layers alternating with full attention, YaRN
RoPE, q/k/v/o projections with biases, a learned sink logit per head in every softmax's
denominator (`Attention.sinks`), and a mixture of experts on every layer: a router with a bias
keeps each token's top k experts, weighted by the softmax of their logits; each expert is a
clamped SwiGLU with biases,

    out = down((clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)),  g = min(gate, limit).

The experts run as Qwen3-MoE's do (`qwen3_moe.Experts`: one gathered matmul per projection,
token-expert pairs sorted by expert for long steps), plus their biases; attention takes MLX's
own fused attention, which takes the sinks (the device kernels' routes do not).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np

from ferrum_mac.backends.mlx.layers import TensorSource
from ferrum_mac.backends.mlx.models import llama
from ferrum_mac.backends.mlx.models.qwen3_moe import Experts, ExpertLinear, Router
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.gpt_oss import PROJECTIONS, ArrayOps, GptOssMoe, gpt_oss_moe, split_experts


@partial(mx.compile, shapeless=True)
def clamped_swiglu(gate: mx.array, up: mx.array, alpha: mx.array, limit: mx.array) -> mx.array:
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return (up + 1) * (gate * mx.sigmoid(alpha * gate))


class BiasedExperts(Experts):
    """Qwen3-MoE's stacked experts with a bias per expert and projection, and the clamped SwiGLU."""

    def __init__(self, src: TensorSource, prefix: str, moe: GptOssMoe, hidden: int):
        super().__init__(src, prefix, moe, hidden)
        E, inter = moe.num_experts, moe.intermediate_size
        outs = {"gate_proj": inter, "up_proj": inter, "down_proj": hidden}
        self.bias = {name: src.take(f"{prefix}.{name}.bias", (E, outs[name])) for name in PROJECTIONS}
        self.gate_up_bias = mx.concatenate([self.bias["gate_proj"], self.bias["up_proj"]], axis=1)
        self.alpha = mx.array(moe.swiglu_alpha, dtype=src.dtype)
        self.limit = mx.array(moe.swiglu_limit, dtype=src.dtype)

    def __call__(self, x: mx.array, experts: mx.array, weights: mx.array) -> mx.array:
        # (the device's MoE kernels take no biases: MLX's gathered matmuls here)
        return self.mix(x, experts, weights)

    def gathered_mlp(self, x: mx.array, experts: mx.array, weights: mx.array, sorted_indices: bool) -> mx.array:
        """x `(..., 1, hidden)`, one expert per row of `experts` -> weight * expert(x) `(..., 1, hidden)`."""
        if self.gate_up is not None:
            gate_up = biased(self.gate_up, self.gate_up_bias, x, experts, sorted_indices)
            gate, up = gate_up[..., : self.inter], gate_up[..., self.inter :]
        else:
            gate = biased(self.gate, self.bias["gate_proj"], x, experts, sorted_indices)
            up = biased(self.up, self.bias["up_proj"], x, experts, sorted_indices)
        a = clamped_swiglu(gate, up, self.alpha, self.limit)
        return biased(self.down, self.bias["down_proj"], a, experts, sorted_indices) * weights


def biased(linear: ExpertLinear, bias: mx.array, x: mx.array, experts: mx.array, sorted_indices: bool) -> mx.array:
    """`linear(x)` of each row's expert plus that expert's bias."""
    return linear(x, experts, sorted_indices) + mx.expand_dims(bias[experts], -2)


class GptOssMoeBlock:
    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, moe: GptOssMoe):
        p = f"layers.{layer}.mlp"
        gate = src.ops.router_gate(src.linear(f"{p}.router", moe.num_experts, config.hidden_size, bias=True))
        # top k of the logits, then the softmax over those k: Router's renormalised route
        self.router = Router(gate, moe.top_k, True, src.ops)
        self.experts = BiasedExperts(src, f"{p}.experts", moe, config.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.router(flat)
        return self.experts(flat, experts, weights).reshape(x.shape)


def packed_mxfp4(blocks: mx.array, scales: mx.array) -> tuple[mx.array, mx.array]:
    """OpenAI's MXFP4 blocks `(E, out, G, 16)` as MLX's mxfp4 words `(E, out, G * 4)`: the same bytes."""
    E, out = blocks.shape[:2]
    return mx.contiguous(blocks).view(mx.uint32).reshape(E, out, -1), mx.contiguous(scales)


MLX_ARRAYS = ArrayOps(lambda a: a.swapaxes(-1, -2), mx.contiguous, np.asarray, mx.array, packed_mxfp4)


class Model(llama.Model):
    """The Llama decoder (its attention with biases and sinks) with gpt-oss's MoE on every layer."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        self.moe = gpt_oss_moe(config)
        split_experts(src.tensors, config.num_layers, MLX_ARRAYS)
        super().__init__(src, config)

    def make_mlp(self, src: TensorSource, layer: int):
        return GptOssMoeBlock(src, self.config, layer, self.moe)
