"""The integer GEMV over packed 4-bit and 8-bit weights (`quant.Packed`): a decode step's one
row of x quantized to 16-bit integers per 32 values, each word of the weight multiplied with
it by `dp4a` (four byte products summed into an int32, one instruction).

Why: `triton_fma_gemv` spends three instructions on each weight value (unpack, convert,
FMA); here a word of eight 4-bit values costs two masks and four dp4a (x's high bytes, signed,
and its low bytes, unsigned: x = 256 hi + lo), so the weight streams with issue slots to
spare. x rounds to 1/32767 of its block's largest value: int8 (llama.cpp's q8_1) moved a real
model's greedy answer within 13 tokens (`scripts/check-dp4a-rounding.py`), 16 bits leave it as it
was. The biases' products take x's exact sums, so only the scales' share sees x rounded:

    sum_k (scale q_k + bias) x_k  ~  scale * sum_b d_b * (sum_{k in b} q_k qx_k) + bias * sum_k x_k

per group, b running over its blocks of 32, qx = round(x / d_b), d_b = max |x in b| / 32767.

A program takes a tile as the FMA GEMV's do (`FmaTile`, `fma_plan`: columns and words a
step, K split where the column blocks are few; DP4A_TILE by default) and fuses what they
fuse: RMSNorm of x first, bias, residual add, SwiGLU over a fused gate_up. Each program
rounds the x of its own steps (a few values a thread, shared by all its columns). One row
only: more rows of a decode step take the FMA GEMV, and a verify's rows come one at a time,
each computed as its decode step is. Off CUDA (Triton's interpreter) dp4a is the sum of the
four byte products in plain integer ops, the same integers.
"""

from __future__ import annotations

import dataclasses

import torch

from ferrum_mac.backends.torch.quant import Packed
from ferrum_mac.backends.torch.kernels.triton_fma_gemv import FMA_NORM_BLOCK, FmaTile, fma_plan
from ferrum_mac.backends.torch.kernels.triton_pdl import LINE_BYTES, launch_options, pdl_for, prefetch_lines
from ferrum_mac.backends.torch.kernels.triton_splits import split_buffers

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

X_BLOCK = 32  # values of x sharing one step (a weight group holds whole blocks)
X_LEVELS = 32767.0  # x's largest magnitude as an integer: 16 bits, symmetric
# A block whose largest value is below this counts as zeros (X_LEVELS over it would overflow
# float32, and 0 * inf is NaN); what it leaves out is below float32's resolution of any sum.
X_SMALLEST = 1e-30
# The FMA tile with half its columns: on the H200 as fast or faster at every Qwen3-8B and 0.6B
# shape (`scripts/check-torch-quant.py --sweep --rows=1 --dp4a`)
DP4A_TILE = FmaTile(columns=32)
# What changes in it by the weight's shape (`dp4a_tile`), from the sweep's best at Qwen3-8B's
# shapes, which together took its 4-bit step from 2.35 to 2.12 ms on the H200: SwiGLU's two
# weights read in longer rows a step, a narrowing weight (down) in narrower column blocks, a
# square one (qkv, o_proj) in wider blocks by more warps. Only 4-bit weights (what was swept) of
# SHAPE_TILES_MIN_BYTES or more take them: Qwen3-0.6B's, all smaller, ran 2% slower with them.
DP4A_SHAPE_TILES = {"swiglu": {"row_bytes": 1024}, "narrowing": {"columns": 16}, "square": {"columns": 64, "warps": 8}}
SHAPE_TILES_MIN_BYTES = 4 << 20  # of packed words


def dp4a_tile(weight: Packed, swiglu: bool) -> FmaTile:
    """The tile `weight` (a fused gate_up with `swiglu`) takes: DP4A_TILE, changed as
    DP4A_SHAPE_TILES says for its shape if it is 4-bit and large enough."""
    n, k = weight.shape[0] // 2 if swiglu else weight.shape[0], weight.shape[1]
    if weight.bits != 4 or weight.words.numel() * weight.words.element_size() < SHAPE_TILES_MIN_BYTES:
        return DP4A_TILE
    shape = "swiglu" if swiglu else "narrowing" if k > n else "square" if n <= 2 * k else "widening"
    return dataclasses.replace(DP4A_TILE, **DP4A_SHAPE_TILES.get(shape, {}))


