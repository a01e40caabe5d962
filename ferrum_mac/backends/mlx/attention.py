"""Attention over a batch of sequence segments, each reading and writing its own KV cache.

Every forward runs on a flat row of tokens `(1, T, hidden)`. A `Plan` says which tokens
belong to which sequence: a segment is `length` tokens starting at row `start`, placed at
absolute position `offset` of its cache. Projections run once over all T tokens; RoPE
runs once with per-token positions; attention runs per segment against its cache.
With a single segment (the usual prefill or decode) nothing is sliced.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from ferrum_mac import settings
from ferrum_mac.backends.state.block_pool import SCRATCH
from ferrum_mac.backends.mlx import cuda_attention, cuda_heads
from ferrum_mac.backends.mlx.kv import SequenceCache
from ferrum_mac.backends.mlx.layers import Rope, TensorSource
from ferrum_mac.backends.mlx.memory import on_cpu, on_cuda_gpu
from ferrum_mac.backends.state.padding import power_of_two_above, quarter_octave_above
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

    @cached_property
    def table(self) -> mx.array:
        return self.cache.table(self.offset + self.length)

    @cached_property
    def position(self) -> mx.array:
        return mx.array([self.offset], dtype=mx.int32)

    @cached_property
    def padded(self) -> tuple[int, int]:
        """(queries, keys) of its attention padded to few shapes (`Attention._attend_padded`)."""
        queries = power_of_two_above(max(self.length, LEAST_PADDED_QUERIES))
        return queries, quarter_octave_above(self.offset + self.length, LEAST_PADDED_KEYS)

    @cached_property
    def padded_read_rows(self) -> slice | mx.array:
        """`read_rows` and then as many rows more as the padded keys take (any rows: masked)."""
        keys, read, end = self.padded[1], self.read_rows, self.offset + self.length
        if isinstance(read, slice) and read.start + keys <= self.cache.pool.blocks * self.cache.pool.block_tokens:
            return slice(read.start, read.start + keys)
        rows = mx.arange(read.start, read.stop) if isinstance(read, slice) else read
        return mx.concatenate([rows, mx.zeros(keys - end, dtype=rows.dtype)])

    @cached_property
    def padded_mask(self) -> mx.array:
        """`(1, 1, queries, keys)` of the padded shape, added to the scores (in the cache's
        dtype): query i sees the keys up to its own position, none past the segment's end
        (padded queries see some key, so no row is masked whole)."""
        queries, keys = self.padded
        key_rows, dtype = mx.arange(keys)[None, :], self.cache.pool.dtype
        allowed = (key_rows <= mx.arange(queries)[:, None] + self.offset) & (key_rows < self.offset + self.length)
        return mx.where(allowed, mx.array(0, dtype), mx.array(-mx.inf, dtype))[None, None]


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
    def tables(self) -> mx.array:
        return mx.array(self.host_tables)

    @cached_property
    def gather_index(self) -> tuple:
        """Indices gathering each decoding sequence's keys through its block table (`KvManager.gather_index`)."""
        return self.pool.gather_index(self.host_tables)

    @cached_property
    def mask(self) -> mx.array:
        """For the gathered keys of decode rows: each sequence sees its own keys up to its offset."""
        width = self.host_tables.shape[1] * self.pool.block_tokens
        return (mx.arange(width)[None, :] <= self.decode_positions[:, None])[:, None, None, :]


def decode_rows(singles: list[Segment]) -> slice | mx.array:
    starts = [s.start for s in singles]
    if starts == list(range(starts[0], starts[0] + len(starts))):
        return slice(starts[0], starts[0] + len(starts))
    return mx.array(starts)


