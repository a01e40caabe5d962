"""Building blocks shared by the torch model families: linear layers (fused when they read
the same input), RMSNorm and RoPE tables. (The elementwise work is in pointwise.py.)"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ferrum_mac.errors import UnsupportedModelError

from ferrum_mac.backends.torch.quant import QuantLinear, concatenated
from ferrum_mac.backends.torch.weights import TensorSource, to_torch
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.rope import scaled_rope


class Linear:
    """y = x W^T (+ b), W `(out, in)`."""

    quantized = False  # (`quant.QuantLinear`: the same calls over a packed W)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T (+ b) as one GEMM (the residual is its accumulator)."""
        if self.bias is not None or x.dim() != 2:
            return residual + self(x)
        return torch.addmm(residual, x, self.weight.t())


def linear(src: TensorSource, module: str, out_dim: int, in_dim: int, bias: bool = False) -> Linear | QuantLinear:
    b = src.take(f"{module}.bias", (out_dim,)) if bias else None
    packed = src.packed(module, (out_dim, in_dim))
    if packed is not None:  # (a head takes a prompt's last row only: no scratch its size)
        return QuantLinear(packed, b, src.dtype, sizes_scratch=module != "lm_head")
    return Linear(src.take(f"{module}.weight", (out_dim, in_dim)), b)


def tied_head(src: TensorSource, embed: torch.Tensor) -> Linear | QuantLinear:
    """The head of a model whose head is its embedding: packed where the embedding is (a packed
    copy beside the dense table the lookup reads), else the table itself."""
    packed = src.packed("embed_tokens", tuple(embed.shape))
    return Linear(embed) if packed is None else QuantLinear(packed, None, src.dtype, sizes_scratch=False)


def fuse(linears: list) -> Linear | QuantLinear:
    """Linears that read the same input, stacked into one (their outputs side by side). Packed
    ones stay packed where they share bits and groups, else all are dequantized."""
    if any(l.quantized for l in linears):
        return fuse_quantized(linears)
    weight = torch.cat([l.weight for l in linears])
    if all(l.bias is None for l in linears):
        return Linear(weight)
    biases = [l.weight.new_zeros(l.weight.shape[0]) if l.bias is None else l.bias for l in linears]  # none: zeros
    return Linear(weight, torch.cat(biases))


