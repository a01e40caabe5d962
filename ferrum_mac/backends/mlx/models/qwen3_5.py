"""Qwen3-Next and Qwen3.5 / 3.6 (text): Gated DeltaNet linear attention between gated attention layers.

Three of every four layers are Gated DeltaNet linear attention (a short causal convolution
and a recurrent state per sequence, `RecurrentStates`), the fourth gated full attention (an output gate, q/k norms, partial RoPE); norms are zero-centred
(weighed by 1 + w), but for the linear layers' gated norm. The MoE variants (Qwen3-Next,
`qwen3_5_moe`) add a shared expert, gated, to Qwen3-MoE's sparse block.

The delta rule runs by its chunked (WY) form over a prompt's chunks, as matrix products, and
by its recurrent step for one token; in float32, as transformers does."""

from __future__ import annotations

import mlx.core as mx

from ferrum_mac.backends.mlx.attention import Attention, Plan
from ferrum_mac.backends.mlx.layers import Linear, Rope, TensorSource
from ferrum_mac.backends.mlx.models.llama import Mlp
from ferrum_mac.backends.mlx.models.qwen3_moe import SparseMoe, sanitize
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.moe import MoeConfig, moe_config
from ferrum_mac.weights.qwen3_5 import conv_layout, norm_offset, text_tensors, unfuse_linear_projections

CHUNK = 64  # tokens per chunk of the delta rule's chunked form


def zero_centred_norm(src: TensorSource, module: str, dim: int) -> mx.array:
    """A Qwen3.5 RMSNorm weighs by (1 + w): as a plain RMSNorm weight (an mlx-lm conversion stores it so)."""
    return src.config.extra.get("qwen3_5_norm_offset", 1.0) + src.norm(module, dim)