# FERRUM_MLX_CUDA_ATTENTION=0 keeps the masked fused attention on CUDA too (A/B timing).
USE_CUDA_KERNEL = settings.value("FERRUM_MLX_CUDA_ATTENTION")
# On the CPU, a segment of several tokens with at least this many scores (heads x queries x
# keys) attends by numpy (`numpy_causal_attention`); FERRUM_MLX_NUMPY_ATTENTION=0: never.
NUMPY_ATTENTION = settings.value("FERRUM_MLX_NUMPY_ATTENTION")
NUMPY_MIN_SCORES = 1 << 16
NUMPY_BLOCK_SCORES = 1 << 24  # scores numpy holds at once (64 MB of float32): queries go in blocks
# A one-token segment on CUDA whose rows are scattered attends through the table kernel
# from this many keys (gathering them would copy them all, every layer).
GATHER_KEYS = 256
# From this many keys the table kernel beats MLX's one-query kernel reading a lone sequence's
# keys in place (it costs more host time a layer, and splits long sequences better).
TABLE_KERNEL_KEYS = 8192
# A segment of several tokens on CUDA pads its queries to a power of two and its keys to one
# of four lengths an octave (`quarter_octave_above`), from these: the keys' share of the work
# grows with them, the queries' padding adds only attention rows.
LEAST_PADDED_QUERIES, LEAST_PADDED_KEYS = 16, 256


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
        group = c.num_heads // c.num_kv_heads
        self.on_cuda = on_cuda_gpu()
        self.by_length = USE_CUDA_KERNEL and self.on_cuda and cuda_attention.supports(c.head_dim, group)
        self.by_numpy = NUMPY_ATTENTION and on_cpu()
        self.fused_heads = self.qkv.fused is not None and cuda_heads.runs(c.head_dim)
        self.rope_spec = cuda_heads.RopeSpec(self.rope, self.eps) if self.fused_heads else None
        self.heads_warm = False

    def warm_up_kernels(self, dtype: mx.Dtype) -> None:
        """Compile the CUDA decode-attention kernels, and the heads kernel's build for a batch's
        rows (a one-token step compiles the other), where this layer uses them."""
        if self.by_length:
            cuda_attention.warm_up(dtype, self.heads, self.kv_heads, self.head_dim)
        if self.fused_heads and not self.heads_warm:
            qkv = mx.zeros((1, 2, (self.heads + 2 * self.kv_heads) * self.head_dim), dtype)
            heads = (self.heads, self.kv_heads, self.head_dim, self.q_norm, self.k_norm, self.rope_spec)
            mx.eval(*cuda_heads.heads(qkv, mx.array([0, 1]), *heads))
            self.heads_warm = True

    def project(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x `(1, T, hidden)` -> roped q, k and v: `(1, heads, T, dim)` for one segment
        (a scalar offset), else `(T, heads, dim)` (one position per token)."""
        one = positions.ndim == 0
        if self.fused_heads and (x.shape[1] == 1 or (not one and x.shape[1] <= cuda_heads.MAX_TOKENS)):
            return cuda_heads.heads(
                self.qkv.fused(x), positions, self.heads, self.kv_heads, self.head_dim, self.q_norm, self.k_norm,
                self.rope_spec,
            )  # fmt: skip
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
        if len(plan.segments) == 1:
            return merge_heads(self._attend_segment(q, k, v, plan.segments[0]))
        if plan.decoding and plan.decode_rows is None:
            return self._attend_batch(q, k, v, plan)
        pieces = {}  # first row -> output rows, joined in row order
        if plan.decoding:
            rows = plan.decode_rows
            batch = self._attend_batch(q[rows], k[rows], v[rows], plan)
            if isinstance(rows, slice):
                pieces[rows.start] = batch
            else:
                pieces.update((seg.start, batch[:, i : i + 1]) for i, seg in enumerate(plan.decoding))
        batched = {seg.start for seg in plan.decoding}
        for seg in plan.segments:
            if seg.start not in batched:
                rows = slice(seg.start, seg.start + seg.length)
                pieces[seg.start] = merge_heads(
                    self._attend_segment(heads_first(q[rows]), heads_first(k[rows]), heads_first(v[rows]), seg)
                )
        return mx.concatenate([pieces[start] for start in sorted(pieces)], axis=1)

    def _attend_batch(self, q, k, v, plan: Plan) -> mx.array:
        """B one-token sequences `(B, heads, dim)`: one write and one attention for all, on
        CUDA by length through their block tables, else over keys gathered through them under a
        length mask."""
        B = q.shape[0]
        keys, values = plan.pool.write_batch(self.layer, plan.write_index, k, v)
        if self.by_length:
            out = cuda_attention.decode_attention(
                q, keys, values, plan.tables, plan.decode_positions, self.scale, plan.width, plan.pool.block_tokens
            )
        else:
            keys, values = keys[plan.gather_index], values[plan.gather_index]
            out = mx.fast.scaled_dot_product_attention(q[:, :, None, :], keys, values, scale=self.scale, mask=plan.mask)
        return out.reshape(1, B, self.heads * self.head_dim)

    def _attend_segment(self, q, k, v, seg: Segment) -> mx.array:
        """q/k/v `(1, heads, n, dim)` -> `(1, heads, n, dim)`."""
        if self._through_table(seg):
            return self._decode_through_table(q, k, v, seg)
        if seg.length > 1 and self.on_cuda:
            return self._attend_padded(q, k, v, seg)
        keys, values = seg.cache.write(self.layer, k, v, seg.write_rows, seg.read_rows)
        if seg.length > 1 and self.by_numpy and self.heads * seg.length * keys.shape[2] >= NUMPY_MIN_SCORES:
            return numpy_causal_attention(q, keys, values, self.scale)
        mask = "causal" if seg.length > 1 else None
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)

    def _through_table(self, seg: Segment) -> bool:
        """Whether a segment attends by the table kernel: one token of a long sequence on CUDA,
        or of one whose rows are scattered. MLX's own attention reads a shorter one's keys in
        place, as a slice of the pool (which `kv.SPARE_ROWS` keeps safe)."""
        keys = seg.offset + 1
        scattered = isinstance(seg.read_rows, mx.array)
        return seg.length == 1 and self.by_length and (keys >= TABLE_KERNEL_KEYS or (scattered and keys >= GATHER_KEYS))

    def _attend_padded(self, q, k, v, seg: Segment) -> mx.array:
        """Several tokens of a sequence, on CUDA. MLX's attention there builds a cuDNN graph
        for each new shape of queries and keys, which takes longer than a long prompt's
        attention, and every prompt, chunk and verify brings a new shape: so both lengths
        are padded to one of a few (`Segment.padded`) and a mask keeps the causal order."""
        keys, values = seg.cache.store(self.layer, k, v, seg.write_rows)
        rows = seg.padded_read_rows
        keys, values = keys[:, :, rows, :], values[:, :, rows, :]
        queries = seg.padded[0]
        q = mx.concatenate([q, mx.zeros((1, self.heads, queries - seg.length, self.head_dim), q.dtype)], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=seg.padded_mask)
        return out[:, :, : seg.length, :]

    def _decode_through_table(self, q, k, v, seg: Segment) -> mx.array:
        """One token of a sequence, on CUDA: the decode kernel reads its keys through its block
        table (its blocks need not be consecutive; a gather would copy them all, every layer)."""
        keys, values = seg.cache.store(self.layer, k, v, seg.write_rows)
        out = cuda_attention.decode_attention(
            q.reshape(1, self.heads, self.head_dim), keys, values, seg.table, seg.position, self.scale,
            seg.offset + 1, seg.cache.pool.block_tokens,
        )  # fmt: skip
        return out.reshape(1, self.heads, 1, self.head_dim)


def numpy_causal_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float,
                           block_scores: int = NUMPY_BLOCK_SCORES) -> mx.array:  # fmt: skip
    """`mx.fast.scaled_dot_product_attention(q, keys, values, mask="causal")` computed by numpy,
    for the CPU: q `(1, heads, n, dim)` over keys and values `(1, kv_heads, T, dim)`, the last
    n keys the queries' own (query i sees keys up to T - n + i). A long chunk's work is mostly
    its scores' softmax, and MLX's CPU `exp` takes some 20 ns a value where numpy's takes about
    1 (`scripts/probe-cpu-attention.py`); the products go to OpenBLAS. In float32, the queries of a KV head's
    group stacked into one product, a block of queries at a time (`block_scores` scores)."""
    _, heads, n, dim = q.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    queries = np.array(q.astype(mx.float32)).reshape(kv_heads, group, n, dim) * np.float32(scale)
    k_t = np.array(keys.astype(mx.float32))[0].transpose(0, 2, 1)  # (kv_heads, dim, T)
    v = np.array(values.astype(mx.float32))[0]
    out = np.empty((kv_heads, group, n, dim), np.float32)
    block = max(1, block_scores // (heads * total))
    for start in range(0, n, block):
        end = min(n, start + block)
        rows = queries[:, :, start:end].reshape(kv_heads, group * (end - start), dim)
        scores = np.matmul(rows, k_t).reshape(kv_heads, group, end - start, total)
        scores += causal_mask(start, end, total - n, total)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        weighted = np.matmul(scores.reshape(kv_heads, group * (end - start), total), v)
        out[:, :, start:end] = weighted.reshape(kv_heads, group, end - start, dim)
    return mx.array(out.reshape(1, heads, n, dim)).astype(q.dtype)


def causal_mask(start: int, end: int, first: int, total: int) -> np.ndarray:
    """`(end - start, total)`: 0 where query i (from `start`) sees key j (j <= first + i), else -inf."""
    hidden = np.arange(total)[None, :] > (first + np.arange(start, end))[:, None]
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0))


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
