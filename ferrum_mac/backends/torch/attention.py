"""Attention over a batch of sequence segments, each reading and writing its own KV cache.

Every forward runs on a flat batch of `T` token rows. A plan says which rows belong to
which sequence and at which positions; projections and RoPE run once over all rows, then
the plan writes each sequence's keys/values to its cache and attends.

- `Plan`: segments of any length at host-known offsets (prefill, verify, mixed batches).
  Exact-length attention; causal within a segment.
- `DecodePlan`: one token per sequence, positions and block tables in device tensors, every
  shape fixed by the pool and the table's `(rows, width)`. Nothing reads a position on the
  host, so the step can be captured once as a CUDA graph and replayed at any position; the
  batch writes its keys/values with one kernel and attends with one. With Triton's ops (a CUDA
  decode step: `ops.TritonOps.attention`) one Triton kernel norms and ropes q/k and writes
  k/v into the pool (for a few rows the same kernel also norms the block's input and runs
  the qkv projection: `triton_qkv`), and attention reads each row's keys up to its
  position through its block table, no further.

Each plan carries the ops its forward runs (`ops.py`): torch's own for a `Plan`, the
decode step's for a `DecodePlan`.

Grouped-query attention: a kv head serves `heads / kv_heads` consecutive query heads. A
decode step folds those into the query length, `(kv_heads, group, dim)`, so it attends as
plain multi-head attention with no repeated keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferrum_mac.backends.torch.kv import KvManager, SequenceBlocks
from ferrum_mac.backends.torch.layers import RmsNorm, Rope, fuse, linear
from ferrum_mac.backends.torch.ops import TORCH_OPS, Ops
from ferrum_mac.backends.torch.pointwise import norm_and_rope
from ferrum_mac.backends.torch.weights import TensorSource
from ferrum_mac.weights import ModelConfig


class Attention:
    """The block's input norm and q/k/v as one fused projection, optional q/k RMSNorm (Qwen3),
    RoPE, then the plan's attention (as the plan's ops run them: `Ops.attention`).

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
        # A sliding window (0: none), a tanh cap on the scores (Gemma's) and sink logits (one per
        # head, gpt-oss's): Triton's decode attention takes none of them, so such a layer attends
        # by torch's ops (`ops_for`).
        self.window = c.layer_windows[layer] if c.layer_windows else 0
        self.softcap: float | None = None
        self.sinks = src.take(f"{p}.sinks", (c.num_heads,)) if c.attention_sinks else None

    def __call__(self, h: torch.Tensor, norm: RmsNorm, plan, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h + attention(norm(h)), h `(T, hidden)`."""
        out = self.attention(h, norm, plan, cos, sin)
        return plan.ops.matmul_plus(out, self.o_proj, h)

    def attention(self, h: torch.Tensor, norm: RmsNorm, plan, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """attention(norm(h)) `(T, heads * dim)`, over the windowed layers' pool (`plan.windowed`)
        for a windowed layer of a model that has one, and by the ops that take it (`ops_for`)."""
        if self.window and plan.windowed is not None:
            plan = plan.windowed
        return self.ops_for(plan).attention(self, h, norm, plan, cos, sin)

    def ops_for(self, plan) -> Ops:
        """The ops that attend this layer in `plan`: the plan's, or torch's own where they take no
        window, cap or sinks."""
        return TORCH_OPS if plan.ops.triton and (self.window or self.softcap or self.sinks is not None) else plan.ops

    def project(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The qkv projection's output -> roped q `(T, heads, dim)`, roped k and v `(T, kv_heads, dim)`."""
        qk_width = (self.heads + self.kv_heads) * self.head_dim
        qk = qkv[:, :qk_width].unflatten(-1, (self.heads + self.kv_heads, self.head_dim))
        v = qkv[:, qk_width:].unflatten(-1, (self.kv_heads, self.head_dim))
        qk = norm_and_rope(qk, self.qk_norm, cos, sin, self.eps, self.rope.interleaved)
        return qk[:, : self.heads], qk[:, self.heads :], v


@dataclass
class Segment:
    cache: SequenceBlocks
    start: int  # its first row in the flat batch
    length: int
    offset: int  # absolute position of its first token


def positions_rows(seq: SequenceBlocks, start: int, end: int) -> torch.Tensor | slice:
    """The token rows of `seq`'s positions `start .. end - 1`: a slice of the pool's token axis
    where their blocks follow each other, else an index."""
    pool, B = seq.pool, seq.pool.block_tokens
    rows = pool.rows_of(seq.blocks[start // B : -(-end // B)])
    skip = start % B
    if isinstance(rows, slice):
        return slice(rows.start + skip, rows.start + skip + end - start)
    return rows[skip : skip + end - start]


class Plan:
    ops: Ops = TORCH_OPS  # eager steps: torch's own ops
    windowed: "Plan | None" = None  # the same rows over the windowed layers' pool, when the model has one
    recurrent: list | None = None  # each segment's recurrent states (`SequenceRecurrent`), when the model has them

    def __init__(self, segments: list[Segment], device: torch.device):
        self.segments = segments
        self.total = sum(s.length for s in segments)
        self.positions = torch.cat([torch.arange(s.offset, s.offset + s.length, device=device) for s in segments])
        # each segment's rows on the pool's token axis: where it writes, and what it reads (0 .. end)
        self.writes = [positions_rows(s.cache, s.offset, s.offset + s.length) for s in segments]
        self.reads = [positions_rows(s.cache, 0, s.offset + s.length) for s in segments]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q `(T, heads, dim)`, k/v `(T, kv_heads, dim)` -> `(T, heads * dim)`; a `window`
        layer's queries see only the last `window` positions up to their own; `sinks` `(heads,)`
        join each head's softmax."""
        outs = []
        for seg, writes, reads in zip(self.segments, self.writes, self.reads):
            rows = slice(seg.start, seg.start + seg.length)
            kv = seg.cache.pool.kv[layer]  # (2, kv_heads, token rows, dim)
            kv[:, :, writes] = torch.stack((k[rows], v[rows])).transpose(1, 2)
            if window or softcap or sinks is not None:
                outs.append(windowed_segment(q[rows], kv[:, :, reads], seg, scale, window, softcap, sinks))
            else:
                outs.append(self._attend_segment(q[rows], kv[:, :, reads], seg, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _attend_segment(q, kv: torch.Tensor, seg: Segment, scale: float) -> torch.Tensor:
        """q `(length, heads, dim)` over `kv` `(2, kv_heads, offset + length, dim)`, the segment's keys."""
        end = seg.offset + seg.length
        mask, causal = None, False
        if seg.length > 1 and seg.offset == 0:
            causal = True
        elif seg.length > 1:  # a chunk after cached tokens: query i sees keys up to offset + i,
            # which PyTorch's fused kernels take as a causal bias aligned to the last key
            from torch.nn.attention.bias import causal_lower_right  # (imports torch's compiler: only when used)

            mask = causal_lower_right(seg.length, end)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            kv[0][None],
            kv[1][None],
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(seg.length, -1)


class DecodePlan:
    """Row `i` is the next token of a sequence at position `positions[i]`, whose blocks are
    `table[i]` (`(rows, width)`, block 0, the scratch block, past its end and for a row outside
    the batch, whose position is 0). Every shape is fixed by the pool and `(rows, width)`;
    positions and the table are device tensors the host never reads, and where each row's
    key/value goes (`places`) is computed from them on the device, so the step can be
    captured once as a CUDA graph and replayed at any position.

    `ops` run the step: with torch's, `attend` takes roped q, k, v; Triton's take the block's
    input and do the rest in their kernels (`TritonOps.attention`).

    `sequences`: how many sequences the rows belong to (default one a row; a verify's rows
    share one). Attention spreads each row's keys over programs as for a batch of that many,
    so a verify's rows are summed exactly as that sequence's decode steps would be.

    `windowed`: the same rows over the windowed layers' pool (its own tables), when the model has one."""

    windowed: "DecodePlan | None" = None

    def __init__(
        self,
        pool: KvManager,
        table: torch.Tensor,
        positions: torch.Tensor,
        dtype: torch.dtype,
        ops: Ops = TORCH_OPS,
        sequences: int | None = None,
    ):
        self.pool, self.table, self.positions, self.ops = pool, table, positions, ops
        self.total = rows = positions.shape[0]
        self.sequences = sequences or rows
        B, device = pool.block_tokens, positions.device
        # Each (row, kv head)'s place among a layer's `kv_heads * token_rows` key rows.
        block = table.gather(1, (positions // B)[:, None])  # (rows, 1)
        token_row = block * B + positions[:, None] % B
        heads = torch.arange(pool.kv_heads, device=device)[None, :]
        self.places = (heads * pool.token_rows + token_row).reshape(-1)
        self.dtype = dtype
        self.biases: dict[int, torch.Tensor] = {}  # by window (0: none)
        if not ops.triton:  # (Triton's attention reads through the table itself)
            self.window_bias(0)  # built now, once per step: every layer shares it

    @functools.cached_property
    def key_rows(self) -> torch.Tensor:
        """Each row's keys through its table: `(rows, width * B)` token rows."""
        B, rows, width = self.pool.block_tokens, self.total, self.table.shape[1]
        return (self.table[:, :, None] * B + torch.arange(B, device=self.table.device)).reshape(rows, width * B)

    @property
    def bias(self) -> torch.Tensor:
        """Which keys each row sees: an additive bias instead of lengths known on the host."""
        return self.window_bias(0)

    def window_bias(self, window: int) -> torch.Tensor:
        """`bias`, and of those keys only the last `window` up to each row's own (0: all)."""
        if window not in self.biases:
            keys = self.key_rows.shape[1]
            visible = visible_keys(self.positions, torch.arange(keys, device=self.positions.device), window)
            self.biases[window] = attention_bias(visible, self.dtype).view(self.total, 1, 1, keys)
        return self.biases[window]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dim = k.shape[2]
        kv = self.pool.kv[layer]  # (2, kv_heads, token rows, dim)
        kv.view(2, -1, dim)[:, self.places] = torch.stack((k, v)).view(2, -1, dim)
        gathered = kv[:, :, self.key_rows].transpose(1, 2)  # (2, rows, kv_heads, width * B, dim)
        grouped_q = q.reshape(self.total, k.shape[1], -1, dim)  # (rows, kv_heads, group, dim)
        if sinks is not None:  # a query head's sink, where the fold put its scores
            sinks = sinks.view(k.shape[1], -1, 1)
        out = scores_attention(grouped_q, gathered[0], gathered[1], self.window_bias(window), scale, softcap, sinks)
        return out.reshape(self.total, -1)


class FreshPlan:
    """A prompt's first `rows` positions (0 .. rows - 1) in one sequence whose blocks are
    `table` `(width,)`; rows from `count` (a device tensor) on are padding, whose keys go to
    the scratch block. Every shape is fixed by `(rows, width)`, so the forward is captured once
    as a CUDA graph and replayed for any prompt of up to `rows` tokens: a short prompt's
    forward is a few hundred small kernels, whose launches from Python take longer than
    they run. Attention is causal over the prompt's own keys, as nothing precedes them."""

    ops: Ops = TORCH_OPS
    windowed = None  # (a windowed model prefills eagerly)

    def __init__(self, pool: KvManager, table: torch.Tensor, count: torch.Tensor, rows: int):
        self.pool, self.total = pool, rows
        B, device = pool.block_tokens, table.device
        self.positions = torch.arange(rows, device=device)
        real = self.positions < count
        block = torch.where(real, table[(self.positions // B).clamp(max=table.shape[0] - 1)], 0)
        token_row = block * B + torch.where(real, self.positions % B, 0)
        heads = torch.arange(pool.kv_heads, device=device)[None, :]
        self.places = (heads * pool.token_rows + token_row[:, None]).reshape(-1)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dim = k.shape[2]
        self.pool.kv[layer].view(2, -1, dim)[:, self.places] = torch.stack((k, v)).view(2, -1, dim)
        q, k, v = (a.transpose(0, 1)[None] for a in (q, k, v))
        if window or softcap or sinks is not None:
            visible = visible_keys(self.positions, self.positions, window)
            out = scores_attention(q, k, v, visible, scale, softcap, head_sinks(sinks))
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(self.total, -1)


def visible_keys(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """`(queries, keys)` booleans: whether the query at each position of `queries` sees the key
    at each of `keys` (causal, and within the last `window` positions when `window`)."""
    seen = keys[None, :] <= queries[:, None]
    return seen & (keys[None, :] > queries[:, None] - window) if window else seen


def windowed_segment(q, kv: torch.Tensor, seg: Segment, scale: float, window: int, softcap: float | None, sinks=None):
    """`Plan._attend_segment` for a windowed, capped or sunk layer: the keys from the first one
    a query sees (`window` back from the segment's start) on, under a mask."""
    end = seg.offset + seg.length
    first = max(0, seg.offset - window + 1) if window else 0
    positions = torch.arange(seg.offset, end, device=q.device)
    visible = visible_keys(positions, torch.arange(first, end, device=q.device), window)
    keys, values = kv[0][None, :, first:], kv[1][None, :, first:]
    out = scores_attention(q.transpose(0, 1)[None], keys, values, visible, scale, softcap, head_sinks(sinks))
    return out[0].transpose(0, 1).reshape(seg.length, -1)


def scores_attention(
    q, k, v, mask: torch.Tensor, scale: float, softcap: float | None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of q `(..., heads, n, dim)` over k/v `(..., kv_heads, T, dim)` under `mask`
    (boolean, or an additive bias), the scores capped by `softcap` (cap * tanh(s / cap)) when set,
    and `sinks` (broadcast to the scores' `(..., heads, n, 1)`) one more logit in each softmax
    whose weight goes to no value."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def head_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Sinks `(heads,)` as scores `(..., heads, n, T)` broadcast them."""
    return None if sinks is None else sinks.view(-1, 1, 1)


def attention_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `visible`, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
