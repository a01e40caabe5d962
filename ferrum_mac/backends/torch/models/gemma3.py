"""Gemma 3 (text): local sliding-window layers between global ones, each kind with its own
RoPE base; sandwich norms (RMSNorm before and after attention and the MLP), Gemma's norms
weighted by (1 + w), GeGLU, embeddings scaled by sqrt(hidden), q/k RMSNorm, scores scaled by
`query_pre_attn_scalar`, and optional tanh caps on the scores and the final logits."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ferrum_mac.backends.torch.attention import Attention
from ferrum_mac.backends.torch.layers import RmsNorm, Rope, linear, tied_head
from ferrum_mac.backends.torch.ops import TORCH_OPS, Ops
from ferrum_mac.backends.torch.weights import TensorSource
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.gemma3 import text_tensors


def gemma_norm(src: TensorSource, module: str, dim: int, eps: float) -> RmsNorm:
    """Gemma's RMSNorm weighs by (1 + w): as a plain RMSNorm weight (GGUF stores it so)."""
    return RmsNorm(src.config.extra.get("gemma3_norm_offset", 1.0) + src.norm(module, dim), eps)


class GemmaAttention(Attention):
    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, rope: Rope):
        super().__init__(src, config, layer, rope)
        self.qk_norm = config.extra.get("gemma3_norm_offset", 1.0) + self.qk_norm
        self.scale = config.extra["query_pre_attn_scalar"] ** -0.5
        self.softcap = config.extra.get("gemma3_attn_softcap")


class Ropes:
    """The global layers' RoPE (`rope_theta`, scaled) and the local layers' (their own base)."""

    def __init__(self, config: ModelConfig, device: torch.device):
        local = config.extra["gemma3_local_rope_theta"]
        self.full = Rope(config, device)
        self.local = Rope(dataclasses.replace(config, rope_theta=local, rope_scaling=None), device)

    def build(self, positions: int) -> None:
        self.full.build(positions)
        self.local.build(positions)


class Block:
    """Sandwich norms: h + post_norm(attention(pre_norm(h))), then the same around the MLP."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, ropes: Ropes):
        p, c = f"layers.{layer}", config
        self.attn = GemmaAttention(src, c, layer, ropes.local if c.layer_windows[layer] else ropes.full)
        self.norms = [
            gemma_norm(src, f"{p}.{name}", c.hidden_size, c.rms_norm_eps)
            for name in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        ]
        m = f"{p}.mlp"
        self.gate = linear(src, f"{m}.gate_proj", c.intermediate_size, c.hidden_size)
        self.up = linear(src, f"{m}.up_proj", c.intermediate_size, c.hidden_size)
        self.down = linear(src, f"{m}.down_proj", c.hidden_size, c.intermediate_size)

    def __call__(self, h: torch.Tensor, plan, tables: dict) -> torch.Tensor:
        pre_attn, post_attn, pre_mlp, post_mlp = self.norms
        cos, sin = tables[self.attn.rope]
        out = self.attn.attention(h, pre_attn, plan, cos, sin)
        h = h + post_attn(self.attn.o_proj(out))
        x = pre_mlp(h)
        return h + post_mlp(self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x)))


class Model:
    """A decoder: `hidden(tokens, plan)` runs the blocks, `logits(h, ops)` the norm, the tied
    head and the cap."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        c = self.config = config
        src.tensors = text_tensors(src.tensors)
        self.rope = Ropes(c, src.device)
        self.embed = src.take("embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.embed_scale = torch.tensor(math.sqrt(c.hidden_size), dtype=src.dtype, device=src.device)
        self.layers = [Block(src, c, i, self.rope) for i in range(c.num_layers)]
        self.norm = gemma_norm(src, "norm", c.hidden_size, c.rms_norm_eps)
        tied = c.tie_word_embeddings or not src.has("lm_head.weight")
        self.head = tied_head(src, self.embed) if tied else linear(src, "lm_head", c.vocab_size, c.hidden_size)
        self.final_softcap = c.extra.get("gemma3_final_softcap")

    def hidden(self, tokens: torch.Tensor, plan) -> torch.Tensor:
        """tokens `(T,)` -> final hidden states `(T, hidden)` before the norm."""
        h = F.embedding(tokens, self.embed) * self.embed_scale
        tables = {rope: rope.tables(plan.positions, h.dtype) for rope in (self.rope.full, self.rope.local)}
        for block in self.layers:
            h = block(h, plan, tables)
        return h

    def logits(self, h: torch.Tensor, ops: Ops = TORCH_OPS) -> torch.Tensor:
        logits = ops.head(self.head, ops.rms_norm(h, self.norm))
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
