"""Gemma 3 (text): local sliding-window layers between global ones, each kind with its own
RoPE base; sandwich norms (RMSNorm before and after attention and the MLP), Gemma's norms
weighted by (1 + w), GeGLU, embeddings scaled by sqrt(hidden), q/k RMSNorm, scores scaled by
`query_pre_attn_scalar`, and optional tanh caps on the scores and the final logits."""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import mlx.core as mx

from ferrum_mac.backends.mlx.attention import Attention, Plan
from ferrum_mac.backends.mlx.layers import Linear, Rope, TensorSource
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.gemma3 import text_tensors


def gemma_norm(src: TensorSource, module: str, dim: int) -> mx.array:
    """Gemma's RMSNorm weighs by (1 + w): as a plain RMSNorm weight (GGUF stores it so)."""
    return src.config.extra.get("gemma3_norm_offset", 1.0) + src.norm(module, dim)


class GemmaAttention(Attention):
    def __init__(self, src: TensorSource, config: ModelConfig, layer: int):
        super().__init__(src, config, layer)
        p = f"layers.{layer}.self_attn"
        self.q_norm = gemma_norm(src, f"{p}.q_norm", config.head_dim)
        self.k_norm = gemma_norm(src, f"{p}.k_norm", config.head_dim)
        self.scale = config.extra["query_pre_attn_scalar"] ** -0.5
        self.softcap = config.extra.get("gemma3_attn_softcap")
        if self.window:  # local layers turn at their own base, unscaled
            local = config.extra["gemma3_local_rope_theta"]
            self.rope = Rope(dataclasses.replace(config, rope_theta=local, rope_scaling=None))


class GeGlu:
    def __init__(self, src: TensorSource, config: ModelConfig, prefix: str):
        c = config
        self.gate = src.linear(f"{prefix}.gate_proj", c.intermediate_size, c.hidden_size)
        self.up = src.linear(f"{prefix}.up_proj", c.intermediate_size, c.hidden_size)
        self.down = src.linear(f"{prefix}.down_proj", c.hidden_size, c.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(gelu_tanh(self.gate(x)) * self.up(x))


@partial(mx.compile, shapeless=True)
def gelu_tanh(x: mx.array) -> mx.array:
    """GELU's tanh approximation (transformers' gelu_pytorch_tanh)."""
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


class Block:
    """Sandwich norms: x + post_norm(attention(pre_norm(x))), then the same around the MLP.
    As in the Llama block, everything but the cache write and attention is pure and runs
    compiled for steps of up to `compile_max_tokens` tokens."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int):
        p, dim = f"layers.{layer}", config.hidden_size
        self.attn = GemmaAttention(src, config, layer)
        self.mlp = GeGlu(src, config, f"{p}.mlp")
        self.compile_max_tokens = src.ops.options.compile_max_tokens
        self.norms = [
            gemma_norm(src, f"{p}.{name}", dim)
            for name in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        ]
        self.eps = config.rms_norm_eps
        self.compiled_pre = mx.compile(self.pre)
        self.compiled_post = mx.compile(self.post)

    def pre(self, x: mx.array, positions: mx.array):
        return self.attn.project(mx.fast.rms_norm(x, self.norms[0], self.eps), positions)

    def post(self, x: mx.array, attn_out: mx.array) -> mx.array:
        _, post_attn, pre_mlp, post_mlp = self.norms
        h = x + mx.fast.rms_norm(self.attn.o_proj(attn_out), post_attn, self.eps)
        return h + mx.fast.rms_norm(self.mlp(mx.fast.rms_norm(h, pre_mlp, self.eps)), post_mlp, self.eps)

    def __call__(self, x: mx.array, plan: Plan) -> mx.array:
        small = plan.total <= self.compile_max_tokens
        q, k, v = (self.compiled_pre if small else self.pre)(x, plan.positions)
        out = self.attn.attend(q, k, v, plan)
        return (self.compiled_post if small else self.post)(x, out)


class Model:
    """`hidden(tokens, plan)` runs the blocks, `logits(h)` the norm, the tied head and the cap."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        c = self.config = config
        src.tensors = text_tensors(src.tensors)
        self.embed = src.linear("embed_tokens", c.vocab_size, c.hidden_size)
        self.embed_scale = mx.array(math.sqrt(c.hidden_size), dtype=src.dtype)
        self.layers = [Block(src, c, i) for i in range(c.num_layers)]
        self.norm = gemma_norm(src, "norm", c.hidden_size)
        tied = c.tie_word_embeddings or not src.has("lm_head.weight")
        self.head: Linear = self.embed if tied else src.linear("lm_head", c.vocab_size, c.hidden_size)
        self.final_softcap = c.extra.get("gemma3_final_softcap")

    def use_context(self, tokens: int) -> None:
        """Fit RoPE to the longest sequence the model will hold (`layers.Rope.use_context`)."""
        for block in self.layers:
            block.attn.rope.use_context(tokens)

    def hidden(self, tokens: mx.array, plan: Plan) -> mx.array:
        h = (self.embed.rows(tokens) * self.embed_scale)[None]
        for block in self.layers:
            h = block(h, plan)
        return h

    def logits(self, h: mx.array) -> mx.array:
        logits = self.head(mx.fast.rms_norm(h, self.norm, self.config.rms_norm_eps))
        if self.final_softcap:
            logits = mx.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
