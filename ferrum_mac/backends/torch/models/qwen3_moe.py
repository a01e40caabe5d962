"""Qwen3-MoE (Qwen3-30B-A3B and kin): the Qwen3 decoder whose MLP is, on sparse layers, a
mixture of experts. A router scores every expert per token (softmax over `num_experts`
gate logits), keeps the top `num_experts_per_tok` (optionally renormalised to sum to one)
and mixes those experts' SwiGLU outputs by their scores.

Experts are stacked: gate and up fused as `(E, 2 * inter, hidden)` (gate first, which is
transformers 5's own layout, taken without a copy), down as `(E, hidden, inter)`. Every
route below stays on the device with shapes fixed by the token count: no host sync, so a
decode step with experts can be captured as a CUDA graph.

- grouped: token-expert pairs sorted by expert, one `F.grouped_mm` per projection; each
  used expert's weights are read once. Used wherever grouped_mm runs (torch >= 2.10 on
  the CPU, or bf16 on an SM80+ GPU).
- gathered: the chosen experts' weights gathered per pair, then a batched matmul
  (gpt-fast's way); for a few pairs where grouped_mm is unavailable.
- dense: every expert over every token, weighted by a mostly-zero `(T, E)` routing matrix;
  reads each expert once, for many pairs where grouped_mm is unavailable.

In a CUDA decode step, at decode sizes, the whole block is three `triton_moe` kernels
instead (`ops.TritonOps.sparse_moe`): gate projection with the router, gate_up with SwiGLU,
down with the sum over k and the residual add; over packed experts the last two are the FMA
GEMV's, a token-expert pair at a time (`triton_quant.experts_plus`). A forced route
(FERRUM_TORCH_MOE_ROUTE) or FERRUM_TORCH_TRITON=0 keeps torch.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from ferrum_mac.backends.torch.layers import Linear, RmsNorm, linear
from ferrum_mac.backends.torch.models import llama
from ferrum_mac.backends.torch.ops import Ops
from ferrum_mac.backends.torch.weights import TensorSource
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.moe import MoeConfig, moe_config

# At most this many token-expert pairs use gathered weights when grouped_mm is unavailable.
GATHER_MAX_PAIRS = 64


def grouped_mm_runs(weight: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    if weight.device.type == "cpu":
        return True
    return (
        weight.device.type == "cuda"
        and weight.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(weight.device) >= (8, 0)
    )


def expert_weights(src: TensorSource, prefix: str, moe: MoeConfig, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up `(E, 2I, H)` and down `(E, H, I)` from any checkpoint layout."""
    E, inter = moe.num_experts, moe.intermediate_size
    if src.has(f"{prefix}.experts.gate_up_proj"):  # transformers 5, in memory and saved as-is
        gate_up = src.take(f"{prefix}.experts.gate_up_proj", (E, 2 * inter, hidden))
        return gate_up, src.take(f"{prefix}.experts.down_proj", (E, hidden, inter))
    if src.has(f"{prefix}.switch_mlp.gate_proj.weight"):  # mlx-lm conversions and GGUF (maybe quantized)
        shapes = {"gate_proj": (E, inter, hidden), "up_proj": (E, inter, hidden), "down_proj": (E, hidden, inter)}
        gate, up, down = (src.take(f"{prefix}.switch_mlp.{name}.weight", shape) for name, shape in shapes.items())
    else:  # one tensor per expert (released Hugging Face checkpoints)

        def stacked(name, shape):
            return torch.stack([src.take(f"{prefix}.experts.{e}.{name}.weight", shape) for e in range(E)])

        gate, up = stacked("gate_proj", (inter, hidden)), stacked("up_proj", (inter, hidden))
        down = stacked("down_proj", (hidden, inter))
    return torch.cat([gate, up], dim=1), down


class Router:
    """Softmax over the experts' gate logits in float32, then the top k, optionally renormalised."""

    def __init__(self, gate: Linear, top_k: int, renormalise: bool):
        self.gate, self.top_k, self.renormalise = gate, top_k, renormalise

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `(T, hidden)` -> expert ids `(T, k)` and their weights `(T, k)` in x's dtype."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)


def packed_expert_weights(src: TensorSource, prefix: str, moe: MoeConfig, hidden: int):
    """gate_up `(E, 2I, H)` and down `(E, H, I)` kept packed (`quant.ExpertStack`), where an
    mlx-lm or GGUF checkpoint quantized its experts or `on_the_fly` asks; else None."""
    from ferrum_mac.backends.torch.quant import (
        ON_THE_FLY,
        ON_THE_FLY_GROUP,
        ExpertStack,
        per_expert_concatenated,
        quantize,
    )

    E, inter, name = moe.num_experts, moe.intermediate_size, f"{prefix}.switch_mlp"
    if not src.has(f"{name}.gate_proj.weight"):  # the dense layouts, quantized here if asked
        if not src.on_the_fly or hidden % ON_THE_FLY_GROUP or inter % ON_THE_FLY_GROUP:
            return None
        bits = ON_THE_FLY[src.on_the_fly]
        stacks = expert_weights(src, prefix, moe, hidden)
        return tuple(ExpertStack(quantize(w.reshape(-1, w.shape[-1]), bits), E, src.dtype) for w in stacks)
    shapes = {"gate_proj": (E, inter, hidden), "up_proj": (E, inter, hidden), "down_proj": (E, hidden, inter)}
    gate, up, down = (src.packed(f"{name}.{part}", shape) for part, shape in shapes.items())
    if gate is None or up is None or down is None:
        return None
    gate_up = per_expert_concatenated([gate, up], E)  # each expert's gate rows, then its up rows
    if gate_up is None:
        return None
    return ExpertStack(gate_up, E, src.dtype), ExpertStack(down, E, src.dtype)


