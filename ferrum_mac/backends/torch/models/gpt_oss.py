"""gpt-oss (20b, 120b): attention with sinks in alternating windows, experts with biases.

A pre-norm decoder of 128-token sliding-window layers alternating with full attention, YaRN
RoPE, q/k/v/o projections with biases, a learned sink logit per head in every softmax's
denominator (`Attention.sinks`), and a mixture of experts on every layer: a router with a bias
keeps each token's top k experts, weighted by the softmax of their logits; each expert is a
clamped SwiGLU with biases,

    out = down((clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)),  g = min(gate, limit).

Experts are stacked as Qwen3-MoE's (`qwen3_moe`): gate and up fused `(E, 2 * inter, hidden)`
(gate first), down `(E, hidden, inter)`, with their biases, and run by the same routes
(grouped GEMMs, gathered weights for a few pairs, every expert densely for many); attention
takes torch's own ops (Triton's decode kernel takes no sinks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum_mac.backends.torch.layers import RmsNorm, linear
from ferrum_mac.backends.torch.models import llama
from ferrum_mac.backends.torch.models.qwen3_moe import GATHER_MAX_PAIRS, grouped_mm_runs
from ferrum_mac.backends.torch.ops import Ops
from ferrum_mac.backends.torch.weights import TensorSource, to_torch
from ferrum_mac.weights import ModelConfig
from ferrum_mac.weights.gpt_oss import ArrayOps, GptOssMoe, gpt_oss_moe, split_experts


class Router:
    """The top k of the router's logits (it has a bias), weighted by the softmax over those k."""

    def __init__(self, gate, top_k: int):
        self.gate, self.top_k = gate, top_k

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `(T, hidden)` -> expert ids `(T, k)` and their weights `(T, k)`."""
        top, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
        return experts, torch.softmax(top, dim=-1)


class Experts:
    """Every expert's clamped SwiGLU over the token-expert pairs the router chose."""

    def __init__(self, src: TensorSource, prefix: str, moe: GptOssMoe, hidden: int):
        E, inter = moe.num_experts, moe.intermediate_size
        gate, up = (src.take(f"{prefix}.{name}.weight", (E, inter, hidden)) for name in ("gate_proj", "up_proj"))
        gate_bias, up_bias = (src.take(f"{prefix}.{name}.bias", (E, inter)) for name in ("gate_proj", "up_proj"))
        self.gate_up, self.gate_up_bias = torch.cat([gate, up], dim=1), torch.cat([gate_bias, up_bias], dim=1)
        self.down = src.take(f"{prefix}.down_proj.weight", (E, hidden, inter))
        self.down_bias = src.take(f"{prefix}.down_proj.bias", (E, hidden))
        self.num_experts, self.inter, self.alpha, self.limit = E, inter, moe.swiglu_alpha, moe.swiglu_limit
        self.grouped_ok = grouped_mm_runs(self.gate_up)
        self.forced_route = src.options.torch_moe_route  # as Qwen3-MoE's (FERRUM_TORCH_MOE_ROUTE)

    def route(self, pairs: int) -> str:
        if self.forced_route:
            return self.forced_route
        if self.grouped_ok:
            return "grouped"
        return "gathered" if pairs <= GATHER_MAX_PAIRS else "dense"

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `(T, hidden)`, experts/weights `(T, k)` -> sum over k of weight * expert(x), `(T, hidden)`."""
        route = self.route(experts.numel())
        if route == "dense":
            return self.dense(x, experts, weights)
        pairs = self.grouped if route == "grouped" else self.gathered
        T, k = experts.shape
        return pairs(x, experts.reshape(-1), weights.reshape(-1)).view(T, k, -1).sum(dim=1)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., : self.inter].clamp(max=self.limit)
        up = gate_up[..., self.inter :].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def grouped(self, x, experts, weights) -> torch.Tensor:
        """Pairs in (token, slot) order -> `(T*k, hidden)` outputs, through sorted grouped GEMMs."""
        k = experts.numel() // x.shape[0]
        order = experts.argsort()
        ids = experts[order]
        ends = torch.searchsorted(ids, torch.arange(self.num_experts, device=ids.device), right=True).int()
        gate_up = F.grouped_mm(x[order // k], self.gate_up.transpose(1, 2), offs=ends) + self.gate_up_bias[ids]
        y = F.grouped_mm(self.activation(gate_up), self.down.transpose(1, 2), offs=ends) + self.down_bias[ids]
        y = y * weights[order, None]
        return torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order

    def gathered(self, x, experts, weights) -> torch.Tensor:
        (T, hidden), k = x.shape, experts.numel() // x.shape[0]
        rows = x[:, None, :].expand(T, k, hidden).reshape(T * k, hidden, 1)
        gate_up = torch.bmm(self.gate_up[experts], rows)[..., 0] + self.gate_up_bias[experts]
        y = torch.bmm(self.down[experts], self.activation(gate_up)[:, :, None])[..., 0] + self.down_bias[experts]
        return y * weights[:, None]

    def dense(self, x, experts, weights) -> torch.Tensor:
        """Every expert over every token, weighted by a `(T, E)` routing matrix (zero where not chosen)."""
        T, E = x.shape[0], self.num_experts
        routing = torch.zeros(T, E, dtype=x.dtype, device=x.device).scatter_(1, experts, weights)
        gate_up = F.linear(x, self.gate_up.view(E * 2 * self.inter, -1)).view(T, E, -1) + self.gate_up_bias
        y = torch.einsum("ehi,tei->teh", self.down, self.activation(gate_up)) + self.down_bias
        return (y * routing[:, :, None]).sum(dim=1)


class MoeBlock:
    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, moe: GptOssMoe):
        p = f"layers.{layer}.mlp"
        self.router = Router(linear(src, f"{p}.router", moe.num_experts, config.hidden_size, bias=True), moe.top_k)
        self.experts = Experts(src, f"{p}.experts", moe, config.hidden_size)

    def __call__(self, h: torch.Tensor, norm: RmsNorm, ops: Ops) -> torch.Tensor:
        """h + moe(norm(h)), h `(T, hidden)`."""
        x = ops.rms_norm(h, norm)
        experts, weights = self.router(x)
        return h + self.experts(x, experts, weights)


TORCH_ARRAYS = ArrayOps(
    swapped=lambda a: to_torch(a).transpose(-1, -2),
    copied=lambda a: to_torch(a).contiguous(),
    to_numpy=lambda a: to_torch(a).cpu().numpy(),
    from_numpy=torch.from_numpy,
)


class Model(llama.Model):
    """The Llama decoder (its attention with biases and sinks) with gpt-oss's MoE on every layer."""

    def __init__(self, src: TensorSource, config: ModelConfig):
        self.moe = gpt_oss_moe(config)
        split_experts(src.tensors, config.num_layers, TORCH_ARRAYS)
        super().__init__(src, config)

    def make_mlp(self, src: TensorSource, layer: int):
        return MoeBlock(src, self.config, layer, self.moe)