def dp4a_gemv(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              swiglu: bool = False, splits: int | None = None, tile: FmaTile | None = None) -> torch.Tensor:
    """`triton_quant.gemv` for one row, x as 16-bit integers (`_qgemv_dp4a_kernel`), a program
    taking `tile` (by default `dp4a_tile`'s); `splits` of K: by default as `fma_plan` chooses."""
    rows, k = x.shape
    n_all, k_weight = weight.shape
    n = n_all // 2 if swiglu else n_all
    assert rows == 1 and k_weight == k and weight.bits in (4, 8) and weight.group_size % X_BLOCK == 0
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    tile = tile or dp4a_tile(weight, swiglu)
    block_n, block_w, column_blocks, splits, words_per_split = fma_plan(
        n, k, rows, swiglu, weight.bits, weight.group_size, x.device, tile, splits
    )
    partials, counters = split_buffers(splits, column_blocks, (rows, n_all), x)
    pdl = tile.pdl and pdl_for(x.device, weight.words)
    _qgemv_dp4a_kernel[(column_blocks, splits, 1)](
        x, weight.words, weight.scales, weight.biases, x if norm_weight is None else norm_weight,
        x if bias is None else bias, x if residual is None else residual.contiguous(), out, partials, counters,
        rows, n, k, k * weight.bits // 32, k // weight.group_size, words_per_split, splits, eps,  # (x: any pointer, never read)
        BITS=weight.bits, GROUP=weight.group_size, HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, SWIGLU=swiglu, SPLIT=splits > 1, BLOCK_N=block_n, BLOCK_W=block_w,
        NORM_BLOCK=FMA_NORM_BLOCK, PDL=pdl, PREFETCH_LINES=prefetch_lines(block_n, words_per_split, 4) if pdl else 0,
        LINE_ELEMENTS=LINE_BYTES // 4, ASM=has_dp4a(x.device), num_warps=tile.warps, num_stages=1,
        **launch_options(pdl),
    )
    return out


def has_dp4a(device: torch.device) -> bool:
    """Whether the kernel's dp4a is the instruction (an NVIDIA GPU: PTX), not plain integer ops
    (Triton's interpreter; a ROCm build's "cuda" devices)."""
    return device.type == "cuda" and torch.version.hip is None