def fuse_quantized(linears: list) -> Linear | QuantLinear:
    dtype = linears[0].dtype if linears[0].quantized else linears[0].weight.dtype
    packed = concatenated([l.weight for l in linears]) if all(l.quantized for l in linears) else None
    if packed is None:  # bits or groups differ: all dense
        return fuse([Linear(l.weight.dequantize(dtype), l.bias) if l.quantized else l for l in linears])
    if all(l.bias is None for l in linears):
        return QuantLinear(packed, None, dtype)
    biases = [
        torch.zeros(l.weight.shape[0], dtype=dtype, device=packed.words.device) if l.bias is None else l.bias
        for l in linears
    ]
    return QuantLinear(packed, torch.cat(biases), dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # Normalises and weighs in float32, rounding once to x's dtype (transformers' RMSNorm
    # rounds before the weight too, so the two can differ by an ulp).
    return F.rms_norm(x, x.shape[-1:], weight, eps)


class RmsNorm:
    """`rms_norm` with its weight and eps, for the ops that may fuse it into their matmul."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rope:
    """RoPE tables by position (default, linear, Llama-3, GGUF per-frequency, LongRoPE or YaRN
    schedules), laid out for `pointwise.norm_and_rope`: cos for both dims of a pair, sin signed
    for the pair's first dim. Pairs are (i, i + dims/2), or (2i, 2i+1) for `interleaved`
    checkpoints. A partial rope (`config.rope_dims` < head_dim) turns its pairs at angle zero
    past the rotated ones (cos 1, sin 0: those dims pass unchanged), its q/k rows reordered at
    load so the rotated pairs sit there (`pair_rotated_dims`). LongRoPE and YaRN scale the
    rotated dims' cos and sin by their attention factor."""

    def __init__(self, config: ModelConfig, device: torch.device):
        self.config = config
        self.interleaved = config.rope_traditional  # GGUF llama: q/k rows permuted for it
        if self.interleaved and config.rope_dims != config.head_dim:
            raise UnsupportedModelError("a partial rope over interleaved q/k rows is not supported")
        self.inv_freq = inverse_frequencies(config).to(device)
        self.cos = self.sin = None
        self.cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # the tables in an activation dtype

    def build(self, positions: int) -> None:
        """Tables `(positions, head_dim)` for positions 0 .. positions-1 (the KV capacity, which
        also picks LongRoPE's factors: `weights.rope`), float32."""
        self.cast = {}
        device, factor = self.inv_freq.device, 1.0
        scaled = scaled_rope(self.config, positions)
        if scaled is not None:
            self.inv_freq, factor = torch.from_numpy(scaled.inv_freq).to(device), scaled.attention_factor
        t = torch.arange(positions, device=device, dtype=torch.float32)
        angles = torch.outer(t, self.inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        unturned = (self.config.head_dim - self.config.rope_dims) // 2
        if unturned:
            cos = torch.cat((cos, cos.new_ones(positions, unturned)), dim=-1)
            sin = torch.cat((sin, sin.new_zeros(positions, unturned)), dim=-1)
        if self.interleaved:
            self.cos = torch.stack((cos, cos), dim=-1).flatten(-2)
            self.sin = torch.stack((-sin, sin), dim=-1).flatten(-2)
        else:
            self.cos, self.sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin `(T, 1, dims)` for positions `(T,)`, in the activations' dtype (the
        tables cast once, on first use: a decode step's graph then holds just the lookups)."""
        if dtype not in self.cast:
            self.cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        cos, sin = self.cast[dtype]
        return cos[positions][:, None, :], sin[positions][:, None, :]


def pair_rotated_dims(tensors: dict, config: ModelConfig) -> None:
    """Reorder each q and k head's rows (weights, packed words, scales, biases, q/k norms) so that
    a partial rope's pairs (i, i + rope_dims/2) become (i, i + head_dim/2), the pairs `Rope`'s
    tables turn, in place. The same order for q and k leaves every score as it was."""
    dim, turned = config.head_dim, config.rope_dims
    if turned == dim:
        return
    if (dim - turned) % 2:
        raise UnsupportedModelError(f"a partial rope of {turned} of {dim} dims leaves an odd number unturned")
    half, rest = turned // 2, (dim - turned) // 2
    head = np.concatenate(
        [np.arange(half), turned + np.arange(rest), half + np.arange(half), turned + rest + np.arange(rest)]
    )
    for layer in range(config.num_layers):
        p = f"layers.{layer}.self_attn"
        for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            order = (np.arange(heads)[:, None] * dim + head).reshape(-1)
            for suffix in ("weight", "scales", "biases", "bias"):
                if f"{p}.{proj}.{suffix}" in tensors:
                    tensors[f"{p}.{proj}.{suffix}"] = rows_in_order(tensors[f"{p}.{proj}.{suffix}"], order)
        for norm in ("q_norm", "k_norm"):
            if f"{p}.{norm}.weight" in tensors:
                tensors[f"{p}.{norm}.weight"] = rows_in_order(tensors[f"{p}.{norm}.weight"], head)


def rows_in_order(tensor, order: np.ndarray):
    """`tensor[order]` along its first dim, a torch tensor or an `mx.array` alike."""
    if isinstance(tensor, torch.Tensor):
        return tensor[torch.from_numpy(order).to(tensor.device)]
    import mlx.core as mx

    return tensor[mx.array(order)]


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Rotation frequencies `(rope_dims/2,)`, float32 and in transformers' order of operations
    (LongRoPE's and YaRN's come with the context: `Rope.build`)."""
    dims, base = config.rope_dims, config.rope_theta
    inv_freq = 1.0 / base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return llama3_inverse_frequencies(inv_freq, scaling)
    if kind == "freq_factors":  # GGUF's rope_freqs: each frequency divided by its factor
        return inv_freq / to_torch(scaling["factors"]).to(torch.float32)
    return inv_freq


def llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelens = 2 * math.pi / inv_freq
    scaled = torch.where(wavelens > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelens - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelens >= old_len / high) & (wavelens <= old_len / low)
    return torch.where(medium, smoothed, scaled)
