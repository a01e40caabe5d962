"""Qwen3-Next and Qwen3.5 / 3.6 (text): Gated DeltaNet linear attention between gated attention layers.

Three of every four layers are Gated DeltaNet linear attention (a short causal convolution
and a recurrent state per sequence, `RecurrentStates`), the fourth gated full attention (an output gate, q/k norms, partial RoPE); norms are zero-centred
(weighed by 1 + w), but for the linear layers' gated norm. The MoE variants (Qwen3-Next,
`qwen3_5_moe`) add a shared expert, gated, to Qwen3-MoE's sparse block.

The delta rule runs by its chunked (WY) form over a prompt's chunks, as matrix products, and
by its recurrent step for one token; in float32, as transformers does. Every step runs
eagerly by torch's ops (no captured decode step: those hold no recurrent state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum_mac.backends.torch.layers import RmsNorm, inverse_frequencies, linear, tied_head
from ferrum_mac.backends.torch.models.llama import Mlp
from ferrum_mac.backends.torch.models.qwen3_moe import SparseMoe
from ferrum_mac.backends.torch.ops import TORCH_OPS, Ops
from ferrum_mac.backends.torch.weights import TensorSource, to_torch
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.moe import MoeConfig, moe_config
from ferrum_mac.weights.qwen3_5 import conv_layout, norm_offset, text_tensors, unfuse_linear_projections

CHUNK = 64  # tokens per chunk of the delta rule's chunked form


def zero_centred_norm(src: TensorSource, module: str, dim: int, eps: float) -> RmsNorm:
    """A Qwen3.5 RMSNorm weighs by (1 + w): as a plain RMSNorm weight (an mlx-lm conversion stores it so)."""
    return RmsNorm(src.config.extra.get("qwen3_5_norm_offset", 1.0) + src.norm(module, dim), eps)


class PartialRope:
    """RoPE of each head's first `rope_dims` dims, pairs (i, i + dims/2), from positions."""

    def __init__(self, config: ModelConfig, device: torch.device):
        self.inv_freq = inverse_frequencies(config).to(device)
        self.dims = config.rope_dims

    def build(self, positions: int) -> None:
        """(The tables are computed per forward, from its positions.)"""

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(positions.to(torch.float32), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        turned, rest = x[..., : self.dims], x[..., self.dims :]
        half = self.dims // 2
        rotated = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
        return torch.cat((turned * cos + rotated * sin, rest), dim=-1)


class GatedAttention:
    """Full attention whose q projection carries, per head, a gate on the output (sigmoid)."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, rope: PartialRope):
        p, c = f"layers.{layer}.self_attn", config
        self.layer, self.rope = layer, rope
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = linear(src, f"{p}.q_proj", 2 * q_out, c.hidden_size, c.qkv_bias)
        self.k_proj = linear(src, f"{p}.k_proj", kv_out, c.hidden_size, c.qkv_bias)
        self.v_proj = linear(src, f"{p}.v_proj", kv_out, c.hidden_size, c.qkv_bias)
        self.o_proj = linear(src, f"{p}.o_proj", c.hidden_size, q_out, c.o_bias)
        self.q_norm = zero_centred_norm(src, f"{p}.q_norm", c.head_dim, c.rms_norm_eps)
        self.k_norm = zero_centred_norm(src, f"{p}.k_norm", c.head_dim, c.rms_norm_eps)

    def __call__(self, x: torch.Tensor, plan, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `(T, hidden)` (normed) -> `(T, hidden)`."""
        T = x.shape[0]
        qg = self.q_proj(x).view(T, self.heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :].reshape(T, -1)
        k = self.k_proj(x).view(T, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.kv_heads, self.head_dim)
        q = self.rope(self.q_norm(q), cos, sin)
        k = self.rope(self.k_norm(k), cos, sin)
        out = plan.attend(self.layer, q.contiguous(), k.contiguous(), v, self.scale)
        return self.o_proj(out * torch.sigmoid(gate))


class GatedDeltaNet:
    """Linear attention by the gated delta rule: each sequence's state (its convolution's last
    inputs `(kernel - 1, channels)` and `S` `(value heads, key dim, value dim)`) lives in the
    plan's `recurrent` states, `layers[layer]`."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int):
        p, e, hidden = f"layers.{layer}.linear_attn", config.extra, config.hidden_size
        self.layer = layer
        self.k_heads, self.v_heads = e["linear_num_key_heads"], e["linear_num_value_heads"]
        self.k_dim, self.v_dim = e["linear_key_head_dim"], e["linear_value_head_dim"]
        self.kernel = e["linear_conv_kernel_dim"]
        key_dim, value_dim = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.channels = 2 * key_dim + value_dim
        self.in_proj_qkv = linear(src, f"{p}.in_proj_qkv", self.channels, hidden)
        self.in_proj_z = linear(src, f"{p}.in_proj_z", value_dim, hidden)
        self.in_proj_b = linear(src, f"{p}.in_proj_b", self.v_heads, hidden)
        self.in_proj_a = linear(src, f"{p}.in_proj_a", self.v_heads, hidden)
        conv = f"{p}.conv1d.weight"
        self.conv = src.take(conv, conv_layout(src.tensors, conv, self.channels, self.kernel))
        self.conv = self.conv.reshape(self.channels, 1, self.kernel)
        self.decay_rate = -src.take(f"{p}.A_log", (self.v_heads,)).float().exp()
        self.dt_bias = src.take(f"{p}.dt_bias", (self.v_heads,)).float()
        self.norm = src.norm(f"{p}.norm", self.v_dim).float()
        self.out_proj = linear(src, f"{p}.out_proj", hidden, value_dim)
        self.eps = config.rms_norm_eps

    def __call__(self, x: torch.Tensor, plan) -> torch.Tensor:
        """x `(T, hidden)` (normed) -> `(T, hidden)`, each segment from its sequence's state."""
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        decay = self.decay_rate * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if len(plan.segments) > 1 and plan.total == len(plan.segments):  # a batched decode step
            out = self.decode_batch(qkv, beta, decay, plan.recurrent, x)
        else:
            outs = []
            for seg, state in zip(plan.segments, plan.recurrent):
                rows = slice(seg.start, seg.start + seg.length)
                conv, S = state.layers.get(self.layer) or self.fresh_state(x)
                mixed, conv = self.convolve(qkv[rows], conv)
                out, S = self.delta_rule(mixed, beta[rows], decay[rows], S)
                state.layers[self.layer] = (conv, S)
                outs.append(out)
            out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, v_heads, v_dim), float32
        normed = F.rms_norm(out, (self.v_dim,), self.norm, self.eps)
        gated = normed * F.silu(z.view(-1, self.v_heads, self.v_dim).float())
        return self.out_proj(gated.to(x.dtype).flatten(1))

    def decode_batch(self, qkv, beta, decay, recurrent: list, x: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences, their states stacked: one convolution and one
        recurrent step for all (not one per sequence); `(B, v_heads, v_dim)`."""
        states = [state.layers.get(self.layer) or self.fresh_state(x) for state in recurrent]
        conv, S = torch.stack([c for c, _ in states]), torch.stack([s for _, s in states])
        joined = torch.cat((conv, qkv[:, None, :]), dim=1)  # (B, kernel, channels)
        q, k, v = self.heads(F.silu((joined * self.conv[:, 0].T[None]).sum(dim=1)))
        out, S = recurrent_step(q, k, v, beta, decay, S)
        for i, state in enumerate(recurrent):
            state.layers[self.layer] = (joined[i, 1:], S[i])
        return out

    def fresh_state(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        conv = x.new_zeros((self.kernel - 1, self.channels))
        return conv, x.new_zeros((self.v_heads, self.k_dim, self.v_dim), dtype=torch.float32)

    def convolve(self, x: torch.Tensor, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal depthwise convolution (then SiLU) of `x` `(n, channels)` after the inputs
        `conv` `(kernel - 1, channels)`; returns its output and the new last inputs."""
        joined = torch.cat((conv, x))
        out = F.conv1d(joined.T[None], self.conv, groups=self.channels)[0].T
        return F.silu(out), joined[-(self.kernel - 1) :].clone()

    def delta_rule(self, mixed, beta, decay, S):
        """The gated delta rule over one sequence's `n` tokens: `(n, v_heads, v_dim)` outputs and the state after them."""
        q, k, v = self.heads(mixed)
        if mixed.shape[0] == 1:
            out, S = recurrent_step(q[0], k[0], v[0], beta[0], decay[0], S)
            return out[None], S
        return chunked_delta_rule(q, k, v, beta, decay, S)

    def heads(self, mixed: torch.Tensor):
        """The convolution's output `(n, channels)` -> q and k `(n, v_heads, k_dim)` (a key head
        for each of its value heads; l2-normed, q scaled) and v `(n, v_heads, v_dim)`, float32."""
        n, kd, vd = mixed.shape[0], self.k_heads * self.k_dim, self.v_heads * self.v_dim
        q = mixed[:, :kd].view(n, self.k_heads, self.k_dim).float()
        k = mixed[:, kd : 2 * kd].view(n, self.k_heads, self.k_dim).float()
        v = mixed[:, 2 * kd : 2 * kd + vd].view(n, self.v_heads, self.v_dim).float()
        group = self.v_heads // self.k_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        return l2norm(q) * self.k_dim**-0.5, l2norm(k), v


def recurrent_step(q, k, v, beta, decay, S):
    """One token (of each sequence, with a leading batch axis): q/k `(heads, k_dim)`, v
    `(heads, v_dim)`, beta/decay `(heads,)`, S `(heads, k_dim, v_dim)` -> `(heads, v_dim)`, S."""
    S = S * decay.exp()[..., None, None]
    remembered = (S * k[..., None]).sum(dim=-2)
    delta = (v - remembered) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return (S * q[..., None]).sum(dim=-2), S


def chunked_delta_rule(q, k, v, beta, decay, S, chunk: int = CHUNK):
    """The delta rule over `n` tokens (q/k `(n, heads, k_dim)`, v `(n, heads, v_dim)`, beta and
    decay `(n, heads)`) by chunks: within a chunk, the updates condensed by the UT transform
    into triangular solves and matrix products; across chunks, the state carried."""
    n = q.shape[0]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(a.transpose(0, 1), (0, 0, 0, pad)) for a in (q, k, v))  # (heads, n + pad, dim)
    beta, decay = (F.pad(a.T, (0, pad)) for a in (beta, decay))  # (heads, n + pad)
    heads = q.shape[0]
    q, k, v = (a.reshape(heads, -1, chunk, a.shape[-1]) for a in (q, k, v))
    beta, decay = beta.reshape(heads, -1, chunk), decay.reshape(heads, -1, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = decay.cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * pairwise
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(q.shape[1]):
        v_new = values[:, i] - k_decayed[:, i] @ S
        outs.append(q[:, i] @ S + within[:, i] @ v_new)
        S = S * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = torch.cat(outs, dim=1)[:, :n]  # (heads, n, v_dim)
    return out.transpose(0, 1), S


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class SharedExpertMoe:
    """The sparse MoE (`qwen3_moe.SparseMoe`) beside a shared expert, which a sigmoid gate weighs."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, moe: MoeConfig):
        p = f"layers.{layer}.mlp"
        self.sparse = SparseMoe(src, config, layer, moe)
        self.shared = Mlp(src, config, f"{p}.shared_expert", config.extra["shared_expert_intermediate_size"])
        self.shared_gate = linear(src, f"{p}.shared_expert_gate", 1, config.hidden_size)

    def __call__(self, h: torch.Tensor, norm: RmsNorm, ops: Ops) -> torch.Tensor:
        """h + moe(norm(h)) + gate * shared(norm(h)), h `(T, hidden)`."""
        x = norm(h)
        gate, up = self.shared.gate_up(x).chunk(2, dim=-1)
        shared = self.shared.down(F.silu(gate) * up) * torch.sigmoid(self.shared_gate(x))
        return ops.sparse_moe(self.sparse, x, h + shared)


def make_mlp(src: TensorSource, config: ModelConfig, layer: int, moe: MoeConfig | None):
    if moe is not None and moe.is_sparse(layer):
        return SharedExpertMoe(src, config, layer, moe)
    return Mlp(src, config, f"layers.{layer}.mlp", config.intermediate_size)


class Block:
    """Pre-norm token mixer (linear or gated attention) and MLP (SwiGLU, or the MoE), with residuals."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, rope: PartialRope, moe: MoeConfig | None):
        p, c = f"layers.{layer}", config
        linear_layer = layer in c.recurrent_layers
        self.attn = None if linear_layer else GatedAttention(src, c, layer, rope)
        self.linear_attn = GatedDeltaNet(src, c, layer) if linear_layer else None
        self.mlp = make_mlp(src, c, layer, moe)
        self.attn_norm = zero_centred_norm(src, f"{p}.input_layernorm", c.hidden_size, c.rms_norm_eps)
        self.mlp_norm = zero_centred_norm(src, f"{p}.post_attention_layernorm", c.hidden_size, c.rms_norm_eps)

    def __call__(self, h: torch.Tensor, plan, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(h)
        h = h + (self.linear_attn(x, plan) if self.attn is None else self.attn(x, plan, cos, sin))
        return self.mlp(h, self.mlp_norm, plan.ops)


class Model:
    """A decoder: `hidden(tokens, plan)` runs the blocks, `logits(h, ops)` the norm and head."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        c = self.config = config
        src.tensors = text_tensors(src.tensors)
        c.extra["qwen3_5_norm_offset"] = norm_offset(src.tensors)
        unfuse_linear_projections(src.tensors, c, lambda parts: torch.cat([to_torch(a) for a in parts]))
        moe = moe_config(c) if c.extra.get("num_experts") else None
        self.rope = PartialRope(c, src.device)
        self.embed = src.take("embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers = [Block(src, c, i, self.rope, moe) for i in range(c.num_layers)]
        self.norm = zero_centred_norm(src, "norm", c.hidden_size, c.rms_norm_eps)
        tied = c.tie_word_embeddings or not src.has("lm_head.weight")
        self.head = tied_head(src, self.embed) if tied else linear(src, "lm_head", c.vocab_size, c.hidden_size)

    def hidden(self, tokens: torch.Tensor, plan) -> torch.Tensor:
        """tokens `(T,)` -> final hidden states `(T, hidden)` before the norm."""
        h = F.embedding(tokens, self.embed)
        cos, sin = self.rope.tables(plan.positions, h.dtype)
        for block in self.layers:
            h = block(h, plan, cos, sin)
        return h

    def logits(self, h: torch.Tensor, ops: Ops = TORCH_OPS) -> torch.Tensor:
        return ops.head(self.head, ops.rms_norm(h, self.norm))
