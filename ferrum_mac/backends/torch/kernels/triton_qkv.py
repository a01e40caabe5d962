"""The first half of a decode step's attention in one Triton kernel, for a few rows: the block's
RMSNorm, the fused q/k/v projection, the q and k heads' RMSNorm and RoPE, and k and v written
into the KV pool. The torch path (and `triton_ops.norm_rope_write` after a cuBLAS GEMM) takes
three kernels and stores the projection in between.

A program takes one head's columns of the projection (over a split of K: `triton_splits`),
so whoever finishes the head holds all of it: the q/k norm is a sum over its columns, and a
dimension's RoPE partner is a column of the same head. Rounded where the torch path rounds:
the block's norm once (as F.rms_norm), the projection once, then as `norm_rope_write`.

The module loads without triton; it launches on CUDA tensors, or CPU ones under
`TRITON_INTERPRET=1`.
"""

import torch

from ferrum_mac.backends.torch.kernels.triton_gemv import gemv_splits
from ferrum_mac.backends.torch.kernels.triton_ops import MIN_DOT_ROWS
from ferrum_mac.backends.torch.kernels.triton_pdl import LINE_BYTES, launch_options, pdl_for, prefetch_lines
from ferrum_mac.backends.torch.kernels.triton_splits import SPLIT_COUNTERS, split_counters

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

TILE_BYTES = 16384  # of the weight, per program and step of its loop over K (a head's 128 columns x 64)
STAGES = 4
# Splits of K: enough to give every SM one program, about the fastest split timed on both
# Qwen3 shapes.
PROGRAMS_PER_SM = 1


def fits(head_dim: int, rows: int) -> bool:
    """Whether the kernel takes this layout: a head of a power-of-two width (its RoPE partners
    found by flipping halves or pairs), a few rows."""
    return head_dim & (head_dim - 1) == 0 and head_dim >= 16 and rows <= MIN_DOT_ROWS


