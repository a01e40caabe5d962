"""The FMA GEMV over packed 4-bit and 8-bit weights (`quant.Packed`): `triton_quant.gemv` for
a decode step's 1 to FMA_MAX_ROWS rows, made to stream the weight at memory speed. It
multiplies in registers (no tensor cores: a row or four is 1/16 to 1/4 of a tl.dot tile, and
feeding tl.dot costs a shared memory round trip per tile) and fuses what `triton_quant.gemv`
fuses: optional RMSNorm of x first, bias, residual add, SwiGLU over a fused gate_up (a
program takes matching gate and up columns); K split over several programs where the column
blocks are fewer than the SMs (`triton_splits`).

`fma_gemv` computes sum_k (scale q_k + bias) x_k as scale * sum q_k x_k + bias * sum x_k
per group, in float32 from the exact values (it does not round the weight to x's dtype
first); its instructions per weight value are what bound it, so a value costs one integer
op (it is or-ed into a float's mantissa), one add and one FMA per row (`values_at`).

`fma_expert_gemv` is the same kernel over a stack of packed MoE experts, a token-expert
pair at a time (the expert's id read on the device): a decode step's experts at memory speed.

What a program takes is an `FmaTile` (FMA_TILE by default; `fma_plan` says how a shape
runs); `scripts/check-torch-quant.py --sweep` times the tile's variants. Entry functions
launch on whatever tensors they are given (CUDA, or CPU tensors under `TRITON_INTERPRET=1`);
the module loads without triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum_mac.backends.torch.quant import Packed
from ferrum_mac.backends.torch.kernels.triton_gemv import gemv_splits
from ferrum_mac.backends.torch.kernels.triton_ops import multiprocessors
from ferrum_mac.backends.torch.kernels.triton_pdl import LINE_BYTES, PDL_MAX_BYTES, launch_options, pdl_for, prefetch_lines
from ferrum_mac.backends.torch.kernels.triton_splits import SPLIT_COUNTERS, split_buffers, split_counters

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

FMA_MAX_ROWS = 4  # (more rows take `triton_quant`'s tl.dot GEMV)
FMA_MAX_SPLITS = 16  # programs sharing a column block's K, at most
FMA_MIN_COLUMNS = 8  # a program's columns, at least
FMA_RESIDENT = 2  # programs of the default tile's bytes a step an SM holds at once (their registers)
FMA_NORM_BLOCK = 1024
FLOAT_2_23 = 0x4B000000  # 2.0**23's bits


@dataclass(frozen=True)
class FmaTile:
    """What a program of the FMA GEMV takes (`blocks`): per step of K, `row_bytes` of the
    packed weight of each of its columns (a whole number of 128-byte lines, so whole sectors
    are read); `columns` for a one-row GEMV. A thread holds a few neighbouring words of a
    column (a 16-byte load), so the columns are what spread the cost of x (load, norm,
    scale) over more weight: as many as fit the registers, fewer for more rows and for
    SwiGLU's two weights. Where that leaves fewer than `per_sm` programs an SM even with K
    split (at most FMA_MAX_SPLITS ways), the columns halve until it does not (small shapes:
    more, smaller programs keep more loads in flight; 0: neither). `longer_rows`: as they
    halve, a step's rows double (up to the whole of K), so that a program keeps its bytes a
    step and takes fewer steps: a small weight is then read in one step a program, every
    load in flight at once, and K is split less or not at all (no partial sums to add up),
    where each step and the split's sum cost a round trip to memory more; and once rows have
    grown so, the columns stop halving where every SM has such a program. Taken only where
    those programs are one wave of FMA_RESIDENT an SM (else the columns' rule alone), as
    a tile of the default's bytes takes the registers of that many."""

    columns: int = 64  # (these two: the sweep's choice on the H100, `scripts/check-torch-quant.py --sweep`)
    row_bytes: int = 512
    warps: int = 4
    prefetch: bool = False  # each step loads the next step's weight before it computes (else Triton's schedule)
    per_sm: int = 4
    pdl: bool = True  # launched early where `triton_pdl` has a kernel of this weight's size launch early
    longer_rows: bool = True

    def blocks(self, n: int, k: int, rows: int, swiglu: bool, bits: int, group: int, sms: int) -> tuple[int, int]:
        """(columns, K) per program and step for `rows` rows of x and a weight `(n, k)`."""
        if self.longer_rows:
            block_n, block_k = self._blocks(n, k, rows, swiglu, bits, group, sms, True)
            if triton.cdiv(n, block_n) * triton.cdiv(k, block_k) <= FMA_RESIDENT * sms:
                return block_n, block_k
        return self._blocks(n, k, rows, swiglu, bits, group, sms, False)

    def _blocks(self, n: int, k: int, rows: int, swiglu: bool, bits: int, group: int, sms: int,
                longer_rows: bool) -> tuple[int, int]:
        weights = triton.next_power_of_2(rows) * (2 if swiglu else 1)
        block_n, block_k = max(FMA_MIN_COLUMNS, self.columns // weights), max(group, self.row_bytes * 8 // bits)
        steps, row_k = min(FMA_MAX_SPLITS, triton.cdiv(k, block_k)), block_k
        while block_n > FMA_MIN_COLUMNS and triton.cdiv(n, block_n) * steps < self.per_sm * sms:
            if block_k > row_k and steps == 1 and triton.cdiv(n, block_n) >= sms:
                break  # (rows grown to the whole of K, a program an SM at least: halving would only thin them)
            block_n //= 2
            if longer_rows and block_k < k:
                block_k *= 2
                steps = min(FMA_MAX_SPLITS, triton.cdiv(k, block_k))
        return block_n, block_k


FMA_TILE = FmaTile()


def fma_gemv(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             swiglu: bool = False, splits: int | None = None, tile: FmaTile = FMA_TILE) -> torch.Tensor:
    """`triton_quant.gemv` for up to FMA_MAX_ROWS rows, multiplied in registers
    (`_qgemv_fma_kernel`), a program taking `tile`; `splits` of K: by default as many as
    `tile.per_sm` asks."""
    rows, k = x.shape
    n_all, k_weight = weight.shape
    n = n_all // 2 if swiglu else n_all
    assert rows <= FMA_MAX_ROWS and k_weight == k
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    plan = fma_plan(n, k, rows, swiglu, weight.bits, weight.group_size, x.device, tile, splits)
    block_n, block_w, column_blocks, splits, words_per_split = plan
    word_stride = k * weight.bits // 32
    partials, counters = split_buffers(splits, column_blocks, (rows, n_all), x)
    pdl = tile.pdl and pdl_for(x.device, weight.words)
    _qgemv_fma_kernel[(column_blocks, splits, 1)](
        x, weight.words, weight.scales, weight.biases, x if norm_weight is None else norm_weight,
        x if bias is None else bias, x if residual is None else residual.contiguous(), out, partials, counters,
        x, x, rows, n, k, word_stride, k // weight.group_size, words_per_split, splits, eps, FLOAT_2_23, 0, 1,  # (x: any pointer, never read)
        ROWS=triton.next_power_of_2(rows), BITS=weight.bits, GROUP=weight.group_size,
        HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        SWIGLU=swiglu, SPLIT=splits > 1, BLOCK_N=block_n, BLOCK_W=block_w, PREFETCH=tile.prefetch, NORM_BLOCK=FMA_NORM_BLOCK,
        PDL=pdl, PREFETCH_LINES=prefetch_lines(block_n, words_per_split, 4) if pdl else 0, LINE_ELEMENTS=LINE_BYTES // 4,
        IDS=False, SUM_PAIRS=False, num_warps=tile.warps, num_stages=1, **launch_options(pdl),
    )
    return out


def fma_expert_gemv(x: torch.Tensor, ids: torch.Tensor, weight: Packed, experts: int,
                    pair_weights: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                    splits: int | None = None, tile: FmaTile = FMA_TILE) -> torch.Tensor:
    """`fma_gemv` of each token-expert pair over its expert's rows of a stack of `experts`
    packed experts (`weight`: `(experts * out, in)`), the expert read on the device from `ids`
    `(T, k)` (no host sync). Either gate_up with SwiGLU (`pair_weights` `(T, k)` given): x
    `(T, in)`, each pair taking its token's row -> `(T * k, out / 2)`, silu(gate) * up * the
    pair's router weight, rounded as `triton_moe._swiglu_as_torch` rounds; or down
    (`residual` `(T, out)` given): x `(T * k, in)`, a row a pair -> residual + the sum of each
    token's k pairs' products `(T, out)`, each pair's product rounded to x's dtype, then their
    sum, then the residual add (where torch's gathered route rounds them). `splits` of K: by
    default as `fma_plan` chooses for a token's pairs' columns side by side."""
    swiglu = pair_weights is not None
    assert swiglu != (residual is not None)
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    n_all, k = weight.shape
    n_all //= experts
    n = n_all // 2 if swiglu else n_all
    assert x.shape == ((tokens if swiglu else pairs), k) and ids.is_contiguous()
    x = x.contiguous()
    out = torch.empty((pairs if swiglu else tokens, n), dtype=x.dtype, device=x.device)
    # a token's pairs' columns side by side, as one wide weight, for the tile's rule of programs
    # an SM: the same tiles and sums for a token however many come along (a verify's rows are
    # their decode steps', bit for bit)
    plan = fma_plan(top_k * n, k, 1, swiglu, weight.bits, weight.group_size, x.device, tile, splits)
    block_n, block_w, _, splits, _ = plan
    words = k * weight.bits // 32
    block_w = min(block_w, triton.next_power_of_2(words))  # (a small expert's rows: no step past them)
    splits, words_per_split = gemv_splits(1, words, block_w, x.device, splits)
    column_blocks = triton.cdiv(n, block_n)
    partials, counters = x, x  # (none: each program finishes its own columns)
    if splits > 1 or not swiglu:  # (down: a token's pairs add up as splits do)
        assert (pairs if swiglu else tokens) * column_blocks <= SPLIT_COUNTERS
        partials = torch.empty((splits, pairs, n_all), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    read = pairs * weight.nbytes // experts
    pdl = tile.pdl and pdl_for(x.device) and read <= PDL_MAX_BYTES
    _qgemv_fma_kernel[(column_blocks, splits, pairs)](
        x, weight.words, weight.scales, weight.biases, x, x, x if residual is None else residual.contiguous(), out,
        partials, counters, ids, x if pair_weights is None else pair_weights.contiguous(),
        1, n, k, words, k // weight.group_size, words_per_split, splits, 0.0, FLOAT_2_23, n_all,
        top_k,  # (x: any pointer, never read)
        ROWS=1, BITS=weight.bits, GROUP=weight.group_size, HAS_NORM=False, HAS_BIAS=False, HAS_RESIDUAL=False,
        SWIGLU=swiglu, SPLIT=splits > 1, BLOCK_N=block_n, BLOCK_W=block_w, PREFETCH=tile.prefetch,
        NORM_BLOCK=FMA_NORM_BLOCK, PDL=pdl, PREFETCH_LINES=0, LINE_ELEMENTS=LINE_BYTES // 4,
        IDS=True, SUM_PAIRS=not swiglu, num_warps=tile.warps, num_stages=1, **launch_options(pdl),
    )
    return out


def fma_plan(n: int, k: int, rows: int, swiglu: bool, bits: int, group: int, device: torch.device,
             tile: FmaTile = FMA_TILE, splits: int | None = None) -> tuple[int, int, int, int, int]:
    """How `fma_gemv` runs `rows` rows over a weight of `n` columns (each of gate and up with
    `swiglu`) and `k` values: (columns a program, words per step, column blocks, splits of
    K, words per split). `splits`: by default enough to give each SM `tile.per_sm` programs
    (at most FMA_MAX_SPLITS)."""
    sms = multiprocessors(device)
    block_n, block_k = tile.blocks(n, k, rows, swiglu, bits, group, sms)
    block_w = block_k * bits // 32  # (a whole number of groups)
    column_blocks = triton.cdiv(n, block_n)
    if splits is None:
        splits = max(1, min(FMA_MAX_SPLITS, triton.cdiv(tile.per_sm * sms, column_blocks)))
    splits, words_per_split = gemv_splits(column_blocks, k * bits // 32, block_w, device, splits)
    return block_n, block_w, column_blocks, splits, words_per_split


# -- kernels ------------------------------------------------------------------------------------

if triton is not None:
    from ferrum_mac.backends.torch.kernels.triton_gemv import finish_split_gemv
    from ferrum_mac.backends.torch.kernels.triton_moe import _swiglu_as_torch
    from ferrum_mac.backends.torch.kernels.triton_pdl import prefetch_rows, wait_for_previous
    from ferrum_mac.backends.torch.kernels.triton_splits import arrived_last, sum_of_splits

    # `rows` stays a runtime value: Triton would make a 1 a constant, which `finish_split_gemv`
    # then multiplies with the runtime `n` as if both were
    @triton.jit(do_not_specialize=["rows"])
    def _qgemv_fma_kernel(
        x_ptr, words_ptr, scales_ptr, biases_ptr, norm_ptr, bias_ptr, residual_ptr, out_ptr, partials_ptr,
        counters_ptr, ids_ptr, pair_weights_ptr, rows, n, k, word_stride, group_stride, words_per_split, splits, eps,
        float_2_23, expert_rows, top_k,
        ROWS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_NORM: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PREFETCH: tl.constexpr, NORM_BLOCK: tl.constexpr, PDL: tl.constexpr,
        PREFETCH_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr, IDS: tl.constexpr, SUM_PAIRS: tl.constexpr,
    ):
        # One program per (block of BLOCK_N output columns, split of K), as `triton_quant`'s
        # _qgemv_kernel, but no tl.dot: per step a (BLOCK_N, BLOCK_W) tile of words (a
        # column's words contiguous, so each thread loads a few neighbouring words of one
        # column with one 16-byte load); value j of every word is unpacked at once
        # (`values_at`) and multiplied with each row's x at those places into per-word sums
        # of q x; per group, those sums times the scale plus the bias times the sum of x are
        # the group's share of (scale q + bias) x. Everything stays in the words' layout but
        # the per-group sums (a small shuffle a step). The sizes the compiler needs known
        # (strides, the split) are ints it specializes as multiples of 16. x's rows are ROWS
        # (a power of 2 up to 4), each with its own sums (acc0..acc3, up0..up3), padding rows
        # masked. IDS (`fma_expert_gemv`): a third grid axis of token-expert pairs, each program
        # over its pair's expert's rows of the stacked weight (`expert_rows` an expert) and its
        # pair's row of x (its token's with SWIGLU, `top_k` pairs a token), finished by
        # `finish_pair`.
        per_word: tl.constexpr = 32 // BITS
        block, split = tl.program_id(0), tl.program_id(1)
        columns, inside, w_begin, w_end = columns_and_words(n, word_stride, words_per_split, BLOCK_N, SPLIT)
        prefetch_then_wait(words_ptr, columns, inside, w_begin, w_end, word_stride, n, SWIGLU, PDL, PREFETCH_LINES,
                           LINE_ELEMENTS)
        if IDS:  # (after the wait: the ids are the kernel before's)
            pair = tl.program_id(2)
            first_row = tl.load(ids_ptr + pair).to(tl.int64) * expert_rows
            words_ptr += first_row * word_stride
            scales_ptr += first_row * group_stride
            biases_ptr += first_row * group_stride
            if SWIGLU:  # (the token's row)
                x_ptr += (pair // top_k).to(tl.int64) * k
            else:
                x_ptr += pair.to(tl.int64) * k
        inv0 = row_inverse_rms(x_ptr, 0, rows, k, eps, HAS_NORM, NORM_BLOCK)
        inv1 = row_inverse_rms(x_ptr, 1, rows, k, eps, HAS_NORM and ROWS > 1, NORM_BLOCK)
        inv2 = row_inverse_rms(x_ptr, 2, rows, k, eps, HAS_NORM and ROWS > 2, NORM_BLOCK)
        inv3 = row_inverse_rms(x_ptr, 3, rows, k, eps, HAS_NORM and ROWS > 3, NORM_BLOCK)
        zeros = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc0, acc1, acc2, acc3 = zeros, zeros, zeros, zeros
        up0, up1, up2, up3 = zeros, zeros, zeros, zeros
        if PREFETCH:  # the first step's words, scales and biases (gate's, and up's with SWIGLU)
            next_words, next_s, next_b = packed_words(words_ptr, scales_ptr, biases_ptr, columns, inside, w_begin,
                                                      w_end, word_stride, group_stride, BLOCK_W, GROUP // per_word)
            if SWIGLU:
                next_up_words, next_up_s, next_up_b = packed_words(
                    words_ptr, scales_ptr, biases_ptr, columns + n, inside, w_begin, w_end, word_stride, group_stride,
                    BLOCK_W, GROUP // per_word,
                )
        for w0 in range(w_begin, w_end, BLOCK_W):
            wi = w0 + tl.arange(0, BLOCK_W)
            w_in = wi < w_end
            if PREFETCH:  # this step's, loaded during the step before; the next step's loaded now
                words, s, b = next_words, next_s, next_b
                next_words, next_s, next_b = packed_words(words_ptr, scales_ptr, biases_ptr, columns, inside,
                                                          w0 + BLOCK_W, w_end, word_stride, group_stride, BLOCK_W,
                                                          GROUP // per_word)
                if SWIGLU:
                    up_words, up_s, up_b = next_up_words, next_up_s, next_up_b
                    next_up_words, next_up_s, next_up_b = packed_words(
                        words_ptr, scales_ptr, biases_ptr, columns + n, inside, w0 + BLOCK_W, w_end, word_stride,
                        group_stride, BLOCK_W, GROUP // per_word,
                    )
                else:
                    up_words, up_s, up_b = words, s, b
            else:
                words, s, b = packed_words(words_ptr, scales_ptr, biases_ptr, columns, inside, w0, w_end, word_stride,
                                           group_stride, BLOCK_W, GROUP // per_word)
                if SWIGLU:
                    up_words, up_s, up_b = packed_words(words_ptr, scales_ptr, biases_ptr, columns + n, inside, w0,
                                                        w_end, word_stride, group_stride, BLOCK_W, GROUP // per_word)
                else:
                    up_words, up_s, up_b = words, s, b
            high, up_high = high_half(words), high_half(up_words)
            sums = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
            sums0, sums1, sums2, sums3, ups0, ups1, ups2, ups3 = sums, sums, sums, sums, sums, sums, sums, sums
            x_sums = tl.zeros([BLOCK_W], dtype=tl.float32)
            xs0, xs1, xs2, xs3 = x_sums, x_sums, x_sums, x_sums
            # value j of every word at once: unpacked once, multiplied with each row's x there
            for j in tl.static_range(per_word):
                v = values_at(words if j < per_word // 2 else high, float_2_23, j % (per_word // 2) * BITS, BITS)
                u = (
                    values_at(up_words if j < per_word // 2 else up_high, float_2_23, j % (per_word // 2) * BITS, BITS)
                    if SWIGLU
                    else v
                )
                ks = wi * per_word + j
                norm = tl.load(norm_ptr + ks, mask=w_in, other=0.0).to(tl.float32) if HAS_NORM else None
                x = x_at(x_ptr, 0, rows, k, ks, w_in, norm, inv0, HAS_NORM)
                xs0, sums0, ups0 = times_x(xs0, sums0, ups0, v, u, x, j % (per_word // 2) * BITS, SWIGLU)
                if ROWS > 1:
                    x = x_at(x_ptr, 1, rows, k, ks, w_in, norm, inv1, HAS_NORM)
                    xs1, sums1, ups1 = times_x(xs1, sums1, ups1, v, u, x, j % (per_word // 2) * BITS, SWIGLU)
                if ROWS > 2:
                    x = x_at(x_ptr, 2, rows, k, ks, w_in, norm, inv2, HAS_NORM)
                    xs2, sums2, ups2 = times_x(xs2, sums2, ups2, v, u, x, j % (per_word // 2) * BITS, SWIGLU)
                    x = x_at(x_ptr, 3, rows, k, ks, w_in, norm, inv3, HAS_NORM)
                    xs3, sums3, ups3 = times_x(xs3, sums3, ups3, v, u, x, j % (per_word // 2) * BITS, SWIGLU)
            acc0, up0 = plus_groups(acc0, up0, sums0, ups0, xs0, s, b, up_s, up_b, SWIGLU)
            if ROWS > 1:
                acc1, up1 = plus_groups(acc1, up1, sums1, ups1, xs1, s, b, up_s, up_b, SWIGLU)
            if ROWS > 2:
                acc2, up2 = plus_groups(acc2, up2, sums2, ups2, xs2, s, b, up_s, up_b, SWIGLU)
                acc3, up3 = plus_groups(acc3, up3, sums3, ups3, xs3, s, b, up_s, up_b, SWIGLU)

        if IDS:
            finish_pair(acc0, up0, partials_ptr, counters_ptr, pair_weights_ptr, residual_ptr, out_ptr, block,
                        split, splits, pair, top_k, columns, inside, n, SWIGLU, SPLIT, SUM_PAIRS)
        else:
            row_ids = tl.arange(0, ROWS)
            live = row_ids < rows
            acc = rows_stacked(row_ids, acc0, acc1, acc2, acc3)
            up_acc = rows_stacked(row_ids, up0, up1, up2, up3)
            finish_split_gemv(
                acc, up_acc, partials_ptr, counters_ptr, block, split, splits, rows,
                bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
                n, HAS_BIAS, HAS_RESIDUAL, SWIGLU, SPLIT,
            )

    @triton.jit
    def columns_and_words(n, word_stride, words_per_split, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
        """A GEMV program's block of columns, which of them are inside `n`, and the words of
        its split of K (all of them unless SPLIT): (columns, inside, w_begin, w_end)."""
        columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPLIT:
            w_begin = tl.program_id(1) * words_per_split
            w_end = tl.minimum(w_begin + words_per_split, word_stride)
        else:
            w_begin, w_end = 0, word_stride
        return columns, columns < n, w_begin, w_end

    @triton.jit
    def prefetch_then_wait(words_ptr, columns, inside, w_begin, w_end, word_stride, n, SWIGLU: tl.constexpr,
                           PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr):
        """With PDL, the program's first lines of its weight rows (and up's with SWIGLU)
        prefetched, then the wait for the kernel before: no kernel writes the weight, so it
        may be read before the wait (see triton_pdl)."""
        if PDL and PREFETCH_LINES > 0:
            rows_ptr = words_ptr + columns[:, None].to(tl.int64) * word_stride
            prefetch_rows(rows_ptr, inside, w_begin, w_end, PREFETCH_LINES, LINE_ELEMENTS)
            if SWIGLU:
                prefetch_rows(rows_ptr + n * word_stride, inside, w_begin, w_end, PREFETCH_LINES, LINE_ELEMENTS)
        wait_for_previous(PDL)

    @triton.jit
    def finish_pair(acc, up_acc, partials_ptr, counters_ptr, pair_weights_ptr, residual_ptr, out_ptr, block, split,
                    splits, pair, top_k, columns, inside, n, SWIGLU: tl.constexpr, SPLIT: tl.constexpr,
                    SUM_PAIRS: tl.constexpr):
        """A pair's float32 sums of its columns (one split's) -> the output. SWIGLU: the
        pair's activation, silu(gate) * up * its router weight (the last of its splits to
        arrive adds them up first). SUM_PAIRS: the last of the token's pairs and splits to
        arrive sums, per pair in split order, rounds each pair's product, adds them up in
        slot order, rounds, adds the residual. Partials `(splits, pairs, width)`, a counter a
        (pair or token, block)."""
        pairs = tl.num_programs(2)
        width = 2 * n if SWIGLU else n
        split_stride = pairs * width
        here = pair * width + columns
        if SWIGLU:
            if SPLIT:
                tl.store(partials_ptr + split * split_stride + here, acc, mask=inside)
                tl.store(partials_ptr + split * split_stride + n + here, up_acc, mask=inside)
                if arrived_last(counters_ptr + pair * tl.num_programs(0) + block, splits):
                    acc = sum_of_splits(partials_ptr, here, inside, splits, split_stride)
                    up_acc = sum_of_splits(partials_ptr, n + here, inside, splits, split_stride)
                    _store_weighted_swiglu(acc, up_acc, pair_weights_ptr, out_ptr, pair, columns, inside, n)
            else:
                _store_weighted_swiglu(acc, up_acc, pair_weights_ptr, out_ptr, pair, columns, inside, n)
        if SUM_PAIRS:
            token = pair // top_k
            tl.store(partials_ptr + split * split_stride + here, acc, mask=inside)
            if arrived_last(counters_ptr + token * tl.num_programs(0) + block, splits * top_k):
                dtype = out_ptr.dtype.element_ty
                total = tl.zeros_like(acc)
                for slot in range(top_k):
                    product = sum_of_splits(partials_ptr, (token * top_k + slot) * width + columns, inside, splits,
                                            split_stride)
                    total += product.to(dtype).to(tl.float32)
                residual = tl.load(residual_ptr + token * n + columns, mask=inside, other=0.0).to(tl.float32)
                out = total.to(dtype).to(tl.float32) + residual
                tl.store(out_ptr + token * n + columns, out.to(dtype), mask=inside)

    @triton.jit
    def _store_weighted_swiglu(gate, up, pair_weights_ptr, out_ptr, pair, columns, inside, n):
        weight = tl.load(pair_weights_ptr + pair).to(tl.float32)
        out = _swiglu_as_torch(gate, up, weight, out_ptr.dtype.element_ty)
        tl.store(out_ptr + pair * n + columns, out, mask=inside)

    @triton.jit
    def packed_words(words_ptr, scales_ptr, biases_ptr, columns, inside, w0, w_end, word_stride, group_stride,
                     BLOCK_W: tl.constexpr, WORDS_PER_GROUP: tl.constexpr):
        """The weight's words (columns, BLOCK_W words from w0) (0 outside `inside` and past
        w_end), and the scales and biases (columns, groups) of their groups, in float32."""
        rows = columns[:, None].to(tl.int64)
        wi = w0 + tl.arange(0, BLOCK_W)
        mask = inside[:, None] & (wi < w_end)[None, :]
        words = tl.load(words_ptr + rows * word_stride + wi[None, :], mask=mask, other=0)
        gi = w0 // WORDS_PER_GROUP + tl.arange(0, wi.shape[0] // WORDS_PER_GROUP)
        groups = rows * group_stride + gi[None, :]
        g_mask = inside[:, None] & (gi * WORDS_PER_GROUP < w_end)[None, :]
        scale = tl.load(scales_ptr + groups, mask=g_mask, other=0.0).to(tl.float32)
        bias = tl.load(biases_ptr + groups, mask=g_mask, other=0.0).to(tl.float32)
        return words, scale, bias

    @triton.jit
    def x_at(x_ptr, row, rows, k, ks, k_in, norm, inv_rms, HAS_NORM: tl.constexpr):
        """Row `row` of x at `ks` in float32 (0 past `rows`), normed if HAS_NORM: by 1/rms and
        the norm weight in float32, rounded once to x's dtype (as F.rms_norm)."""
        x = tl.load(x_ptr + row * k + ks, mask=k_in & (row < rows), other=0.0)
        if HAS_NORM:
            x = (x.to(tl.float32) * inv_rms * norm).to(x.dtype)
        return x.to(tl.float32)

    @triton.jit
    def times_x(x_sums, sums, up_sums, values, up_values, x, SHIFT: tl.constexpr, SWIGLU: tl.constexpr):
        """The running sums of a row over a step, plus the values (read SHIFT bits up) times x."""
        x_scaled = x * (1.0 / (1 << SHIFT))  # (exact)
        sums += values * x_scaled[None, :]
        if SWIGLU:
            up_sums += up_values * x_scaled[None, :]
        return x_sums + x, sums, up_sums

    @triton.jit
    def plus_groups(acc, up_acc, sums, up_sums, x_sums, scale, bias, up_scale, up_bias, SWIGLU: tl.constexpr):
        """acc (and up_acc) plus a step's sums of q x per word, summed per group and scaled,
        and the biases times the group's sums of x: sum (scale q + bias) x."""
        groups: tl.constexpr = scale.shape[1]
        x_sums = per_group(x_sums[None, :], groups)
        acc += tl.sum(per_group(sums, groups) * scale + bias * x_sums, axis=1)
        if SWIGLU:
            up_acc += tl.sum(per_group(up_sums, groups) * up_scale + up_bias * x_sums, axis=1)
        return acc, up_acc

    @triton.jit
    def high_half(words):
        """The words' upper 16 bits, shifted down (no sign extension)."""
        return (words.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)

    @triton.jit
    def per_group(sums, GROUPS: tl.constexpr):
        """(columns, words) -> (columns, GROUPS): the sums of each group's words."""
        return tl.sum(tl.reshape(sums, (sums.shape[0], GROUPS, sums.shape[1] // GROUPS)), axis=2)

    @triton.jit
    def values_at(words, float_2_23, SHIFT: tl.constexpr, BITS: tl.constexpr):
        """The BITS-bit values at bit SHIFT of the words (SHIFT + BITS <= 16), times 2^SHIFT, as
        float32: put into the mantissa of 2^23 (`float_2_23`: its bits, an argument so that
        the mask and the or are one instruction) and 2^23 taken off, exact, and cheaper than
        an integer-to-float conversion (a quarter of the FMA rate on recent GPUs)."""
        mantissa = (words & (((1 << BITS) - 1) << SHIFT)) | float_2_23
        return mantissa.to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def rows_stacked(row_ids, v0, v1, v2, v3):
        """(rows, columns) with v_i at row i (rows past 3 zero)."""
        ids = row_ids[:, None]
        out = tl.where(ids == 0, v0[None, :], 0.0)
        out = tl.where(ids == 1, v1[None, :], out)
        out = tl.where(ids == 2, v2[None, :], out)
        return tl.where(ids == 3, v3[None, :], out)

    @triton.jit
    def row_inverse_rms(x_ptr, row, rows, k, eps, WANTED: tl.constexpr, BLOCK: tl.constexpr):
        """1 / rms of row `row` of x `(rows, k)` (0 past `rows`, and unless WANTED)."""
        if WANTED:
            squares = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, k, BLOCK):
                ks = start + tl.arange(0, BLOCK)
                v = tl.load(x_ptr + row * k + ks, mask=(ks < k) & (row < rows), other=0.0).to(tl.float32)
                squares += v * v
            inv = tl.where(row < rows, 1.0 / tl.sqrt(tl.sum(squares, axis=0) / k + eps), 0.0)
        else:
            inv = 0.0
        return inv
