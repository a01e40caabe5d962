"""Attention over a batch of sequence segments, each reading and writing its own KV cache.

Every forward runs on a flat batch of `T` token rows. A plan says which rows belong to
which sequence and at which positions; projections and RoPE run once over all rows, then
the plan writes each sequence's keys/values to its cache and attends.

- `Plan`: segments of any length at host-known offsets (prefill, verify, mixed batches).
  Exact-length attention; causal within a segment.
- `DecodePlan`: one token per sequence with positions in a device tensor, every shape
  fixed by the caches' allocations. Nothing reads a position on the host, so the step can
  be captured once as a CUDA graph and replayed at any position.

Grouped-query attention: a kv head serves `heads / kv_heads` consecutive query heads. A
decode step folds those into the query length, `(kv_heads, group, dim)`, so it attends as
plain multi-head attention with no repeated keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferrum_mac.backends.torch.kv import SequenceCache
from ferrum_mac.backends.torch.layers import Rope, fuse, linear
from ferrum_mac.backends.torch.pointwise import norm_and_rope
from ferrum_mac.backends.torch.weights import TensorSource
from ferrum_mac.weights import ModelConfig


class Attention:
    """q/k/v as one fused projection, optional q/k RMSNorm (Qwen3), RoPE, then the plan's attention.

    q and k sit side by side in the projection's output, so their norm and rotation run
    once over all `heads + kv_heads` heads (each head normed with its own side's weight)."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int, rope: Rope):
        p, c = f"layers.{layer}.self_attn", config
        self.layer, self.rope = layer, rope
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv = fuse(
            [
                linear(src, f"{p}.q_proj", q_out, c.hidden_size, c.qkv_bias),
                linear(src, f"{p}.k_proj", kv_out, c.hidden_size, c.qkv_bias),
                linear(src, f"{p}.v_proj", kv_out, c.hidden_size, c.qkv_bias),
            ]
        )
        self.o_proj = linear(src, f"{p}.o_proj", c.hidden_size, q_out, c.o_bias)
        self.qk_norm = None
        if c.qk_norm:  # (heads + kv_heads, dim): q_norm's weight for query heads, k_norm's for key heads
            q_norm, k_norm = src.norm(f"{p}.q_norm", c.head_dim), src.norm(f"{p}.k_norm", c.head_dim)
            self.qk_norm = torch.cat([q_norm.expand(c.num_heads, -1), k_norm.expand(c.num_kv_heads, -1)])
        self.eps = c.rms_norm_eps

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, plan, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """residual + attention(x): x `(T, hidden)` already normed."""
        q, k, v = self.project(x, cos, sin)
        return self.o_proj.plus(plan.attend(self.layer, q, k, v, self.scale), residual)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> roped q `(T, heads, dim)`, roped k and v `(T, kv_heads, dim)`."""
        qkv = self.qkv(x)
        qk_width = (self.heads + self.kv_heads) * self.head_dim
        qk = qkv[:, :qk_width].unflatten(-1, (self.heads + self.kv_heads, self.head_dim))
        v = qkv[:, qk_width:].unflatten(-1, (self.kv_heads, self.head_dim))
        qk = norm_and_rope(qk, self.qk_norm, cos, sin, self.eps, self.rope.interleaved)
        return qk[:, : self.heads], qk[:, self.heads :], v


@dataclass
class Segment:
    cache: SequenceCache
    start: int  # its first row in the flat batch
    length: int
    offset: int  # absolute position of its first token


class Plan:
    def __init__(self, segments: list[Segment], device: torch.device):
        self.segments = segments
        self.total = sum(s.length for s in segments)
        self.positions = torch.cat([torch.arange(s.offset, s.offset + s.length, device=device) for s in segments])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q `(T, heads, dim)`, k/v `(T, kv_heads, dim)` -> `(T, heads * dim)`."""
        outs = []
        for seg in self.segments:
            rows = slice(seg.start, seg.start + seg.length)
            outs.append(self._attend_segment(layer, q[rows], k[rows], v[rows], seg, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _attend_segment(layer, q, k, v, seg: Segment, scale: float) -> torch.Tensor:
        end = seg.offset + seg.length
        keys, values = seg.cache.keys(layer), seg.cache.values(layer)
        keys[:, seg.offset : end] = k.transpose(0, 1)
        values[:, seg.offset : end] = v.transpose(0, 1)
        mask, causal = None, False
        if seg.length > 1 and seg.offset == 0:
            causal = True
        elif seg.length > 1:  # a chunk after cached tokens: query i sees keys up to offset + i
            rows = torch.arange(seg.offset, end, device=q.device)[:, None]
            mask = torch.arange(end, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None, :, :end], values[None, :, :end],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
        )  # fmt: skip
        return out[0].transpose(0, 1).reshape(seg.length, -1)


class DecodePlan:
    """Row `i` is the next token of `caches[i]`, at position `positions[i]` (a device tensor)."""

    def __init__(self, caches: list[SequenceCache], positions: torch.Tensor, dtype: torch.dtype):
        self.caches = caches
        self.positions = positions
        self.total = len(caches)
        self.rows = [positions[i : i + 1] for i in range(len(caches))]
        # Which slots each row sees: an additive bias over the whole allocation instead of a
        # length known on the host. Built once per step, shared by every layer.
        spans = {c.allocated: torch.arange(c.allocated, device=positions.device) for c in caches}
        self.biases = [attention_bias(spans[c.allocated] <= positions[i], dtype) for i, c in enumerate(caches)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        kv_heads, dim = k.shape[1], k.shape[2]
        outs = []
        for i, cache in enumerate(self.caches):
            keys, values = cache.keys(layer), cache.values(layer)
            keys.index_copy_(1, self.rows[i], k[i].unsqueeze(1))
            values.index_copy_(1, self.rows[i], v[i].unsqueeze(1))
            grouped_q = q[i].reshape(1, kv_heads, -1, dim)  # (1, kv_heads, group, dim)
            outs.append(
                F.scaled_dot_product_attention(grouped_q, keys[None], values[None], attn_mask=self.biases[i], scale=scale)
            )
        return (outs[0] if len(outs) == 1 else torch.stack(outs)).reshape(self.total, -1)


def attention_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(1, 1, 1, S)`: 0 where `visible`, -inf elsewhere."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    return bias.view(1, 1, 1, -1)
