"""The Llama family: Llama 1-3.x, Mistral, SmolLM2, TinyLlama, Qwen2/2.5 (qkv bias) and
Qwen3 (q/k RMSNorm). Embedding, blocks of attention + SwiGLU MLP, final norm, head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum_mac.backends.torch.attention import Attention
from ferrum_mac.backends.torch.layers import RmsNorm, Rope, fuse, linear, pair_rotated_dims, tied_head
from ferrum_mac.backends.torch.ops import TORCH_OPS, Ops
from ferrum_mac.backends.torch.weights import TensorSource
from ferrum_mac.weights import ModelConfig


class Mlp:
    def __init__(self, src: TensorSource, config: ModelConfig, prefix: str, hidden: int):
        c, bias = config, config.mlp_bias
        self.gate_up = fuse(
            [
                linear(src, f"{prefix}.gate_proj", hidden, c.hidden_size, bias),
                linear(src, f"{prefix}.up_proj", hidden, c.hidden_size, bias),
            ]
        )
        self.down = linear(src, f"{prefix}.down_proj", c.hidden_size, hidden, bias)

    def __call__(self, h: torch.Tensor, norm: RmsNorm, ops: Ops) -> torch.Tensor:
        """h + mlp(norm(h))."""
        return ops.matmul_plus(ops.norm_swiglu(h, norm, self.gate_up), self.down, h)


class Block:
    """Pre-norm attention and MLP with residuals. Each takes the block's input and its norm,
    so that the ops may fuse the norm into their first kernel."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, rope: Rope, mlp):
        p = f"layers.{layer}"
        self.attn = Attention(src, config, layer, rope)
        self.mlp = mlp
        self.attn_norm = RmsNorm(src.norm(f"{p}.input_layernorm", config.hidden_size), config.rms_norm_eps)
        self.mlp_norm = RmsNorm(src.norm(f"{p}.post_attention_layernorm", config.hidden_size), config.rms_norm_eps)

    def __call__(self, h: torch.Tensor, plan, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.attn(h, self.attn_norm, plan, cos, sin)
        return self.mlp(h, self.mlp_norm, plan.ops)


class Model:
    """A decoder: `hidden(tokens, plan)` runs the blocks, `logits(h, ops)` the norm and head.
    The plan carries the ops that run (`ops.py`)."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        c = self.config = config
        self.rope = Rope(c, src.device)
        pair_rotated_dims(src.tensors, c)
        self.embed = src.take("embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers = [self.make_block(src, i) for i in range(c.num_layers)]
        self.norm = RmsNorm(src.norm("norm", c.hidden_size), c.rms_norm_eps)
        tied = c.tie_word_embeddings or not src.has("lm_head.weight")
        self.head = tied_head(src, self.embed) if tied else linear(src, "lm_head", c.vocab_size, c.hidden_size)

    def make_block(self, src: TensorSource, layer: int) -> Block:
        return Block(src, self.config, layer, self.rope, self.make_mlp(src, layer))

    def make_mlp(self, src: TensorSource, layer: int):
        return Mlp(src, self.config, f"layers.{layer}.mlp", self.config.intermediate_size)

    def hidden(self, tokens: torch.Tensor, plan) -> torch.Tensor:
        """tokens `(T,)` -> final hidden states `(T, hidden)` before the norm."""
        h = F.embedding(tokens, self.embed)
        cos, sin = self.rope.tables(plan.positions, h.dtype)
        for block in self.layers:
            h = block(h, plan, cos, sin)
        return h

    def logits(self, h: torch.Tensor, ops: Ops = TORCH_OPS) -> torch.Tensor:
        return ops.head(self.head, ops.rms_norm(h, self.norm))
