"""Attention over a batch of sequence segments, each reading and writing its own KV cache.

Every forward runs on a flat row of tokens `(1, T, hidden)`. A `Plan` says which tokens
belong to which sequence: a segment is `length` tokens starting at row `start`, placed at
absolute position `offset` of its cache. Projections run once over all T tokens; RoPE
runs once with per-token positions; attention runs per segment against its cache.
With a single segment (the usual prefill or decode) nothing is sliced.

This is the path of MLX's own ops (Metal's). The device's ops (`ops.py`) choose who runs each
step: `Block` projects through `ops.project(attn, ...)`, and `attend` hands segments and
batches to `ops.attend_segment` and `ops.attend_batch`, which default to the methods here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from ferrum_mac.backends.state.block_pool import SCRATCH
from ferrum_mac.backends.mlx.kv import SequenceCache
from ferrum_mac.backends.mlx.layers import Rope, TensorSource
from ferrum_mac.weights import ModelConfig


@dataclass
class Segment:
    cache: SequenceCache
    start: int
    length: int
    offset: int

    @cached_property
    def write_rows(self) -> slice | mx.array:
        """Where its keys go on the pool's token axis (`SequenceCache.rows`)."""
        return self.cache.rows(self.offset, self.offset + self.length)

    @cached_property
    def read_rows(self) -> slice | mx.array:
        """Where its sequence's keys up to its own are read from."""
        return self.cache.rows(0, self.offset + self.length)

    def first_visible(self, window: int) -> int:
        """The first position a query of this segment sees under a sliding `window` (0: none)."""
        return max(0, self.offset - window + 1) if window else 0

    def mask(self, window: int) -> mx.array | str | None:
        """Which of the keys from `first_visible(window)` on each query sees: query i (position
        offset + i) sees position j where offset + i - window < j <= offset + i."""
        first, end = self.first_visible(window), self.offset + self.length
        if self.length == 1:
            return None
        if not window or end <= window:  # (first is 0: MLX's causal mask, aligned to the last key)
            return "causal"
        masks = self.__dict__.setdefault("masks", {})
        if window not in masks:
            masks[window] = visible_keys(mx.arange(self.offset, end), first, end, window)
        return masks[window]


class Plan:
    """Which rows of the flat batch belong to which sequence. A unified step that prefills
    three tokens of A at cache position 10 and decodes one token each of B and C:

        row         0    1    2    3    4
        sequence    A    A    A    B    C
        positions   10   11   12   7    41
        segments    '---- A ----'  B    C     (start, length, offset): A (0, 3, 10), B (3, 1, 7),
                                              C (4, 1, 41); A attends alone, causal over its cache
        decoding                   '-B,C-'    B and C: one KV write, one attention from the pool
                                              (`decode_rows`: the slice 3:5 of the batch)

    `positions` is a scalar offset for one segment, else one position per token. When two or
    more segments are one token long (a batched decode, or the decode rows of a unified step)
    they attend together: `decoding` lists them, with what attending them together needs."""

    windowed: "Plan | None" = None  # the same rows over the windowed layers' pool, when the model has one
    recurrent: list | None = None  # each segment's recurrent states (`SequenceRecurrent`), when the model has them

    def __init__(self, segments: list[Segment]):
        self.segments = segments
        self.total = sum(s.length for s in segments)
        if len(segments) == 1:
            self.positions = mx.array(segments[0].offset)
        else:  # built on the host: one array, not a node per segment
            self.positions = mx.array([p for s in segments for p in range(s.offset, s.offset + s.length)])
        singles = [s for s in segments if s.length == 1]
        self.decoding = singles if len(singles) > 1 else []
        if self.decoding:
            self.pool = singles[0].cache.pool
            all_singles = len(singles) == len(segments)
            self.decode_positions = self.positions if all_singles else mx.array([s.offset for s in singles])
            rows = mx.array([s.cache.places(s.offset, s.offset + 1)[0] for s in singles])
            self.write_index = self.pool.batch_index(rows)  # shared by every layer
            self.width = max(s.offset for s in singles) + 1
            # The decode rows' place in the flat batch: all of it, a leading run, or scattered.
            self.decode_rows = None if len(singles) == len(segments) else decode_rows(singles)

    @cached_property
    def host_tables(self) -> np.ndarray:
        """The decoding sequences' block tables `(B, blocks)` up to the longest's position,
        shorter ones padded with the scratch block (masked: past their length)."""
        n = self.pool.blocks_for(self.width)
        tables = np.full((len(self.decoding), n), SCRATCH, dtype=np.int32)
        for i, seg in enumerate(self.decoding):
            blocks = seg.cache.blocks[:n]
            tables[i, : len(blocks)] = blocks
        return tables

    @cached_property
    def gather_index(self) -> tuple:
        """Indices gathering each decoding sequence's keys through its block table (`KvManager.gather_index`)."""
        return self.pool.gather_index(self.host_tables)

    @cached_property
    def mask(self) -> mx.array:
        """For the gathered keys of decode rows: each sequence sees its own keys up to its offset."""
        width = self.host_tables.shape[1] * self.pool.block_tokens
        return (mx.arange(width)[None, :] <= self.decode_positions[:, None])[:, None, None, :]

    def window_mask(self, window: int) -> mx.array:
        """`mask`, and of those keys only the last `window` up to each row's own."""
        masks = self.__dict__.setdefault("window_masks", {})
        if window not in masks:
            width = self.host_tables.shape[1] * self.pool.block_tokens
            masks[window] = visible_keys(self.decode_positions, 0, width, window)[:, None, None, :]
        return masks[window]


