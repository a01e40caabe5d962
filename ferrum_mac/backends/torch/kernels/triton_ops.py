"""Triton kernels for a CUDA decode step: the small work between the matmuls (what eager torch
does in about a dozen launches per layer, in four). The matmuls of a step's few rows, with
the RMSNorm before them or the SwiGLU after, are `triton_gemv`'s.

- `norm_rope_write`: q/k RMSNorm + RoPE on the fused qkv projection's output, q returned, k
  and v written straight into the KV pool at a `DecodePlan`'s places.
- `decode_attention`: one query per row over its blocks of the pool (a block table per row),
  reading only the row's `positions[i] + 1` keys (lengths read on the device, so a CUDA graph replays it at any
  position). A program takes a kv head with all the query heads it serves (one `tl.dot`
  over the group), so a key is read once per row, not once per query head. Split-K: each
  (row, kv head) spreads its keys over several programs, so a small batch still fills the
  GPU; the last of them to finish merges their partial softmaxes (`triton_splits`).
- `swiglu`: silu(gate) * up (* per-row weights) from the fused gate_up output.
- `rms_norm`: F.rms_norm for a step's few rows, where torch's kernel is slow for what it
  does: a program per row, the whole row in registers.
Results round where the torch path rounds (the q/k norm in float32, rounded before the
weight; the block norms weighed in float32 and rounded once, as F.rms_norm; each product of
RoPE and SwiGLU rounded to the activations' dtype), so they match it to the last bit or so. Attention keeps its softmax and sums in float32.

On Hopper they launch early, each waiting for the kernel before (`triton_pdl`).
The entry functions launch on whatever tensors they are given: on CUDA, or on CPU tensors
under Triton's interpreter (`TRITON_INTERPRET=1`, for tests). Choosing to use them (CUDA
only) is the callers' business. The module loads without triton; `triton` is then None.
"""

import functools
import math

import torch

from ferrum_mac.backends.torch.kernels.triton_pdl import LINE_BYTES, launch_options, pdl_for
from ferrum_mac.backends.torch.kernels.triton_splits import SPLIT_COUNTERS, split_counters

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


# -- launches -----------------------------------------------------------------------------------