def reference(x: torch.Tensor, weight: Packed, levels: float = X_LEVELS) -> torch.Tensor:
    """What `dp4a_gemv` computes for x `(1, K)` (no fusions), in float64 with torch ops: the
    specification its tests hold the kernel to (`levels`: x's largest integer)."""
    out, k = weight.shape
    xf = x.float().view(k // X_BLOCK, X_BLOCK)
    amax = xf.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > X_SMALLEST, levels / amax, torch.zeros_like(amax))
    qx = torch.floor(xf * inv + 0.5).clamp(-levels, levels)
    d = amax / levels
    codes = weight.codes().double().view(out, k // X_BLOCK, X_BLOCK)
    block_dots = (codes * qx.double()[None]).sum(-1) * d.double().view(1, -1)  # (out, blocks)
    per_group = weight.group_size // X_BLOCK
    scale_part = block_dots.view(out, -1, per_group).sum(-1) * weight.scales.double()
    x_sums = x.double().view(-1, weight.group_size).sum(-1)
    return (scale_part + weight.biases.double() * x_sums[None]).sum(-1)[None]


# -- kernels ------------------------------------------------------------------------------------

if triton is not None:
    from ferrum_mac.backends.torch.kernels.triton_fma_gemv import (
        columns_and_words,
        packed_words,
        prefetch_then_wait,
        row_inverse_rms,
        x_at,
    )
    from ferrum_mac.backends.torch.kernels.triton_gemv import finish_split_gemv

    @triton.jit(do_not_specialize=["rows"])
    def _qgemv_dp4a_kernel(
        x_ptr, words_ptr, scales_ptr, biases_ptr, norm_ptr, bias_ptr, residual_ptr, out_ptr, partials_ptr,
        counters_ptr, rows, n, k, word_stride, group_stride, words_per_split, splits, eps,
        BITS: tl.constexpr, GROUP: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr, NORM_BLOCK: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
        LINE_ELEMENTS: tl.constexpr, ASM: tl.constexpr,
    ):
        # One program per (block of BLOCK_N output columns, split of K), as the FMA GEMV's:
        # per step a (BLOCK_N, BLOCK_W) tile of words, a column's words contiguous (a thread
        # loads a few neighbouring words of one column at once). The step's x is loaded,
        # normed, quantized to 16 bits and its bytes packed four a word in the weight words'
        # byte order (`packed_x`); each word's dp4a products (`word_dots`) add up per block of
        # 32 values, times the block's step of x, per group, times the scale; plus the bias
        # times the group's exact sum of x.
        per_word: tl.constexpr = 32 // BITS
        columns, inside, w_begin, w_end = columns_and_words(n, word_stride, words_per_split, BLOCK_N, SPLIT)
        prefetch_then_wait(words_ptr, columns, inside, w_begin, w_end, word_stride, n, SWIGLU, PDL, PREFETCH_LINES,
                           LINE_ELEMENTS)
        inv_rms = row_inverse_rms(x_ptr, 0, rows, k, eps, HAS_NORM, NORM_BLOCK)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        up_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for w0 in range(w_begin, w_end, BLOCK_W):
            low_hi, low_lo, high_hi, high_lo, steps, x_sums = packed_x(
                x_ptr, norm_ptr, rows, k, w0, w_end, inv_rms, HAS_NORM, BITS, GROUP, BLOCK_W
            )
            words, s, b = packed_words(words_ptr, scales_ptr, biases_ptr, columns, inside, w0, w_end, word_stride,
                                       group_stride, BLOCK_W, GROUP // per_word)
            dots = word_dots(words, low_hi, low_lo, high_hi, high_lo, BITS, ASM)
            acc += group_sums(dots, steps, x_sums, s, b, BITS)
            if SWIGLU:
                up_words, up_s, up_b = packed_words(words_ptr, scales_ptr, biases_ptr, columns + n, inside, w0, w_end,
                                                    word_stride, group_stride, BLOCK_W, GROUP // per_word)
                up_dots = word_dots(up_words, low_hi, low_lo, high_hi, high_lo, BITS, ASM)
                up_acc += group_sums(up_dots, steps, x_sums, up_s, up_b, BITS)
        row_ids = tl.arange(0, 1)
        finish_split_gemv(
            acc[None, :], up_acc[None, :], partials_ptr, counters_ptr, tl.program_id(0), tl.program_id(1), splits, rows,
            bias_ptr, residual_ptr, out_ptr, row_ids, row_ids < rows, columns, inside,
            n, HAS_BIAS, HAS_RESIDUAL, SWIGLU, SPLIT,
        )

    @triton.jit
    def packed_x(x_ptr, norm_ptr, rows, k, w0, w_end, inv_rms, HAS_NORM: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_W: tl.constexpr):
        """The row of x under words w0 .. w0 + BLOCK_W (0 past w_end), normed if HAS_NORM, as
        16-bit integers split into a signed high byte and an unsigned low one, each packed four
        a word in the order `word_dots` reads the weight's bytes: (low_hi, low_lo, high_hi,
        high_lo), for 4 bits the values under each word's low nibbles (0, 2, 4, 6) and high
        ones (1, 3, 5, 7); for 8 bits the low pair alone. Also each block of 32 values' step d
        (x rounds to multiples of it) and each group's sum of x, in float32."""
        per_word: tl.constexpr = 32 // BITS
        blocks: tl.constexpr = BLOCK_W * per_word // 32
        wi = w0 + tl.arange(0, BLOCK_W)
        j = tl.arange(0, per_word)
        ks = wi[:, None] * per_word + j[None, :]
        k_in = (wi < w_end)[:, None] & (j < per_word)[None, :]
        norm = tl.load(norm_ptr + ks, mask=k_in, other=0.0).to(tl.float32) if HAS_NORM else None
        x = x_at(x_ptr, 0, rows, k, ks, k_in, norm, inv_rms, HAS_NORM)  # (BLOCK_W, per_word)
        by_block = tl.reshape(x, (blocks, 32))
        largest = tl.max(tl.abs(by_block), axis=1)
        inverse = tl.where(largest > 1e-30, 32767.0 / largest, 0.0)  # (X_SMALLEST, X_LEVELS)
        q = tl.floor(by_block * inverse[:, None] + 0.5)
        q = tl.reshape(tl.minimum(tl.maximum(q, -32767.0), 32767.0).to(tl.int32), (BLOCK_W, per_word))
        halves: tl.constexpr = 2 if BITS == 4 else 1
        shifts = (j // halves * 8)[None, :]
        low = (j % halves == 0)[None, :]
        his, los = ((q >> 8) & 0xFF) << shifts, (q & 0xFF) << shifts
        low_hi, low_lo = tl.sum(tl.where(low, his, 0), axis=1), tl.sum(tl.where(low, los, 0), axis=1)
        high_hi, high_lo = tl.sum(tl.where(low, 0, his), axis=1), tl.sum(tl.where(low, 0, los), axis=1)
        x_sums = tl.sum(tl.reshape(x, (BLOCK_W * per_word // GROUP, GROUP)), axis=1)
        return low_hi, low_lo, high_hi, high_lo, largest * (1.0 / 32767.0), x_sums

    @triton.jit
    def word_dots(words, low_hi, low_lo, high_hi, high_lo, BITS: tl.constexpr, ASM: tl.constexpr):
        """Each word's values times x's 16-bit integers under them, summed: (columns, words)
        int32, as 256 * (the products with x's high bytes) + (those with its low bytes)."""
        zeros = tl.zeros_like(words)
        if BITS == 4:
            low = words & 0x0F0F0F0F
            high = (words >> 4) & 0x0F0F0F0F
            top = dp4a(high, high_hi[None, :], dp4a(low, low_hi[None, :], zeros, True, ASM), True, ASM)
            bottom = dp4a(high, high_lo[None, :], dp4a(low, low_lo[None, :], zeros, False, ASM), False, ASM)
        else:
            top = dp4a(words, low_hi[None, :], zeros, True, ASM)
            bottom = dp4a(words, low_lo[None, :], zeros, False, ASM)
        return top * 256 + bottom

    @triton.jit
    def group_sums(dots, steps, x_sums, scale, bias, BITS: tl.constexpr):
        """Per column, a step's sum over its groups of scale * (sum_b d_b * dots of block b) +
        bias * (the group's sum of x): dots `(columns, words)`, steps `(blocks,)`, x_sums,
        scale and bias `(groups,)` / `(columns, groups)`."""
        words_per_block: tl.constexpr = BITS  # (32 values' words: 32 / (32 / BITS))
        blocks: tl.constexpr = dots.shape[1] // words_per_block
        groups: tl.constexpr = scale.shape[1]
        by_block = tl.sum(tl.reshape(dots, (dots.shape[0], blocks, words_per_block)), axis=2)
        scaled = by_block.to(tl.float32) * steps[None, :]
        by_group = tl.sum(tl.reshape(scaled, (dots.shape[0], groups, blocks // groups)), axis=2)
        return tl.sum(by_group * scale + bias * x_sums[None, :], axis=1)

    @triton.jit
    def dp4a(a, b, c, SIGNED: tl.constexpr, ASM: tl.constexpr):
        """c + the sum of the four products of a's bytes (unsigned) and b's (signed if SIGNED)."""
        if ASM:
            if SIGNED:
                return tl.inline_asm_elementwise(
                    "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
                )
            else:
                return tl.inline_asm_elementwise(
                    "dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
                )
        else:
            total = c
            for i in tl.static_range(4):
                byte = (b << (24 - 8 * i)) >> 24 if SIGNED else (b >> (8 * i)) & 0xFF
                total += ((a >> (8 * i)) & 0xFF) * byte
            return total