def visible_keys(positions: mx.array, first: int, end: int, window: int) -> mx.array:
    """`(queries, end - first)` booleans: whether the query at each of `positions` sees the key
    at `first + column` (causal, and within the last `window` positions when `window`)."""
    keys = mx.arange(first, end)[None, :]
    seen = keys <= positions[:, None]
    return seen & (keys > positions[:, None] - window) if window else seen


def decode_rows(singles: list[Segment]) -> slice | mx.array:
    starts = [s.start for s in singles]
    if starts == list(range(starts[0], starts[0] + len(starts))):
        return slice(starts[0], starts[0] + len(starts))
    return mx.array(starts)


class Attention:
    """`project` (norms, q/k/v, RoPE) is pure and may be compiled; `attend` touches the caches."""

    def __init__(self, src: TensorSource, config: ModelConfig, layer: int):
        p = f"layers.{layer}.self_attn"
        c = config
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv = src.projections(
            [
                src.linear(f"{p}.q_proj", q_out, c.hidden_size, c.qkv_bias),
                src.linear(f"{p}.k_proj", kv_out, c.hidden_size, c.qkv_bias),
                src.linear(f"{p}.v_proj", kv_out, c.hidden_size, c.qkv_bias),
            ]
        )
        self.o_proj = src.linear(f"{p}.o_proj", c.hidden_size, q_out, c.o_bias)
        self.q_norm = src.norm(f"{p}.q_norm", c.head_dim) if c.qk_norm else None
        self.k_norm = src.norm(f"{p}.k_norm", c.head_dim) if c.qk_norm else None
        self.eps = c.rms_norm_eps
        self.rope = Rope(config)
        self.ops = src.ops  # the device's routes: `ops.project(self, ...)` is `self.project(...)` here
        # A sliding window (0: none), a tanh cap on the scores (Gemma's) and sink logits (one per
        # head, gpt-oss's): the device's kernels take none of them, so such a layer attends by
        # this module's ops (`routes`).
        self.window = c.layer_windows[layer] if c.layer_windows else 0
        self.softcap: float | None = None
        self.sinks = src.take(f"{p}.sinks", (c.num_heads,)) if c.attention_sinks else None

    @property
    def routes(self):
        """Who attends this layer: the device's ops, or MLX's own here for what they do not take."""
        return PLAIN_ROUTES if self.window or self.softcap or self.sinks is not None else self.ops

    def project(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x `(1, T, hidden)` -> roped q, k and v: `(1, heads, T, dim)` for one segment
        (a scalar offset), else `(T, heads, dim)` (one position per token)."""
        one = positions.ndim == 0
        q, k, v = self.qkv(x)
        q, k, v = (
            split_heads(a, n, self.head_dim, one) for a, n in ((q, self.heads), (k, self.kv_heads), (v, self.kv_heads))
        )
        if self.q_norm is not None:
            q = mx.fast.rms_norm(q, self.q_norm, self.eps)
            k = mx.fast.rms_norm(k, self.k_norm, self.eps)
        if one:
            return self.rope(q, positions), self.rope(k, positions), v
        # Each token is its own rope "batch" row, at its own position.
        q = self.rope(q[:, :, None, :], positions)[:, :, 0, :]
        k = self.rope(k[:, :, None, :], positions)[:, :, 0, :]
        return q, k, v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, plan: Plan) -> mx.array:
        """Write each segment's k/v to its cache and attend; returns `(1, T, heads * dim)`."""
        routes = self.routes
        if self.window and plan.windowed is not None:  # its keys are in the windowed layers' pool
            plan = plan.windowed
        if len(plan.segments) == 1:
            return merge_heads(routes.attend_segment(self, q, k, v, plan.segments[0]))
        if plan.decoding and plan.decode_rows is None:
            return routes.attend_batch(self, q, k, v, plan)
        pieces = {}  # first row -> output rows, joined in row order
        if plan.decoding:
            rows = plan.decode_rows
            batch = routes.attend_batch(self, q[rows], k[rows], v[rows], plan)
            if isinstance(rows, slice):
                pieces[rows.start] = batch
            else:
                pieces.update((seg.start, batch[:, i : i + 1]) for i, seg in enumerate(plan.decoding))
        batched = {seg.start for seg in plan.decoding}
        for seg in plan.segments:
            if seg.start not in batched:
                rows = slice(seg.start, seg.start + seg.length)
                pieces[seg.start] = merge_heads(
                    routes.attend_segment(self, heads_first(q[rows]), heads_first(k[rows]), heads_first(v[rows]), seg)
                )
        return mx.concatenate([pieces[start] for start in sorted(pieces)], axis=1)

    def attend_batch(self, q, k, v, plan: Plan) -> mx.array:
        """B one-token sequences `(B, heads, dim)`: one write for all, and one attention over
        their keys gathered through their block tables under a length mask."""
        B = q.shape[0]
        keys, values = plan.pool.write_batch(self.layer, plan.write_index, k, v)
        keys, values = keys[plan.gather_index], values[plan.gather_index]
        mask = plan.window_mask(self.window) if self.window else plan.mask
        out = self.scores_attention(q[:, :, None, :], keys, values, mask)
        return out.reshape(1, B, self.heads * self.head_dim)

    def attend_segment(self, q, k, v, seg: Segment) -> mx.array:
        """q/k/v `(1, heads, n, dim)` -> `(1, heads, n, dim)`: causal over the sequence's cache
        (of a windowed layer, over its last `window` keys up to each query)."""
        first = seg.first_visible(self.window)
        read = seg.read_rows if not first else seg.cache.rows(first, seg.offset + seg.length)
        keys, values = seg.cache.write(self.layer, k, v, seg.write_rows, read)
        return self.scores_attention(q, keys, values, seg.mask(self.window))

    def scores_attention(self, q, keys, values, mask) -> mx.array:
        """Scaled dot-product attention, with the scores capped by `softcap` when it is set, and
        each head's sink logit in its softmax's denominator when the model has sinks."""
        if self.softcap is None:
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask, sinks=self.sinks)
        return softcapped_attention(q, keys, values, self.scale, self.softcap, mask)


