"""Qwen3-MoE (Qwen3-30B-A3B and kin): the Qwen3 decoder whose MLP is, on sparse layers, a
mixture of experts. A router scores every expert per token (softmax over `num_experts`
gate logits), keeps the top `num_experts_per_tok` (optionally renormalised to sum to one)
and mixes those experts' SwiGLU outputs by their scores.

Experts are stacked `(E, out, in)` and run with one gathered matmul per projection for all
tokens of a forward (`mx.gather_mm`, or `mx.gather_qmm` when MLX-quantized); gate and up
are fused along the out dim at load. Routing stays on the device: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from ferrum_mac.backends.mlx.layers import Linear, TensorSource
from ferrum_mac.backends.mlx.models import llama
from ferrum_mac.errors import CorruptModelError
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.moe import MoeConfig, moe_config  # noqa: F401  (the MoE keys of any checkpoint)

if TYPE_CHECKING:
    from ferrum_mac.backends.mlx.ops import Ops

# From this many token-expert pairs on (prefill, large batches), sort the pairs by expert
# so each expert's weights are read once for all of its tokens.
SORT_MIN_PAIRS = 64
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


# -- loading: every checkpoint layout -> mlp.switch_mlp.{gate,up,down}_proj (E, out, in) ----


def sanitize(tensors: dict, config: ModelConfig, moe: MoeConfig) -> None:
    """Stack HF per-expert tensors, or split transformers 5's fused ones, into `switch_mlp` names, in place."""
    for layer in range(config.num_layers):
        p = f"layers.{layer}.mlp"
        if f"{p}.experts.gate_up_proj" in tensors:
            # transformers 5: gate_up (E, 2I, H) with gate first; down (E, H, I)
            gate_up = tensors.pop(f"{p}.experts.gate_up_proj")
            half = gate_up.shape[1] // 2
            tensors[f"{p}.switch_mlp.gate_proj.weight"] = gate_up[:, :half]
            tensors[f"{p}.switch_mlp.up_proj.weight"] = gate_up[:, half:]
            tensors[f"{p}.switch_mlp.down_proj.weight"] = tensors.pop(f"{p}.experts.down_proj")
        elif f"{p}.experts.0.gate_proj.weight" in tensors:
            for proj in PROJECTIONS:
                names = [f"{p}.experts.{e}.{proj}.weight" for e in range(moe.num_experts)]
                missing = [n for n in names if n not in tensors]
                if missing:
                    raise CorruptModelError(f"the checkpoint lacks expert tensor {missing[0]!r}; it is incomplete")
                tensors[f"{p}.switch_mlp.{proj}.weight"] = mx.stack([tensors.pop(n) for n in names])


@dataclass
class ExpertLinear:
    """The same linear of every expert, stacked `(E, out, in)`: dense or affine-quantized."""

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"  # or "mxfp4" (gpt-oss's experts: e2m1 values, a power-of-two scale per 32, no biases)

    def __call__(self, x: mx.array, experts: mx.array, sorted_indices: bool) -> mx.array:
        """x `(..., 1, in)` times the weight of `experts[...]` -> `(..., 1, out)`."""
        if self.scales is not None:
            return mx.gather_qmm(
                x,
                self.weight,
                self.scales,
                self.biases,
                rhs_indices=experts,
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
                sorted_indices=sorted_indices,
            )
        w = self.weight.swapaxes(-1, -2)
        if w.dtype == x.dtype:
            return mx.gather_mm(x, w, rhs_indices=experts, sorted_indices=sorted_indices)
        y = mx.gather_mm(x.astype(w.dtype), w, rhs_indices=experts, sorted_indices=sorted_indices)  # CPU: float32
        return y.astype(x.dtype)

    def format(self) -> tuple:
        return (self.scales is None, self.group_size, self.bits, self.mode)