class GatedAttention(Attention):
    """Full attention whose q projection carries, per head, a gate on the output (sigmoid)."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int):
        p, c = f"layers.{layer}.self_attn", config
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv = src.projections(  # q with its gate, k, v (as one matmul where the device fuses them)
            [
                src.linear(f"{p}.q_proj", 2 * q_out, c.hidden_size, c.qkv_bias),
                src.linear(f"{p}.k_proj", kv_out, c.hidden_size, c.qkv_bias),
                src.linear(f"{p}.v_proj", kv_out, c.hidden_size, c.qkv_bias),
            ]
        )
        self.o_proj = src.linear(f"{p}.o_proj", c.hidden_size, q_out, c.o_bias)
        self.q_norm = zero_centred_norm(src, f"{p}.q_norm", c.head_dim)
        self.k_norm = zero_centred_norm(src, f"{p}.k_norm", c.head_dim)
        self.eps = c.rms_norm_eps
        self.rope = Rope(config)
        self.ops = src.ops
        self.window, self.softcap, self.sinks = 0, None, None

    def project_gated(self, x: mx.array, positions: mx.array):
        """x `(1, T, hidden)` -> roped q, k, v (in `Attention.project`'s layouts) and the gate `(1, T, heads * dim)`."""
        T, one = x.shape[1], positions.ndim == 0
        qg, k, v = self.qkv(x)
        qg = qg.reshape(1, T, self.heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :].reshape(1, T, -1)
        k = k.reshape(1, T, self.kv_heads, self.head_dim)
        v = v.reshape(1, T, self.kv_heads, self.head_dim)
        q = mx.fast.rms_norm(q, self.q_norm, self.eps)
        k = mx.fast.rms_norm(k, self.k_norm, self.eps)
        if one:
            q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
            return self.rope(q, positions), self.rope(k, positions), v, gate
        q, k, v = q[0], k[0], v[0]  # (T, heads, dim): each token its own rope row, at its own position
        q = self.rope(q[:, :, None, :], positions)[:, :, 0, :]
        k = self.rope(k[:, :, None, :], positions)[:, :, 0, :]
        return q, k, v, gate

    def __call__(self, x: mx.array, plan: Plan) -> mx.array:
        q, k, v, gate = self.project_gated(x, plan.positions)
        out = self.attend(q, k, v, plan)
        return self.o_proj(out * mx.sigmoid(gate))


class GatedDeltaNet:
    """Linear attention by the gated delta rule: each sequence's state (its convolution's last
    inputs `(1, kernel - 1, channels)` and `S` `(1, value heads, key dim, value dim)`) lives in
    the plan's `recurrent` states, `layers[layer]`."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int):
        p, e, hidden = f"layers.{layer}.linear_attn", config.extra, config.hidden_size
        self.layer = layer
        self.k_heads, self.v_heads = e["linear_num_key_heads"], e["linear_num_value_heads"]
        self.k_dim, self.v_dim = e["linear_key_head_dim"], e["linear_value_head_dim"]
        self.kernel = e["linear_conv_kernel_dim"]
        key_dim, value_dim = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.channels = 2 * key_dim + value_dim
        self.in_proj_qkv = src.linear(f"{p}.in_proj_qkv", self.channels, hidden)
        self.in_proj_z = src.linear(f"{p}.in_proj_z", value_dim, hidden)
        self.in_proj_b = src.linear(f"{p}.in_proj_b", self.v_heads, hidden)
        self.in_proj_a = src.linear(f"{p}.in_proj_a", self.v_heads, hidden)
        conv = f"{p}.conv1d.weight"
        conv = src.take(conv, conv_layout(src.tensors, conv, self.channels, self.kernel))
        self.conv = conv.reshape(
            self.channels, self.kernel
        ).T  # (kernel, channels): tap i reads the input i - (kernel - 1) steps back
        self.decay_rate = -mx.exp(src.take(f"{p}.A_log", (self.v_heads,), cast=False).astype(mx.float32))
        self.dt_bias = src.take(f"{p}.dt_bias", (self.v_heads,), cast=False).astype(mx.float32)
        self.norm = src.norm(f"{p}.norm", self.v_dim)
        self.out_proj = src.linear(f"{p}.out_proj", hidden, value_dim)
        self.eps = config.rms_norm_eps

    def __call__(self, x: mx.array, plan: Plan) -> mx.array:
        """x `(1, T, hidden)` -> `(1, T, hidden)`, each segment from its sequence's state."""
        qkv, z = self.in_proj_qkv(x)[0], self.in_proj_z(x)[0]
        beta = mx.sigmoid(self.in_proj_b(x)[0].astype(mx.float32))
        decay = self.decay_rate * softplus(self.in_proj_a(x)[0].astype(mx.float32) + self.dt_bias)
        if len(plan.segments) > 1 and plan.total == len(plan.segments):  # a batched decode step
            out = self.decode_batch(qkv, beta, decay, plan.recurrent, x.dtype)
        else:
            outs = []
            for seg, state in zip(plan.segments, plan.recurrent):
                rows = slice(seg.start, seg.start + seg.length)
                conv, S = state.layers.get(self.layer) or self.fresh_state(x.dtype)
                mixed, conv = self.convolve(qkv[rows], conv)
                out, S = self.delta_rule(mixed, beta[rows], decay[rows], S)
                state.layers[self.layer] = (conv, S)
                outs.append(out)
            out = outs[0] if len(outs) == 1 else mx.concatenate(outs)  # (T, v_heads, v_dim), float32
        T = out.shape[0]
        normed = mx.fast.rms_norm(out, self.norm.astype(mx.float32), self.eps)
        gated = normed * nn_silu(z.reshape(T, self.v_heads, self.v_dim).astype(mx.float32))
        return self.out_proj(gated.astype(x.dtype).reshape(1, T, -1))

    def decode_batch(self, qkv, beta, decay, recurrent: list, dtype) -> mx.array:
        """One token of each of B sequences, their states stacked: one convolution and one
        recurrent step for all (not one per sequence); `(B, v_heads, v_dim)`."""
        states = [state.layers.get(self.layer) or self.fresh_state(dtype) for state in recurrent]
        conv, S = mx.stack([c for c, _ in states]), mx.stack([s for _, s in states])
        joined = mx.concatenate([conv, qkv[:, None, :]], axis=1)  # (B, kernel, channels)
        q, k, v = self.heads(nn_silu((joined * self.conv[None]).sum(axis=1)))
        out, S = recurrent_step(q, k, v, beta, decay, S)
        for i, state in enumerate(recurrent):
            state.layers[self.layer] = (joined[i, 1:], S[i])
        return out

    def fresh_state(self, dtype) -> tuple[mx.array, mx.array]:
        conv = mx.zeros((self.kernel - 1, self.channels), dtype=dtype)
        return conv, mx.zeros((self.v_heads, self.k_dim, self.v_dim), dtype=mx.float32)

    def convolve(self, x: mx.array, conv: mx.array) -> tuple[mx.array, mx.array]:
        """The causal depthwise convolution (then SiLU) of `x` `(n, channels)` after the inputs
        `conv` `(kernel - 1, channels)`; returns its output and the new last inputs."""
        n, K = x.shape[0], self.kernel
        joined = mx.concatenate([conv, x])
        out = sum(joined[i : i + n] * self.conv[i] for i in range(K))
        return nn_silu(out), joined[-(K - 1) :]

    def delta_rule(self, mixed, beta, decay, S):
        """The gated delta rule over one sequence's `n` tokens (chunked; one token by the
        recurrent step): `(n, v_heads, v_dim)` outputs and the state after them."""
        q, k, v = self.heads(mixed)
        if mixed.shape[0] == 1:
            out, S = recurrent_step(q[0], k[0], v[0], beta[0], decay[0], S)
            return out[None], S
        return chunked_delta_rule(q, k, v, beta, decay, S)

    def heads(self, mixed: mx.array):
        """The convolution's output `(n, channels)` -> q and k `(n, v_heads, k_dim)` (a key head
        for each of its value heads; l2-normed, q scaled) and v `(n, v_heads, v_dim)`, float32."""
        n, kd, vd = mixed.shape[0], self.k_heads * self.k_dim, self.v_heads * self.v_dim
        q = mixed[:, :kd].reshape(n, self.k_heads, self.k_dim).astype(mx.float32)
        k = mixed[:, kd : 2 * kd].reshape(n, self.k_heads, self.k_dim).astype(mx.float32)
        v = mixed[:, 2 * kd : 2 * kd + vd].reshape(n, self.v_heads, self.v_dim).astype(mx.float32)
        group = self.v_heads // self.k_heads
        if group > 1:
            q, k = mx.repeat(q, group, axis=1), mx.repeat(k, group, axis=1)
        return l2norm(q) * self.k_dim**-0.5, l2norm(k), v


def recurrent_step(q, k, v, beta, decay, S):
    """One token (of each sequence, with a leading batch axis): q/k `(heads, k_dim)`, v
    `(heads, v_dim)`, beta/decay `(heads,)`, S `(heads, k_dim, v_dim)` -> `(heads, v_dim)`, S."""
    S = S * mx.exp(decay)[..., None, None]
    remembered = (S * k[..., None]).sum(axis=-2)
    delta = (v - remembered) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return (S * q[..., None]).sum(axis=-2), S


def chunked_delta_rule(q, k, v, beta, decay, S, chunk: int = CHUNK):
    """The delta rule over `n` tokens (q/k `(n, heads, k_dim)`, v `(n, heads, v_dim)`, beta and
    decay `(n, heads)`) by chunks: within a chunk, the updates condensed by the UT transform
    into matrix products; across chunks, the state carried.

    The transform's unit lower-triangular system `I + N` (N strictly lower, so N^chunk = 0)
    is inverted as (I - N)(I + N^2)(I + N^4)...: matrix products only, where a triangular
    solve would leave the GPU."""
    n, heads = q.shape[0], q.shape[1]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (mx.pad(a.transpose(1, 0, 2), [(0, 0), (0, pad), (0, 0)]) for a in (q, k, v))  # (heads, n + pad, dim)
    beta, decay = (mx.pad(a.T, [(0, 0), (0, pad)]) for a in (beta, decay))  # (heads, n + pad)
    q, k, v = (a.reshape(heads, -1, chunk, a.shape[-1]) for a in (q, k, v))
    beta, decay = beta.reshape(heads, -1, chunk), decay.reshape(heads, -1, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = mx.cumsum(decay, axis=-1)
    rows, cols = mx.arange(chunk)[:, None], mx.arange(chunk)[None, :]
    seen, strictly = rows >= cols, rows > cols
    pairwise = mx.where(seen, mx.exp(mx.where(seen, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    lower = mx.where(strictly, (k_beta @ k.swapaxes(-1, -2)) * pairwise, 0.0)
    inverse, power = mx.eye(chunk) - lower, lower @ lower
    for _ in range(max(0, chunk.bit_length() - 2)):  # (I + N^2), (I + N^4), ... up to N^(chunk / 2)
        inverse = inverse + inverse @ power
        power = power @ power
    values = inverse @ v_beta
    k_decayed = inverse @ (k_beta * mx.exp(cum)[..., None])
    within = (q @ k.swapaxes(-1, -2)) * pairwise
    q = q * mx.exp(cum)[..., None]
    k = k * mx.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]
    outs = []
    for i in range(q.shape[1]):
        v_new = values[:, i] - k_decayed[:, i] @ S
        outs.append(q[:, i] @ S + within[:, i] @ v_new)
        S = S * chunk_decay[:, i] + k[:, i].swapaxes(-1, -2) @ v_new
    out = mx.concatenate(outs, axis=1)[:, :n]  # (heads, n, v_dim)
    return out.transpose(1, 0, 2), S


def l2norm(x: mx.array) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + 1e-6)


def softplus(x: mx.array) -> mx.array:
    return mx.logaddexp(x, 0.0)


def nn_silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


class SharedExpertMoe:
    """The sparse MoE (`qwen3_moe.SparseMoe`) beside a shared expert, which a sigmoid gate weighs."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, moe: MoeConfig):
        p = f"layers.{layer}.mlp"
        self.sparse = SparseMoe(src, config, layer, moe)
        self.shared = Mlp(src, config, f"{p}.shared_expert", config.extra["shared_expert_intermediate_size"])
        self.shared_gate = src.linear(f"{p}.shared_expert_gate", 1, config.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.sparse(x) + mx.sigmoid(self.shared_gate(x)) * self.shared(x)


def make_mlp(src: TensorSource, config: ModelConfig, layer: int, moe: MoeConfig | None):
    if moe is not None and moe.is_sparse(layer):
        return SharedExpertMoe(src, config, layer, moe)
    return Mlp(src, config, f"layers.{layer}.mlp", config.intermediate_size)


class Block:
    """Pre-norm token mixer (linear or gated attention) and MLP (SwiGLU, or the MoE), with residuals."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, moe: MoeConfig | None):
        p, dim = f"layers.{layer}", config.hidden_size
        linear = layer in config.recurrent_layers
        self.mixer = GatedDeltaNet(src, config, layer) if linear else GatedAttention(src, config, layer)
        self.attn = None if linear else self.mixer
        self.mlp = make_mlp(src, config, layer, moe)
        self.attn_norm = zero_centred_norm(src, f"{p}.input_layernorm", dim)
        self.mlp_norm = zero_centred_norm(src, f"{p}.post_attention_layernorm", dim)
        self.eps = config.rms_norm_eps

    def __call__(self, x: mx.array, plan: Plan) -> mx.array:
        h = x + self.mixer(mx.fast.rms_norm(x, self.attn_norm, self.eps), plan)
        return h + self.mlp(mx.fast.rms_norm(h, self.mlp_norm, self.eps))


class Model:
    """`hidden(tokens, plan)` runs the blocks, `logits(h)` the norm and the head."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        c = self.config = config
        src.tensors = text_tensors(src.tensors)
        c.extra["qwen3_5_norm_offset"] = norm_offset(src.tensors)
        unfuse_linear_projections(src.tensors, c, mx.concatenate)  # (Qwen3-Next's)
        moe = moe_config(c) if c.extra.get("num_experts") else None
        if moe is not None:
            sanitize(src.tensors, c, moe)
        self.embed = src.linear("embed_tokens", c.vocab_size, c.hidden_size)
        self.layers = [Block(src, c, i, moe) for i in range(c.num_layers)]
        self.norm = zero_centred_norm(src, "norm", c.hidden_size)
        tied = c.tie_word_embeddings or not src.has("lm_head.weight")
        self.head: Linear = self.embed if tied else src.linear("lm_head", c.vocab_size, c.hidden_size)

    def use_context(self, tokens: int) -> None:
        for block in self.layers:
            if block.attn is not None:
                block.attn.rope.use_context(tokens)

    def hidden(self, tokens: mx.array, plan: Plan) -> mx.array:
        h = self.embed.rows(tokens)[None]
        for block in self.layers:
            h = block(h, plan)
        return h

    def logits(self, h: mx.array) -> mx.array:
        return self.head(mx.fast.rms_norm(h, self.norm, self.config.rms_norm_eps))
