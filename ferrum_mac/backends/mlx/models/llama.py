"""The Llama family: Llama 1-3.x, Mistral, SmolLM2, TinyLlama, Qwen2/2.5 (qkv bias) and
Qwen3 (q/k RMSNorm). Embedding, blocks of attention + SwiGLU MLP, final norm, head."""

from __future__ import annotations

import mlx.core as mx

from ferrum_mac.backends.mlx.attention import Attention, Plan
from ferrum_mac.backends.mlx.layers import Linear, TensorSource
from ferrum_mac.weights import ModelConfig


class Mlp:
    def __init__(self, src: TensorSource, config: ModelConfig, prefix: str, hidden: int):
        c, bias = config, config.mlp_bias
        self.gate_up = src.projections(
            [
                src.linear(f"{prefix}.gate_proj", hidden, c.hidden_size, bias),
                src.linear(f"{prefix}.up_proj", hidden, c.hidden_size, bias),
            ]
        )
        self.down = src.linear(f"{prefix}.down_proj", c.hidden_size, hidden, bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(self.gate_up.swiglu(x))


class Block:
    """Pre-norm attention and MLP with residuals.

    Everything but the cache write and attention is pure, so for the few-token steps of
    decoding it runs as two compiled graphs: Python then builds ~3 calls per layer instead
    of ~25 ops, which is most of a small model's decode time on a GPU. Steps of at most
    `compile_max_tokens` tokens (FERRUM_MLX_COMPILE_MAX_TOKENS; 0: none) run compiled, each
    distinct count traced once; longer prefills run eagerly (their kernels dominate).
    """

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, mlp):
        p = f"layers.{layer}"
        self.attn = Attention(src, config, layer)
        self.ops = src.ops
        self.compile_max_tokens = src.ops.options.compile_max_tokens
        self.mlp = mlp
        self.attn_norm = src.norm(f"{p}.input_layernorm", config.hidden_size)
        self.mlp_norm = src.norm(f"{p}.post_attention_layernorm", config.hidden_size)
        self.eps = config.rms_norm_eps
        self.compiled_pre = mx.compile(self.pre)
        self.compiled_post = mx.compile(self.post)

    def pre(self, x: mx.array, positions: mx.array):
        return self.ops.project(self.attn, mx.fast.rms_norm(x, self.attn_norm, self.eps), positions)

    def post(self, x: mx.array, attn_out: mx.array) -> mx.array:
        h = x + self.attn.o_proj(attn_out)
        return h + self.mlp(mx.fast.rms_norm(h, self.mlp_norm, self.eps))

    def __call__(self, x: mx.array, plan: Plan) -> mx.array:
        small = plan.total <= self.compile_max_tokens
        q, k, v = (self.compiled_pre if small else self.pre)(x, plan.positions)
        out = self.attn.attend(q, k, v, plan)
        return (self.compiled_post if small else self.post)(x, out)


class Model:
    """A decoder: `hidden(tokens, plan)` runs the blocks, `logits(h)` the norm and head."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        c = config
        self.config = c
        self.embed = src.linear("embed_tokens", c.vocab_size, c.hidden_size)
        self.layers = [self.make_block(src, i) for i in range(c.num_layers)]
        self.norm = src.norm("norm", c.hidden_size)
        tied = c.tie_word_embeddings or not src.has("lm_head.weight")
        self.head: Linear = self.embed if tied else src.linear("lm_head", c.vocab_size, c.hidden_size)

    def make_block(self, src: TensorSource, layer: int) -> Block:
        return Block(src, self.config, layer, self.make_mlp(src, layer))

    def make_mlp(self, src: TensorSource, layer: int):
        return Mlp(src, self.config, f"layers.{layer}.mlp", self.config.intermediate_size)

    def use_context(self, tokens: int) -> None:
        """Fit RoPE to the longest sequence the model will hold (`layers.Rope.use_context`)."""
        for block in self.layers:
            block.attn.rope.use_context(tokens)

    def hidden(self, tokens: mx.array, plan: Plan) -> mx.array:
        """tokens `(T,)` -> final hidden states `(1, T, hidden)` before the norm."""
        h = self.embed.rows(tokens)[None]
        for block in self.layers:
            h = block(h, plan)
        return h

    def logits(self, h: mx.array) -> mx.array:
        return self.head(mx.fast.rms_norm(h, self.norm, self.config.rms_norm_eps))