def expert_linear(src: TensorSource, module: str, experts: int, out_dim: int, in_dim: int) -> ExpertLinear:
    quant = src.config.quant_for(module)
    if quant is None and src.has(f"{module}.scales"):  # MXFP4 blocks (gpt-oss's own), kept packed
        return ExpertLinear(
            src.take(f"{module}.weight", (experts, out_dim, in_dim // 8), cast=False),
            src.take(f"{module}.scales", (experts, out_dim, in_dim // 32), cast=False),
            group_size=32,
            bits=4,
            mode="mxfp4",
        )
    if quant is None:
        return ExpertLinear(src.ops.expert_weights(src.take(f"{module}.weight", (experts, out_dim, in_dim))))
    group, bits = quant["group_size"], quant["bits"]
    grouped = (experts, out_dim, in_dim // group)
    return ExpertLinear(
        src.take(f"{module}.weight", (experts, out_dim, in_dim * bits // 32), cast=False),
        src.take(f"{module}.scales", grouped),
        src.take(f"{module}.biases", grouped),
        group,
        bits,
    )


def stack_outputs(a: ExpertLinear, b: ExpertLinear) -> ExpertLinear:
    """One expert linear computing [a; b]: concatenated along the out dim (quant groups run along in)."""

    def cat(name):
        parts = (getattr(a, name), getattr(b, name))
        return None if parts[0] is None else mx.concatenate(parts, axis=1)

    return ExpertLinear(cat("weight"), cat("scales"), cat("biases"), a.group_size, a.bits, a.mode)


# -- the sparse MoE block ---------------------------------------------------------------


@partial(mx.compile, shapeless=True)
def weighted_swiglu(gate: mx.array, up: mx.array, weights: mx.array) -> mx.array:
    # The router weight is applied before the (linear) down projection: one fused kernel.
    return nn.silu(gate) * up * weights


class Router:
    """Softmax over the experts' gate logits, then the top k, optionally renormalised."""

    def __init__(self, gate: Linear, top_k: int, renormalise: bool, ops: "Ops"):
        self.gate, self.top_k, self.renormalise, self.ops = gate, top_k, renormalise, ops

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x `(T, hidden)` -> expert ids `(T, k)` and their weights `(T, k)`."""
        return self.ops.route(self, self.gate(x), x.dtype)

    def route(self, logits: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Softmax is monotonic, so the top k of the logits are the top k of the probabilities,
        and renormalised top-k probabilities are the softmax of the top-k logits: four
        kernels, and no ties from rounding probabilities to bf16."""
        experts = mx.argpartition(logits, kth=-self.top_k, axis=-1)[:, -self.top_k :]
        top = mx.take_along_axis(logits, experts, axis=-1)
        if self.renormalise:
            return experts, mx.softmax(top, axis=-1, precise=True)
        log_z = mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
        return experts, mx.exp(top.astype(mx.float32) - log_z).astype(dtype)


class Experts:
    """Every expert's SwiGLU MLP; each projection is one gathered matmul over all tokens."""

    def __init__(self, src: TensorSource, prefix: str, moe: MoeConfig, hidden: int):
        E, inter = moe.num_experts, moe.intermediate_size
        gate = expert_linear(src, f"{prefix}.gate_proj", E, inter, hidden)
        up = expert_linear(src, f"{prefix}.up_proj", E, inter, hidden)
        self.down = expert_linear(src, f"{prefix}.down_proj", E, hidden, inter)
        fusable = gate.format() == up.format()
        self.gate_up = stack_outputs(gate, up) if fusable else None
        self.gate, self.up = (None, None) if fusable else (gate, up)
        self.inter, self.hidden = inter, hidden
        self.ops = src.ops

    def __call__(self, x: mx.array, experts: mx.array, weights: mx.array) -> mx.array:
        """x `(T, hidden)`, experts/weights `(T, k)` -> sum over k of weight * expert(x), `(T, hidden)`."""
        return self.ops.mix_experts(self, x, experts, weights)

    def mix(self, x: mx.array, experts: mx.array, weights: mx.array) -> mx.array:
        """`__call__` by MLX's gathered matmuls."""
        T, k = experts.shape
        if experts.size < SORT_MIN_PAIRS:
            # Every token row meets each of its k experts: (T, 1, 1, H) x (T, k) -> (T, k, 1, H)
            y = self.gathered_mlp(x[:, None, None, :], experts, weights[..., None, None], sorted_indices=False)
            return y.sum(axis=1)[:, 0, :]
        flat = experts.reshape(-1)
        order = mx.argsort(flat)  # token-expert pairs grouped by expert
        rows, pair_weights = x[order // k][:, None, :], weights.reshape(-1)[order][:, None, None]
        y = self.gathered_mlp(rows, flat[order], pair_weights, sorted_indices=True)
        y = y[mx.argsort(order)]  # back to (token, slot) order
        return y.reshape(T, k, -1).sum(axis=1)

    def gathered_mlp(self, x: mx.array, experts: mx.array, weights: mx.array, sorted_indices: bool) -> mx.array:
        if self.gate_up is not None:
            gate_up = self.gate_up(x, experts, sorted_indices)
            gate, up = gate_up[..., : self.inter], gate_up[..., self.inter :]
        else:
            gate, up = self.gate(x, experts, sorted_indices), self.up(x, experts, sorted_indices)
        return self.down(weighted_swiglu(gate, up, weights), experts, sorted_indices)


class SparseMoe:
    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, moe: MoeConfig):
        p = f"layers.{layer}.mlp"
        gate = src.ops.router_gate(src.linear(f"{p}.gate", moe.num_experts, config.hidden_size))
        self.router = Router(gate, moe.top_k, moe.norm_topk_prob, src.ops)
        self.experts = Experts(src, f"{p}.switch_mlp", moe, config.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.router(flat)
        return self.experts(flat, experts, weights).reshape(x.shape)


class Model(llama.Model):
    """The Llama/Qwen3 decoder with a sparse MoE block on every sparse layer."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        self.moe = moe_config(config)
        sanitize(src.tensors, config, self.moe)
        super().__init__(src, config)

    def make_mlp(self, src: TensorSource, layer: int):
        if self.moe.is_sparse(layer):
            return SparseMoe(src, self.config, layer, self.moe)
        return super().make_mlp(src, layer)