class PlainRoutes:
    """The attention of this module, as the device's ops call it (`Ops.attend_segment` and
    `Ops.attend_batch`'s signatures), for the layers their kernels do not take."""

    @staticmethod
    def attend_segment(attn: Attention, q, k, v, seg: Segment) -> mx.array:
        return attn.attend_segment(q, k, v, seg)

    @staticmethod
    def attend_batch(attn: Attention, q, k, v, plan: Plan) -> mx.array:
        return attn.attend_batch(q, k, v, plan)


PLAIN_ROUTES = PlainRoutes()


def softcapped_attention(q, keys, values, scale: float, cap: float, mask) -> mx.array:
    """softmax(cap * tanh(q k^T * scale / cap)) v, as Gemma 2 and 3 cap their scores; q
    `(B, heads, n, dim)` over keys/values `(B, kv_heads, T, dim)`; `mask` as MLX's fused
    attention takes it."""
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = mx.repeat(keys, group, axis=1), mx.repeat(values, group, axis=1)
    scores = (q * scale) @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores.astype(mx.float32) / cap) * cap
    if isinstance(mask, str):
        n, T = scores.shape[-2:]
        mask = mx.arange(T)[None, :] <= mx.arange(T - n, T)[:, None]
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    return (mx.softmax(scores, axis=-1).astype(values.dtype)) @ values


# Layout changes are graph nodes too, and a decode step's cost is mostly per node: a single
# token takes the direct reshapes (its heads-first and token-first layouts are the same bytes).


def split_heads(a: mx.array, heads: int, dim: int, heads_first_layout: bool) -> mx.array:
    """`(1, T, heads * dim)` -> `(1, heads, T, dim)` (heads first) or `(T, heads, dim)`."""
    T = a.shape[1]
    if not heads_first_layout:
        return a.reshape(T, heads, dim)
    if T == 1:
        return a.reshape(1, heads, 1, dim)
    return a.reshape(1, T, heads, dim).transpose(0, 2, 1, 3)


def merge_heads(a: mx.array) -> mx.array:
    """`(1, heads, T, dim)` -> `(1, T, heads * dim)`."""
    _, heads, T, dim = a.shape
    if T == 1:
        return a.reshape(1, 1, heads * dim)
    return a.transpose(0, 2, 1, 3).reshape(1, T, heads * dim)


def heads_first(a: mx.array) -> mx.array:
    """`(T, heads, dim)` -> `(1, heads, T, dim)`."""
    return a.transpose(1, 0, 2)[None]