def norm_qkv_rope_write(
    x: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
    heads: int, qk_weight: torch.Tensor | None, qk_eps: float, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
    kv: torch.Tensor, places: torch.Tensor, splits: int | None = None, block_k: int | None = None,
) -> torch.Tensor:
    """x `(T, hidden)` -> roped q `(T, heads, dim)`; roped k and v go into the pool layer `kv`
    `(2, kv_heads, token rows, dim)` at `places` (as `triton_ops.norm_rope_write`).

    `weight` `((heads + 2 * kv_heads) * dim, hidden)`: q, k and v stacked (+ `bias`);
    `norm_weight`: the block's RMSNorm; `qk_weight` `(heads + kv_heads, dim)`: each q and k
    head's RMSNorm weight, or None; cos and signed sin: `Rope.tables`, `(T, 1, dim)`.
    `splits` of K and `block_k` (for timing): by default `gemv_splits`' and TILE_BYTES'."""
    rows, hidden = x.shape
    dim, kv_heads = kv.shape[-1], kv.shape[1]
    all_heads = heads + 2 * kv_heads
    assert (
        fits(dim, rows) and weight.shape == (all_heads * dim, hidden) and weight.is_contiguous() and kv.is_contiguous()
    )
    x = x.contiguous()
    cos, sin = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
    q = torch.empty((rows, heads, dim), dtype=x.dtype, device=x.device)
    block_k = block_k or min(triton.next_power_of_2(hidden), max(16, TILE_BYTES // (dim * weight.element_size())))
    splits, k_per_split = gemv_splits(all_heads, hidden, block_k, x.device, splits, per_sm=PROGRAMS_PER_SM)
    assert all_heads <= SPLIT_COUNTERS
    partials = torch.empty((splits, rows, all_heads * dim), dtype=torch.float32, device=x.device)
    has_qk_weight = qk_weight is not None
    pdl = pdl_for(x.device, weight)
    lines = prefetch_lines(dim, k_per_split, weight.element_size())
    _norm_qkv_rope_write_kernel[(all_heads, splits)](
        x, norm_weight, weight, x if bias is None else bias, qk_weight.contiguous() if has_qk_weight else x,
        cos, sin, q, kv, places, kv.stride(0), partials, split_counters(x.device), rows, norm_eps, qk_eps, splits,
        ROWS_PAD=MIN_DOT_ROWS, HEADS=heads, KV_HEADS=kv_heads, DIM=dim, K=hidden, K_PER_SPLIT=k_per_split,
        BLOCK_K=block_k, NORM_BLOCK=min(4096, triton.next_power_of_2(hidden)), HAS_BIAS=bias is not None,
        HAS_QK_WEIGHT=has_qk_weight, INTERLEAVED=interleaved,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl, PREFETCH_LINES=lines,
        LINE_ELEMENTS=LINE_BYTES // weight.element_size(), num_warps=4, num_stages=STAGES, **launch_options(pdl),
    )
    return q


if triton is not None:
    from ferrum_mac.backends.torch.kernels.triton_gemv import inverse_rms, matmul_columns
    from ferrum_mac.backends.torch.kernels.triton_ops import qk_norm_rope
    from ferrum_mac.backends.torch.kernels.triton_pdl import prefetch_rows, wait_for_previous
    from ferrum_mac.backends.torch.kernels.triton_splits import arrived_last, sum_of_splits

    @triton.jit
    def _norm_qkv_rope_write_kernel(
        x_ptr, norm_ptr, weight_ptr, bias_ptr, qk_weight_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, places_ptr,
        kv_half_stride, partials_ptr, counters_ptr, rows, norm_eps, qk_eps, splits,
        ROWS_PAD: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, K: tl.constexpr,
        K_PER_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_QK_WEIGHT: tl.constexpr, INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
        PREFETCH_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr,
    ):
        # One program per (head, split of K); heads run q heads, then k heads, then v heads.
        # Each stores its float32 sums in `partials` (splits, rows, all heads' columns); the
        # last of a head's programs to finish sums them and finishes the head.
        N: tl.constexpr = (HEADS + 2 * KV_HEADS) * DIM
        head, split = tl.program_id(0), tl.program_id(1)
        dims = tl.arange(0, DIM)
        columns = head * DIM + dims
        k_begin = split * K_PER_SPLIT
        if PDL and PREFETCH_LINES > 0:  # the weight: no kernel writes it, so before the wait
            prefetch_rows(weight_ptr + columns[:, None].to(tl.int64) * K, columns < N, k_begin,
                          tl.minimum(k_begin + K_PER_SPLIT, K), PREFETCH_LINES, LINE_ELEMENTS)
        wait_for_previous(PDL)
        row_ids = tl.arange(0, ROWS_PAD)
        live = row_ids < rows
        inv_rms = inverse_rms(x_ptr, rows, row_ids, norm_eps, K, NORM_BLOCK)
        acc, _ = matmul_columns(
            x_ptr, weight_ptr, norm_ptr, inv_rms, row_ids, live, columns, columns < N, k_begin,
            tl.minimum(k_begin + K_PER_SPLIT, K), N, K, True, False, BLOCK_K, PRECISION,
        )
        here = row_ids[:, None] * N + columns[None, :]
        mine = live[:, None] & (columns < N)[None, :]
        split_stride = rows * N
        tl.store(partials_ptr + split * split_stride + here, acc, mask=mine)
        if arrived_last(counters_ptr + head, splits):
            acc = sum_of_splits(partials_ptr, here, mine, splits, split_stride)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + columns).to(tl.float32)[None, :]
            raw = acc.to(q_ptr.dtype.element_ty)  # the projection's output, as torch stores it
            _rope_and_write(
                raw, head, row_ids, live, dims, qk_weight_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, places_ptr, kv_half_stride,
                qk_eps, HEADS, KV_HEADS, DIM, HAS_QK_WEIGHT, INTERLEAVED,
            )

    @triton.jit
    def _rope_and_write(
        raw, head, row_ids, live, dims, qk_weight_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, places_ptr, kv_half_stride,
        eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HAS_QK_WEIGHT: tl.constexpr,
        INTERLEAVED: tl.constexpr,
    ):
        """A head's projection `(rows, DIM)`: a q head normed, roped and stored in q; a k head
        normed, roped and written to the pool; a v head written as it is."""
        if head >= HEADS + KV_HEADS:
            places = tl.load(places_ptr + row_ids * KV_HEADS + head - HEADS - KV_HEADS, mask=live, other=0)
            tl.store(kv_ptr + kv_half_stride + places[:, None] * DIM + dims[None, :], raw, mask=live[:, None])
        else:
            w, partner_w = None, None
            if HAS_QK_WEIGHT:
                w = tl.load(qk_weight_ptr + head * DIM + dims).to(tl.float32)[None, :]
                partner_w = _partners(w, INTERLEAVED)
            table = row_ids[:, None] * DIM + dims[None, :]
            cos = tl.load(cos_ptr + table, mask=live[:, None], other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + table, mask=live[:, None], other=0.0).to(tl.float32)
            roped = qk_norm_rope(
                raw, _partners(raw.to(tl.float32), INTERLEAVED), w, partner_w, cos, sin, eps, DIM, HAS_QK_WEIGHT
            )
            if head < HEADS:
                tl.store(q_ptr + (row_ids[:, None] * HEADS + head) * DIM + dims[None, :], roped, mask=live[:, None])
            else:
                places = tl.load(places_ptr + row_ids * KV_HEADS + head - HEADS, mask=live, other=0)
                tl.store(kv_ptr + places[:, None] * DIM + dims[None, :], roped, mask=live[:, None])

    @triton.jit
    def _partners(x, INTERLEAVED: tl.constexpr):
        """Each dimension's RoPE partner along x's last axis (a power of two): 2i <-> 2i+1
        (INTERLEAVED), else i <-> i + dim/2."""
        rows: tl.constexpr = x.shape[0]
        dim: tl.constexpr = x.shape[1]
        if INTERLEAVED:
            return tl.flip(x.reshape(rows, dim // 2, 2), 2).reshape(rows, dim)
        return tl.flip(x.reshape(rows, 2, dim // 2), 1).reshape(rows, dim)
