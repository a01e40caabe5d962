"""Building blocks shared by the MLX model families: linear layers (dense or affine
quantized, optionally fused), embeddings, RMSNorm, RoPE and SwiGLU."""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from ferrum_mac.errors import CorruptModelError
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.rope import scaled_rope

if TYPE_CHECKING:
    from ferrum_mac.backends.mlx.ops import Ops


class TensorSource:
    """Hands out a checkpoint's tensors by canonical name, checking presence and shape, as the
    layers of the device's `ops` (which the layers keep: the routes of their steps)."""

    def __init__(self, tensors: dict, config: ModelConfig, dtype: mx.Dtype, where: str, ops: "Ops"):
        self.tensors, self.config, self.dtype, self.where = tensors, config, dtype, where
        self.ops = ops

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...], cast: bool = True) -> mx.array:
        if name not in self.tensors:
            raise CorruptModelError(
                f"{self.where} lacks tensor {name!r}; the checkpoint is incomplete or not a {self.config.model_type} model"
            )
        array = self.tensors[name]
        if tuple(array.shape) != tuple(shape):
            raise CorruptModelError(
                f"{self.where}: tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)} from the model's config"
            )
        if cast and mx.issubdtype(array.dtype, mx.floating) and array.dtype != self.dtype:
            array = array.astype(self.dtype)
        return array

    def linear(self, module: str, out_dim: int, in_dim: int, bias: bool = False) -> "Linear":
        quant = self.config.quant_for(module)
        b = self.take(f"{module}.bias", (out_dim,)) if bias else None
        # mlx-lm records only per-layer dicts in config.json: a module its predicate kept dense
        # (or whose width the group size does not divide) is known by its missing `.scales`.
        if quant is None or not self.has(f"{module}.scales"):
            return self.ops.linear_type(self.take(f"{module}.weight", (out_dim, in_dim)), b)
        group, bits = quant["group_size"], quant["bits"]
        weight = self.take(f"{module}.weight", (out_dim, in_dim * bits // 32), cast=False)
        scales = self.take(f"{module}.scales", (out_dim, in_dim // group))
        biases = self.take(f"{module}.biases", (out_dim, in_dim // group))
        return self.ops.linear_type(weight, b, scales, biases, group, bits)

    def norm(self, module: str, dim: int) -> mx.array:
        return self.take(f"{module}.weight", (dim,))

    def projections(self, linears: list["Linear"]) -> "Projections":
        return Projections(linears, fuse=self.ops.fuse_projections)


def dequantized(tensors, config: ModelConfig, dtype: mx.Dtype) -> dict:
    """`tensors` with every quantized linear (a 2-D packed weight with scales and biases) as a
    dense weight in `dtype`; stacked MoE experts stay quantized (`gather_qmm` runs them).
    Lazy: nothing is computed until evaluated."""
    out = dict(tensors)
    for name, weight in tensors.items():
        module, _, suffix = name.rpartition(".")
        quant = config.quant_for(module)
        if (
            suffix != "weight"
            or quant is None
            or weight.ndim != 2
            or ".experts." in name
            or f"{module}.scales" not in tensors
        ):
            continue
        # in float32, where scale * q + bias is exact (MLX's CPU build emulates float16, slowly)
        scales, biases = (out.pop(f"{module}.{part}").astype(mx.float32) for part in ("scales", "biases"))
        dense = mx.dequantize(weight, scales, biases, group_size=quant["group_size"], bits=quant["bits"])
        out[name] = dense.astype(dtype)
    return out


class Linear:
    """y = x W^T (+ b), with W dense or affine-quantized (packed uint32, scales, biases)."""

    def __init__(self, weight, bias=None, scales=None, biases=None, group_size=0, bits=0):
        self.weight, self.bias = weight, bias
        self.scales, self.biases, self.group_size, self.bits = scales, biases, group_size, bits

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def __call__(self, x: mx.array) -> mx.array:
        if self.quantized:
            y = mx.quantized_matmul(
                x, self.weight, self.scales, self.biases, transpose=True, group_size=self.group_size, bits=self.bits
            )
        else:
            y = x @ self.weight.T
        return y if self.bias is None else y + self.bias

    def swiglu(self, x: mx.array) -> mx.array:
        """silu(gate) * up, this linear's rows being a gate projection's over an up projection's."""
        return swiglu(*mx.split(self(x), 2, axis=-1))

    def dense(self) -> "Linear":
        """This linear with its weight dequantized (itself when already dense)."""
        if not self.quantized:
            return self
        weight = mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
        return Linear(weight, self.bias)

    def rows(self, ids: mx.array) -> mx.array:
        """Rows of W (an embedding lookup), dequantized when needed."""
        if not self.quantized:
            return self.weight[ids]
        return mx.dequantize(
            self.weight[ids], self.scales[ids], self.biases[ids], group_size=self.group_size, bits=self.bits
        )


def fuse_linears(linears: list[Linear]) -> Linear | None:
    """Stack linears that read the same input into one matmul (of their kind), or None if
    their formats differ."""
    first = linears[0]
    same = all(
        (l.quantized, l.group_size, l.bits, l.bias is None)
        == (first.quantized, first.group_size, first.bits, first.bias is None)
        for l in linears
    )
    if not same:
        return None

    def cat(attr):
        parts = [getattr(l, attr) for l in linears]
        return None if parts[0] is None else mx.concatenate(parts, axis=0)

    return type(first)(cat("weight"), cat("bias"), cat("scales"), cat("biases"), first.group_size, first.bits)


class Projections:
    """Several linears over one input, run as one fused matmul when their formats allow and
    `fuse` asks (the device's ops say: `Ops.fuse_projections`)."""

    def __init__(self, linears: list[Linear], fuse: bool = True):
        self.sizes = [l.weight.shape[0] for l in linears]
        self.fused = fuse_linears(linears) if fuse else None
        self.parts = None if self.fused else linears
        self.splits = [sum(self.sizes[: i + 1]) for i in range(len(self.sizes) - 1)]

    def __call__(self, x: mx.array) -> list[mx.array]:
        if self.fused is not None:
            return mx.split(self.fused(x), self.splits, axis=-1)
        return [l(x) for l in self.parts]

    def swiglu(self, x: mx.array) -> mx.array:
        """silu(gate) * up of a gate and an up projection (in that order)."""
        if self.fused is not None:
            return self.fused.swiglu(x)
        return swiglu(*self(x))


class Rope:
    """Rotary position embedding of a head's first `config.rope_dims` dims (all but Phi-4-mini's
    tail), with the default, linear, Llama-3, LongRoPE or YaRN frequency schedule; the last
    two also scale the rotated dims by their attention factor (`weights.rope`)."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.dims = config.rope_dims
        self.traditional = config.rope_traditional
        self.base: float | None = config.rope_theta
        self.scale = 1.0
        self.freqs = None
        self.attention_scale = None  # per-dim factor after the rotation, where the schedule has one
        scaling = config.rope_scaling or {}
        kind = scaling.get("rope_type", "default")
        if kind == "linear":
            self.scale = 1.0 / scaling["factor"]
        elif kind == "llama3":
            self.freqs = llama3_frequencies(self.dims, config.rope_theta, scaling)
            self.base = None
        elif kind == "freq_factors":  # GGUF's rope_freqs: each rotation frequency divided by its factor
            periods = config.rope_theta ** (mx.arange(0, self.dims, 2) / self.dims)
            self.freqs = periods * scaling["factors"].astype(mx.float32)
            self.base = None
        self.use_context(config.max_position_embeddings)

    @property
    def whole_heads(self) -> bool:
        """Whether it turns every dim of a head and scales none (what a fused rope kernel assumes)."""
        return self.dims == self.config.head_dim and self.attention_scale is None

    def use_context(self, tokens: int) -> None:
        """Fit the schedule to a model holding up to `tokens` per sequence (LongRoPE picks its factors by it)."""
        scaled = scaled_rope(self.config, tokens)
        if scaled is None:
            return
        self.freqs, self.base = mx.array(1.0 / scaled.inv_freq), None
        self.attention_scale = None
        if scaled.attention_factor != 1.0:
            rest = self.config.head_dim - self.dims
            self.attention_scale = mx.array([scaled.attention_factor] * self.dims + [1.0] * rest, dtype=mx.float32)

    def __call__(self, x: mx.array, offset) -> mx.array:
        y = mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )
        return y if self.attention_scale is None else y * self.attention_scale.astype(y.dtype)


class NoRope:
    """Attention without positions (SmolLM3's NoPE layers): q and k as projected."""

    whole_heads = False

    def use_context(self, tokens: int) -> None:
        pass

    def __call__(self, x: mx.array, offset) -> mx.array:
        return x


def llama3_frequencies(dims: int, base: float, scaling: dict) -> mx.array:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > old_len / low, freqs * factor, freqs)
    medium = (wavelens > old_len / high) & (wavelens < old_len / low)
    smooth = (old_len / wavelens - low) / (high - low)
    return mx.where(medium, freqs / ((1 - smooth) / factor + smooth), freqs)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up
