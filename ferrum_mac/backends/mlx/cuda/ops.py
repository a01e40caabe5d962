"""MLX's CUDA build: which of our kernels runs each step (`CudaOps`), and what they read of a plan.

Each route falls back to MLX's own ops (the `Ops` it extends) where its kernel does not take
the case, and each has an A/B switch in `BackendOptions` (FERRUM_MLX_CUDA_*):

- attention: one token of a long or scattered sequence, and a batch's one-token rows, read
  their keys through block tables by length (`cuda.attention`); several tokens of a sequence
  attend at padded shapes under a mask, so MLX builds few cuDNN graphs (`attend_padded`);
- projection: one token's (or a batch's) q/k norms and RoPE in one kernel (`cuda.heads`);
- linears: a few rows of a quantized weight, SwiGLU included (`cuda.qmatmul`, `CudaLinear`);
- MoE: routing and the experts of decode-sized steps (`cuda.moe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import mlx.core as mx

from ferrum_mac.backends.mlx.attention import Attention, Plan, Segment
from ferrum_mac.backends.mlx.cuda import attention as cuda_attention
from ferrum_mac.backends.mlx.cuda import heads as cuda_heads
from ferrum_mac.backends.mlx.cuda import moe as cuda_moe
from ferrum_mac.backends.mlx.cuda import qmatmul as cuda_qmatmul
from ferrum_mac.backends.mlx.layers import Linear
from ferrum_mac.backends.mlx.ops import Ops
from ferrum_mac.backends.options import DEFAULTS, BackendOptions
from ferrum_mac.backends.state.padding import power_of_two_above, quarter_octave_above

if TYPE_CHECKING:
    from ferrum_mac.backends.mlx.models.qwen3_moe import Experts, Router

# A one-token segment whose rows are scattered attends through the table kernel from this many
# keys (gathering them would copy them all, every layer).
GATHER_KEYS = 256
# From this many keys the table kernel beats MLX's one-query kernel reading a lone sequence's
# keys in place (it costs more host time a layer, and splits long sequences better).
TABLE_KERNEL_KEYS = 8192
# A segment of several tokens pads its queries to a power of two and its keys to one of four
# lengths an octave (`quarter_octave_above`), from these: the keys' share of the work grows
# with them, the queries' padding adds only attention rows.
LEAST_PADDED_QUERIES, LEAST_PADDED_KEYS = 16, 256
MOE_MAX_EXPERTS, MOE_MAX_TOP_K = 512, 32  # the router kernel's limits


@dataclass
class CudaSegment(Segment):
    """A segment with what the CUDA routes read of it, made once for every layer."""

    @cached_property
    def table(self) -> mx.array:
        return self.cache.table(self.offset + self.length)

    @cached_property
    def position(self) -> mx.array:
        return mx.array([self.offset], dtype=mx.int32)

    @cached_property
    def padded(self) -> tuple[int, int]:
        """(queries, keys) of its attention padded to few shapes (`CudaOps.attend_padded`)."""
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


class CudaPlan(Plan):
    @cached_property
    def tables(self) -> mx.array:
        """The decoding sequences' block tables on the device (`Plan.host_tables`)."""
        return mx.array(self.host_tables)


class CudaLinear(Linear):
    """A linear whose quantized weight takes the few-row kernel (`cuda.qmatmul`) where it runs."""

    def __call__(self, x: mx.array) -> mx.array:
        if not self.takes_kernel(x):
            return super().__call__(x)
        y = cuda_qmatmul.quantized_matmul(x, self.weight, self.scales, self.biases, self.group_size, self.bits)
        return y if self.bias is None else y + self.bias

    def swiglu(self, x: mx.array) -> mx.array:
        if self.bias is not None or not self.takes_kernel(x):
            return super().swiglu(x)
        return cuda_qmatmul.quantized_matmul(
            x, self.weight, self.scales, self.biases, self.group_size, self.bits, swiglu=True
        )

    def takes_kernel(self, x: mx.array) -> bool:
        return self.quantized and cuda_qmatmul.runs(
            x.size // x.shape[-1], self.weight.shape[0], x.shape[-1], self.group_size, self.bits, x.dtype
        )