class Experts:
    """Every expert's SwiGLU MLP over the token-expert pairs the router chose. The router's
    weight scales each pair before the (linear) down projection, in SwiGLU's kernel. Packed
    experts (`quant.ExpertStack`) are dequantized as used: the chosen ones (gathered), or all."""

    def __init__(self, src: TensorSource, prefix: str, moe: MoeConfig, hidden: int):
        self.packed = packed_expert_weights(src, prefix, moe, hidden)
        self.gate_up, self.down = self.packed or expert_weights(src, prefix, moe, hidden)
        self.num_experts, self.inter = moe.num_experts, moe.intermediate_size
        self.grouped_ok = grouped_mm_runs(torch.empty(0, dtype=src.dtype, device=src.device))
        # A route forced ("grouped", "gathered" or "dense": FERRUM_TORCH_MOE_ROUTE) for A/B timing
        # and tests; "" chooses per step.
        self.forced_route = src.options.torch_moe_route

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's gate_up and down, dense."""
        if self.packed:
            return self.gate_up.dense(), self.down.dense()
        return self.gate_up, self.down

    def chosen(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up and down of the `experts` (one per pair), dense."""
        if self.packed:
            return self.gate_up.chosen(experts), self.down.chosen(experts)
        return self.gate_up[experts], self.down[experts]

    def route(self, pairs: int) -> str:
        if self.forced_route:
            return self.forced_route
        if self.packed and pairs <= GATHER_MAX_PAIRS:  # dequantizes only the chosen experts
            return "gathered"
        if self.grouped_ok:
            return "grouped"
        return "gathered" if pairs <= GATHER_MAX_PAIRS else "dense"

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, ops: Ops) -> torch.Tensor:
        """x `(T, hidden)`, experts/weights `(T, k)` -> sum over k of weight * expert(x), `(T, hidden)`."""
        route = self.route(experts.numel())
        if route == "dense":
            return self.dense(x, experts, weights, ops)
        pairs = self.grouped if route == "grouped" else self.gathered
        T, k = experts.shape
        return pairs(x, experts.reshape(-1), weights.reshape(-1), ops).view(T, k, -1).sum(dim=1)

    def grouped(self, x, experts, weights, ops: Ops) -> torch.Tensor:
        """Pairs in (token, slot) order -> `(T*k, hidden)` outputs, through sorted grouped GEMMs."""
        k = experts.numel() // x.shape[0]
        order = experts.argsort()
        ids = experts[order]
        ends = torch.searchsorted(ids, torch.arange(self.num_experts, device=ids.device), right=True).int()
        rows = x[order // k]
        gate_up, down = self.stacks()
        a = ops.swiglu(F.grouped_mm(rows, gate_up.transpose(1, 2), offs=ends), weights[order, None])
        y = F.grouped_mm(a, down.transpose(1, 2), offs=ends)
        return torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order

    def gathered(self, x, experts, weights, ops: Ops) -> torch.Tensor:
        (T, hidden), k = x.shape, experts.numel() // x.shape[0]
        rows = x[:, None, :].expand(T, k, hidden).reshape(T * k, hidden, 1)
        gate_up, down = self.chosen(experts)
        a = ops.swiglu(torch.bmm(gate_up, rows)[..., 0], weights[:, None])
        return torch.bmm(down, a[:, :, None])[..., 0]

    def dense(self, x, experts, weights, ops: Ops) -> torch.Tensor:
        T, E = x.shape[0], self.num_experts
        routing = torch.zeros(T, E, dtype=x.dtype, device=x.device).scatter_(1, experts, weights)
        gate_up, down = self.stacks()
        gate_up = F.linear(x, gate_up.view(E * 2 * self.inter, -1)).view(T, E, -1)
        a = ops.swiglu(gate_up, routing[:, :, None])  # (T, E, I), zero for experts not chosen
        return torch.bmm(down, a.permute(1, 2, 0)).sum(dim=0).t()


class SparseMoe:
    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, moe: MoeConfig):
        p = f"layers.{layer}.mlp"
        self.router = Router(
            linear(src, f"{p}.gate", moe.num_experts, config.hidden_size), moe.top_k, moe.norm_topk_prob
        )
        self.experts = Experts(src, p, moe, config.hidden_size)

    def __call__(self, h: torch.Tensor, norm: RmsNorm, ops: Ops) -> torch.Tensor:
        """h + moe(norm(h)), h `(T, hidden)`: the router's top k experts of each token, mixed."""
        return ops.sparse_moe(self, ops.rms_norm(h, norm), h)


class Model(llama.Model):
    """The Llama/Qwen3 decoder with a sparse MoE block on every sparse layer."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        self.moe = moe_config(config)
        super().__init__(src, config)

    def make_mlp(self, src: TensorSource, layer: int):
        if self.moe.is_sparse(layer):
            return SparseMoe(src, self.config, layer, self.moe)
        return super().make_mlp(src, layer)
