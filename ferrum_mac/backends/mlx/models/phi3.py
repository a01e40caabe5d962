"""Phi-3, Phi-4 and Phi-4-mini: the Llama decoder with fused projections, partial RoPE and LongRoPE.

q/k/v are stored as one `qkv_proj` and gate and up as one `gate_up_proj`; RoPE turns the
first `partial_rotary_factor` of each head (Phi-4-mini: 0.75) and, for the 128k variants,
rescales each frequency by LongRoPE's factors (`weights.rope`).

The fused projections are split at load into the llama blocks' q/k/v and gate/up
(`weights.fused`), which fuse them again where the device's ops ask; the partial rotary and
the schedule are the llama `Rope`'s, from the config."""

from __future__ import annotations

from ferrum_mac.backends.mlx.layers import TensorSource
from ferrum_mac.backends.mlx.models import llama
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.fused import split_phi3


class Model(llama.Model):
    def __init__(self, src: TensorSource, config: ModelConfig):
        split_phi3(src.tensors, config)
        super().__init__(src, config)