def norm_rope_write(qkv: torch.Tensor, heads: int, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    eps: float, interleaved: bool, kv: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """qkv `(T, (heads + 2 * kv_heads) * dim)` -> roped q `(T, heads, dim)`; roped k and v go
    into the pool layer `kv` `(2, kv_heads, token rows, dim)` at `places` `(T * kv_heads,)`,
    flat indices among its `kv_heads * token rows` rows (`DecodePlan.places`).

    `weight` `(heads + kv_heads, dim)`: each q and k head's RMSNorm weight, or None for no
    norm. cos and signed sin: each row's `Rope.tables`, `(T, 1, dim)` in the activations' dtype."""
    rows, dim, kv_heads = qkv.shape[0], kv.shape[-1], kv.shape[1]
    assert qkv.shape[1] == (heads + 2 * kv_heads) * dim and qkv.stride(1) == 1 and kv.is_contiguous()
    cos, sin = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
    q = torch.empty((rows, heads, dim), dtype=qkv.dtype, device=qkv.device)
    has_weight = weight is not None
    weight = weight.contiguous() if has_weight else qkv  # any pointer: never read
    pdl = pdl_for(qkv.device)
    _norm_rope_write_kernel[(rows, heads + 2 * kv_heads)](
        qkv, qkv.stride(0), weight, cos, sin, q, kv, places, kv.stride(0), eps,
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim, BLOCK=triton.next_power_of_2(dim),
        HAS_WEIGHT=has_weight, INTERLEAVED=interleaved, PDL=pdl, num_warps=1, **launch_options(pdl),
    )
    return q


KEYS_PER_BLOCK = 64  # keys a program scores per step of its loop
MAX_SPLITS = 32
MERGE_TILE = 8192  # float32 elements of partial sums the merge loads a round (heads x splits x dims)
MIN_DOT_ROWS = 16  # tl.dot's smallest operand side: a query group, or a GEMV's few rows, is padded to it


def decode_attention(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, scale: float,
                     block_tokens: int, splits: int | None = None, early: bool = True) -> torch.Tensor:
    """q `(T, heads, dim)`; row i attends over its keys `0 .. positions[i]` in the pool layer `kv`
    `(2, kv_heads, token rows, dim)`, key j at token row `table[i, j // block_tokens] *
    block_tokens + j % block_tokens` (`table` `(T, width)`: each row's blocks) -> `(T, heads * dim)`.

    Query head h reads kv head `h // (heads / kv_heads)`; one program serves a kv head's whole
    group, so each key is read once per row. `splits`: programs per (row, kv head), a power of
    two (by default enough to give every SM two programs). `early`: whether the kernel before
    lets this one start while it runs (`triton_pdl`), so that prefetching the keys pays."""
    rows, heads, dim = q.shape
    kv_heads, width = kv.shape[1], table.shape[1]
    assert q.stride(2) == 1 and kv.stride(3) == 1 and table.is_contiguous() and heads % kv_heads == 0
    group = heads // kv_heads
    splits = splits or default_splits(rows * kv_heads, width * block_tokens, q.device)
    assert splits & (splits - 1) == 0, "splits: a power of two"
    out = torch.empty((rows, heads * dim), dtype=q.dtype, device=q.device)
    pdl = pdl_for(q.device)
    block_d = triton.next_power_of_2(dim)
    block_n = (
        KEYS_PER_BLOCK if q.element_size() == 2 else KEYS_PER_BLOCK // 2
    )  # float32 blocks that size spill registers
    group_p2 = triton.next_power_of_2(group)
    if splits == 1:
        partial_acc = partial_max = partial_sum = counters = out  # (any pointer: never read)
    else:
        assert rows * kv_heads <= SPLIT_COUNTERS
        partial_acc = torch.empty((rows * heads * splits, block_d), dtype=torch.float32, device=q.device)
        partial_max = torch.empty((rows * heads * splits,), dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
        counters = split_counters(q.device)
    _decode_attention_kernel[(rows * kv_heads, splits)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.stride(1), kv.stride(2), table, width,
        positions, scale * math.log2(math.e), out, partial_acc, partial_max, partial_sum, counters,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, group_p2), GROUP_P2=group_p2,
        DIM=dim, BLOCK_TOKENS=block_tokens, SPLITS=splits, BLOCK_N=block_n, BLOCK_D=block_d,
        MERGE_SPLITS=min(splits, max(1, MERGE_TILE // (group_p2 * block_d))),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl, PREFETCH=pdl and early,
        KEY_LINES=triton.next_power_of_2(triton.cdiv(dim * kv.element_size(), LINE_BYTES)), LINE_ELEMENTS=LINE_BYTES // kv.element_size(),
        num_warps=4, **launch_options(pdl),
    )
    return out


def default_splits(row_kv_heads: int, tokens: int, device: torch.device) -> int:
    """Programs per (row, kv head): about two per SM over the batch (1 once the batch alone
    gives that: no merge), a power of two (few kernel variants to compile), no more than the
    pool's width has key blocks."""
    wanted = min(max(1, 2 * multiprocessors(device) // row_kv_heads), triton.cdiv(tokens, KEYS_PER_BLOCK), MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


SWIGLU_BLOCK = 1024


def swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up from `(..., 2 * width)` (gate first) -> `(..., width)`, times `weights`
    (one per row: `(..., 1)`) when given."""
    *lead, double = gate_up.shape
    width = double // 2
    flat = gate_up.reshape(-1, double)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    has_weights = weights is not None
    weights = weights.reshape(rows).contiguous() if has_weights else flat  # any pointer: never read
    _swiglu_kernel[(rows, triton.cdiv(width, SWIGLU_BLOCK))](
        flat, flat.stride(0), weights, out, width, HAS_WEIGHTS=has_weights, BLOCK=SWIGLU_BLOCK, num_warps=4
    )
    return out.reshape(*lead, width)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, x.shape[-1:], weight, eps), x `(..., width)`, in x's dtype."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(width)
    pdl = pdl_for(x.device)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, rows.stride(0), weight.contiguous(), out, eps, WIDTH=width, BLOCK=block, PDL=pdl,
        num_warps=min(16, max(1, block // 256)), **launch_options(pdl),
    )
    return out.view(x.shape)


# -- kernels ------------------------------------------------------------------------------------

if triton is not None:
    from ferrum_mac.backends.torch.kernels.triton_pdl import prefetch_rows, wait_for_previous
    from ferrum_mac.backends.torch.kernels.triton_splits import arrived_last

    @triton.jit
    def _round(x, like):
        """x (float32) rounded to `like`'s dtype and back: where eager torch stores an intermediate."""
        return x.to(like.dtype).to(tl.float32)

    @triton.jit
    def _norm_rope_write_kernel(
        qkv_ptr, qkv_row_stride, weight_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, places_ptr, kv_half_stride, eps,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
        HAS_WEIGHT: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr,
    ):
        # One program per (row, head); heads run q heads, then k heads, then v heads.
        wait_for_previous(PDL)
        row, head = tl.program_id(0), tl.program_id(1)
        dims = tl.arange(0, BLOCK)
        inside = dims < DIM
        src = qkv_ptr + row.to(tl.int64) * qkv_row_stride + head * DIM
        if head >= HEADS + KV_HEADS:  # a v head: copied as it is
            value_place = tl.load(places_ptr + row * KV_HEADS + head - HEADS - KV_HEADS)
            value = tl.load(src + dims, mask=inside)
            tl.store(kv_ptr + kv_half_stride + value_place * DIM + dims, value, mask=inside)
        else:
            if INTERLEAVED:  # pairs (2i, 2i+1)
                partner_dims = dims ^ 1
            else:  # pairs (i, i + dim/2)
                partner_dims = (dims + DIM // 2) % DIM
            raw = tl.load(src + dims, mask=inside, other=0.0)
            partner = tl.load(src + partner_dims, mask=inside, other=0.0).to(tl.float32)
            w, partner_w = None, None
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + head * DIM + dims, mask=inside, other=0.0).to(tl.float32)
                partner_w = tl.load(weight_ptr + head * DIM + partner_dims, mask=inside, other=0.0).to(tl.float32)
            cos = tl.load(cos_ptr + row * DIM + dims, mask=inside, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + row * DIM + dims, mask=inside, other=0.0).to(tl.float32)
            roped = qk_norm_rope(raw, partner, w, partner_w, cos, sin, eps, DIM, HAS_WEIGHT)
            if head < HEADS:
                tl.store(q_ptr + (row * HEADS + head) * DIM + dims, roped, mask=inside)
            else:
                place = tl.load(places_ptr + row * KV_HEADS + head - HEADS)
                tl.store(kv_ptr + place * DIM + dims, roped, mask=inside)

    @triton.jit
    def qk_norm_rope(raw, partner, w, partner_w, cos, sin, eps, DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr):
        """q or k heads along the last axis of `raw` (padding 0): RMSNorm by `w` (if HAS_WEIGHT),
        then RoPE, each dimension turned with its `partner` (float32; `partner_w` its weight) by
        cos and signed sin -> raw's dtype, rounded where the torch path rounds."""
        x = raw.to(tl.float32)
        if HAS_WEIGHT:
            inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) / DIM + eps)
            x = _round(_round(x * inv_rms, raw) * w, raw)
            partner = _round(_round(partner * inv_rms, raw) * partner_w, raw)
        return (_round(x * cos, raw) + _round(partner * sin, raw)).to(raw.dtype)

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, q_row_stride, q_head_stride,
        kv_ptr, kv_half_stride, kv_head_stride, kv_token_stride, table_ptr, table_width,
        positions_ptr, scale_log2, out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, counters_ptr,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr,
        DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, MERGE_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr, PREFETCH: tl.constexpr, KEY_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr,
    ):
        # One program per (row, kv head, split): the kv head's query heads (padded to GROUP_PAD
        # rows, the padding masked) against the split's share of the row's keys (at a short
        # length the splits past it stay empty), in blocks of
        # BLOCK_N (each key's token row read from the row's block table), with an online
        # softmax per query head. Scores are in log2 units (exp2 is the
        # fast one); both products accumulate in float32, as flash attention does.
        row_kv_head, split = tl.program_id(0), tl.program_id(1)
        row, kv_head = row_kv_head // KV_HEADS, row_kv_head % KV_HEADS
        # The lengths and the block table are the step's inputs, which no kernel of a layer
        # writes: read before the wait. So are the split's keys and values, into L2, when this
        # program starts while the kernel before runs (the newest key, which that kernel is
        # writing, lands in L2 too: writes go there).
        length = tl.load(positions_ptr + row) + 1
        share = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N  # whole blocks per split
        start = split * share
        end = tl.minimum(start + share, length)
        keys_ptr = kv_ptr + kv_head.to(tl.int64) * kv_head_stride
        values_ptr = keys_ptr + kv_half_stride
        row_table = table_ptr + row.to(tl.int64) * table_width
        if PREFETCH:
            for block in range(start, end, BLOCK_N):
                token_rows, seen = _token_rows(row_table, block, end, BLOCK_N, BLOCK_TOKENS)
                rows_ptr = token_rows[:, None] * kv_token_stride
                prefetch_rows(keys_ptr + rows_ptr, seen, 0, DIM, KEY_LINES, LINE_ELEMENTS)
                prefetch_rows(values_ptr + rows_ptr, seen, 0, DIM, KEY_LINES, LINE_ELEMENTS)
        wait_for_previous(PDL)

        members = tl.arange(0, GROUP_PAD)
        in_group = members < GROUP
        heads = kv_head * GROUP + members
        dims = tl.arange(0, BLOCK_D)
        inside = dims < DIM
        q_offsets = row * q_row_stride + heads[:, None] * q_head_stride + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=in_group[:, None] & inside[None, :], other=0.0)

        running_max = tl.full([GROUP_PAD], -float("inf"), dtype=tl.float32)
        running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
        for block in range(start, end, BLOCK_N):
            token_rows, seen = _token_rows(row_table, block, end, BLOCK_N, BLOCK_TOKENS)
            offsets = token_rows[:, None] * kv_token_stride + dims[None, :]
            both = seen[:, None] & inside[None, :]
            k = tl.load(keys_ptr + offsets, mask=both, other=0.0)
            v = tl.load(values_ptr + offsets, mask=both, other=0.0)  # (asked for with the keys: one trip)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            scores = tl.where(seen[None, :], scores, -float("inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp2(running_max - new_max)
            p = tl.exp2(scores - new_max[:, None])
            acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None], input_precision=PRECISION)
            running_sum = running_sum * rescale + tl.sum(p, axis=1)
            running_max = new_max

        first_head = row * (KV_HEADS * GROUP) + kv_head * GROUP
        if SPLITS == 1:
            out_offsets = (first_head + members)[:, None] * DIM + dims[None, :]
            out_mask = in_group[:, None] & inside[None, :]
            tl.store(out_ptr + out_offsets, (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
        else:  # (the merge reads only the splits that hold keys)
            parts = (first_head + members) * SPLITS + split
            tl.store(partial_acc_ptr + parts[:, None] * BLOCK_D + dims[None, :], acc, mask=in_group[:, None])
            tl.store(partial_max_ptr + parts, running_max, mask=in_group)
            tl.store(partial_sum_ptr + parts, running_sum, mask=in_group)
            if arrived_last(counters_ptr + row_kv_head, SPLITS):
                _merge_splits(
                    partial_acc_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, first_head, tl.cdiv(length, share),
                    GROUP, GROUP_P2, DIM, SPLITS, MERGE_SPLITS, BLOCK_D,
                )

    @triton.jit
    def _token_rows(row_table, block, end, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr):
        """The pool's token rows of a row's keys `block .. block + BLOCK_N` (by its block table
        `row_table`), and which of them come before `end`."""
        columns = block + tl.arange(0, BLOCK_N)
        seen = columns < end
        blocks = tl.load(row_table + columns // BLOCK_TOKENS, mask=seen, other=0)
        return blocks.to(tl.int64) * BLOCK_TOKENS + columns % BLOCK_TOKENS, seen

    @triton.jit
    def _merge_splits(partial_acc_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, first_head, used,
                      GROUP: tl.constexpr, GROUP_P2: tl.constexpr, DIM: tl.constexpr, SPLITS: tl.constexpr,
                      MERGE_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
        """A query group's attention (heads `first_head ..`, stored to `out_ptr`) from its first
        `used` splits' partial softmaxes (the splits after them are empty), each rescaled to
        the heads' top max. All splits' maxes load at once, their sums MERGE_SPLITS at a time:
        loads in flight together, not one split after another."""
        members = tl.arange(0, GROUP_P2)
        in_group = members < GROUP
        heads = first_head + members
        splits = tl.arange(0, SPLITS)
        maxes = tl.load(
            partial_max_ptr + heads[:, None] * SPLITS + splits[None, :],
            mask=in_group[:, None] & (splits < used)[None, :], other=-float("inf"), cache_modifier=".cg",
        )
        top = tl.where(in_group, tl.max(maxes, axis=1), 0.0)
        total = tl.zeros([GROUP_P2], dtype=tl.float32)
        acc = tl.zeros([GROUP_P2, BLOCK_D], dtype=tl.float32)
        dims = tl.arange(0, BLOCK_D)
        for first in range(0, used, MERGE_SPLITS):
            some = first + tl.arange(0, MERGE_SPLITS)
            parts = heads[:, None] * SPLITS + some[None, :]
            live = in_group[:, None] & (some < used)[None, :]
            part_max = tl.load(partial_max_ptr + parts, mask=live, other=-float("inf"), cache_modifier=".cg")
            weight = tl.exp2(part_max - top[:, None])  # (0 where not live)
            part_sum = tl.load(partial_sum_ptr + parts, mask=live, other=0.0, cache_modifier=".cg")
            total += tl.sum(part_sum * weight, axis=1)
            part_acc = tl.load(
                partial_acc_ptr + parts[:, :, None] * BLOCK_D + dims[None, None, :],
                mask=live[:, :, None], other=0.0, cache_modifier=".cg",
            )
            acc += tl.sum(part_acc * weight[:, :, None], axis=1)
        out = acc / tl.where(in_group, total, 1.0)[:, None]
        out_mask = in_group[:, None] & (dims < DIM)[None, :]
        tl.store(out_ptr + heads[:, None] * DIM + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _swiglu_kernel(
        gate_up_ptr, row_stride, weights_ptr, out_ptr, width, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr
    ):
        row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
        columns = block * BLOCK + tl.arange(0, BLOCK)
        inside = columns < width
        raw = tl.load(gate_up_ptr + row * row_stride + columns, mask=inside, other=0.0)
        up = tl.load(gate_up_ptr + row * row_stride + width + columns, mask=inside, other=0.0).to(tl.float32)
        gate = raw.to(tl.float32)
        out = _round(_round(gate / (1.0 + tl.exp(-gate)), raw) * up, raw)
        if HAS_WEIGHTS:
            out = _round(out * tl.load(weights_ptr + row).to(tl.float32), raw)
        tl.store(out_ptr + row * width + columns, out.to(raw.dtype), mask=inside)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, row_stride, weight_ptr, out_ptr, eps, WIDTH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        # F.rms_norm's rounding: normalised and weighed in float32, rounded once.
        wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        inside = columns < WIDTH
        x = tl.load(x_ptr + row * row_stride + columns, mask=inside, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / WIDTH + eps)
        weight = tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * WIDTH + columns, (x * inv_rms * weight).to(out_ptr.dtype.element_ty), mask=inside)