@dataclass
class LayerKernels:
    """Which kernels an attention layer takes, decided at its first step."""

    by_length: bool  # decode attention through block tables (`cuda.attention`)
    heads: cuda_heads.RopeSpec | None  # the heads kernel's constants, where it takes the projection
    warm: bool = False  # the heads kernel's build for a batch's rows compiled


class CudaOps(Ops):
    """MLX's ops, with our kernels where they take the case (see the module's docstring)."""

    device = "cuda"
    segment_type = CudaSegment

    def __init__(self, options: BackendOptions = DEFAULTS):
        super().__init__(options)
        self.linear_type = CudaLinear if options.cuda_qmm else Linear
        self.table_kernel_keys = TABLE_KERNEL_KEYS
        self._layers: dict[Attention, LayerKernels] = {}

    def plan(self, segments: list[Segment]) -> Plan:
        return CudaPlan(segments)

    def router_gate(self, gate: Linear) -> Linear:
        return gate.dense()  # a dense matmul beats MLX's quantized ones on this small (E, hidden) weight

    def kernels(self, attn: Attention) -> LayerKernels:
        found = self._layers.get(attn)
        if found is None:
            fused = attn.qkv.fused is not None and self.heads_kernel_takes(attn)
            heads = cuda_heads.RopeSpec(attn.rope, attn.eps) if fused else None
            found = LayerKernels(self.decode_kernel_takes(attn), heads)
            self._layers[attn] = found
        return found

    def heads_kernel_takes(self, attn: Attention) -> bool:
        """Whether the heads kernel takes this layer's heads (`cuda.heads.runs`)."""
        return self.options.cuda_heads and attn.rope.whole_heads and cuda_heads.runs(attn.head_dim)

    def decode_kernel_takes(self, attn: Attention) -> bool:
        """Whether the decode kernel takes this layer's heads (`cuda.attention.supports`)."""
        return self.options.cuda_attention and cuda_attention.supports(attn.head_dim, attn.heads // attn.kv_heads)

    def warm_up(self, attn: Attention, dtype: mx.Dtype) -> None:
        """Compile the decode-attention kernels, and the heads kernel's build for a batch's rows
        (a one-token step compiles the other), where this layer uses them."""
        kernels = self.kernels(attn)
        if kernels.by_length:
            cuda_attention.warm_up(dtype, attn.heads, attn.kv_heads, attn.head_dim)
        if kernels.heads is not None and not kernels.warm:
            qkv = mx.zeros((1, 2, (attn.heads + 2 * attn.kv_heads) * attn.head_dim), dtype)
            mx.eval(*self.heads(attn, qkv, mx.array([0, 1]), kernels.heads))
            kernels.warm = True

    def project(self, attn: Attention, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        spec, T = self.kernels(attn).heads, x.shape[1]
        if spec is not None and (T == 1 or (positions.ndim == 1 and T <= cuda_heads.MAX_TOKENS)):
            return self.heads(attn, attn.qkv.fused(x), positions, spec)
        return attn.project(x, positions)

    def heads(self, attn: Attention, qkv: mx.array, positions: mx.array, spec: cuda_heads.RopeSpec):
        return cuda_heads.heads(
            qkv, positions, attn.heads, attn.kv_heads, attn.head_dim, attn.q_norm, attn.k_norm, spec
        )

    def attend_batch(self, attn: Attention, q: mx.array, k: mx.array, v: mx.array, plan: Plan) -> mx.array:
        """By length through the block tables (MLX's masked attention on CUDA leaves the fused
        kernel for a path several times slower, `cuda.attention`)."""
        if not self.kernels(attn).by_length:
            return attn.attend_batch(q, k, v, plan)
        B = q.shape[0]
        keys, values = plan.pool.write_batch(attn.layer, plan.write_index, k, v)
        out = cuda_attention.decode_attention(
            q, keys, values, plan.tables, plan.decode_positions, attn.scale, plan.width, plan.pool.block_tokens
        )
        return out.reshape(1, B, attn.heads * attn.head_dim)

    def attend_segment(self, attn: Attention, q: mx.array, k: mx.array, v: mx.array, seg: Segment) -> mx.array:
        if seg.length > 1:
            return self.attend_padded(attn, q, k, v, seg)
        if self.through_table(attn, seg):
            return self.decode_through_table(attn, q, k, v, seg)
        return attn.attend_segment(q, k, v, seg)

    def through_table(self, attn: Attention, seg: Segment) -> bool:
        """Whether a one-token segment attends by the table kernel: one of a long sequence, or of
        one whose rows are scattered. MLX's own attention reads a shorter one's keys in place,
        as a slice of the pool (which `kv.SPARE_ROWS` keeps safe)."""
        keys = seg.offset + 1
        scattered = isinstance(seg.read_rows, mx.array)
        return self.kernels(attn).by_length and (keys >= self.table_kernel_keys or (scattered and keys >= GATHER_KEYS))

    def attend_padded(self, attn: Attention, q: mx.array, k: mx.array, v: mx.array, seg: CudaSegment) -> mx.array:
        """Several tokens of a sequence. MLX's attention on CUDA builds a cuDNN graph for each new
        shape of queries and keys, which takes longer than a long prompt's attention, and every
        prompt, chunk and verify brings a new shape: so both lengths are padded to one of a few
        (`CudaSegment.padded`) and a mask keeps the causal order."""
        keys, values = seg.cache.store(attn.layer, k, v, seg.write_rows)
        rows = seg.padded_read_rows
        keys, values = keys[:, :, rows, :], values[:, :, rows, :]
        queries = seg.padded[0]
        q = mx.concatenate([q, mx.zeros((1, attn.heads, queries - seg.length, attn.head_dim), q.dtype)], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=seg.padded_mask)
        return out[:, :, : seg.length, :]

    def decode_through_table(
        self, attn: Attention, q: mx.array, k: mx.array, v: mx.array, seg: CudaSegment
    ) -> mx.array:
        """One token of a sequence: the decode kernel reads its keys through its block table (its
        blocks need not be consecutive; a gather would copy them all, every layer)."""
        keys, values = seg.cache.store(attn.layer, k, v, seg.write_rows)
        out = cuda_attention.decode_attention(
            q.reshape(1, attn.heads, attn.head_dim),
            keys,
            values,
            seg.table,
            seg.position,
            attn.scale,
            seg.offset + 1,
            seg.cache.pool.block_tokens,
        )
        return out.reshape(1, attn.heads, 1, attn.head_dim)

    def route(self, router: Router, logits: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        T, E = logits.shape
        k = router.top_k
        if self.options.cuda_moe and E <= MOE_MAX_EXPERTS and k <= MOE_MAX_TOP_K and T * k <= cuda_moe.MAX_PAIRS:
            return cuda_moe.route(logits, k, router.renormalise, dtype)
        return router.route(logits, dtype)

    def mix_experts(self, experts: Experts, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        if ids.size > cuda_moe.MAX_PAIRS or not self.moe_kernels_take(experts, ids.shape[1]):
            return experts.mix(x, ids, weights)
        a = cuda_moe.gate_up_swiglu(x, experts.gate_up, ids, weights, experts.inter)
        return cuda_moe.down_sum(a, experts.down, ids, experts.hidden)

    def moe_kernels_take(self, experts: Experts, top_k: int) -> bool:
        """Whether the MoE kernels run these experts: quantized alike, gate and up stacked."""
        gate_up, down = experts.gate_up, experts.down
        return (
            self.options.cuda_moe
            and gate_up is not None
            and gate_up.scales is not None
            and down.format() == gate_up.format()
            and cuda_moe.supports(experts.hidden, experts.inter, top_k, gate_up.group_size, gate_up.bits)
        )
