"""Triton GEMVs for a CUDA decode step's few rows (up to 16): a weight read once for all of
them, a block of output columns per program. Up to FMA_MAX_ROWS rows `fma_gemv` multiplies in
registers (each thread a 16-byte load of a column's neighbouring values, float32 FMAs with x,
no tensor cores: one row is 1/16 of a tl.dot tile, and feeding tl.dot costs a shared memory
round trip per tile, so at a step's small shapes the tl.dot kernel is bound by latency, not
by memory); more rows take tl.dot over K in chunks, the rows padded to 16. Both fuse:

- `norm_matmul`: RMSNorm, then x W^T (every program norms the few rows itself).
- `norm_swiglu`: RMSNorm, gate_up and SwiGLU (a program takes matching gate and up columns).
- `matmul_residual`: x W^T + residual.

Where the column blocks would leave SMs idle (`gemv_splits`; `fma_plan` for the FMA kernel,
which also narrows its blocks first), their programs split K as well
(`triton_splits`: the last of a block's programs to finish adds the parts up and finishes the
block). `triton_splits.SPLIT_K` caps the splits.

Matmuls are summed in float32 and rounded once, the norm and SwiGLU rounded where the torch
path rounds them (see `triton_ops`). Entry functions launch on whatever tensors they are given
(CUDA, or CPU tensors under `TRITON_INTERPRET=1`); the module loads without triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum_mac.backends.torch.triton_ops import MIN_DOT_ROWS, multiprocessors
from ferrum_mac.backends.torch.triton_pdl import LINE_BYTES, launch_options, pdl_for, prefetch_lines
from ferrum_mac.backends.torch.triton_splits import SPLIT_COUNTERS, SPLIT_K, split_counters

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def norm_matmul(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None = None, splits: int | None = None, fma: bool | None = None,
                tile: FmaTile | None = None) -> torch.Tensor:  # fmt: skip
    """rms_norm(x) W^T (+ bias) for a few rows: x `(M, K)`, W `(N, K)` -> `(M, N)`. Here and
    below: `fma` (by default up to FMA_MAX_ROWS rows) the kernel that multiplies in registers
    (`fma_gemv`, its `tile`: by default FMA_TILE), else the tl.dot one; `splits` of K: by
    default as the kernel's rule chooses (`fma_plan`, `gemv_splits`)."""
    return _gemv(x, weight, bias, norm_weight=norm_weight, eps=eps, splits=splits, fma=fma, tile=tile)


def norm_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
                bias: torch.Tensor | None = None, splits: int | None = None, fma: bool | None = None,
                tile: FmaTile | None = None) -> torch.Tensor:  # fmt: skip
    """silu(gate) * up from rms_norm(x) times the fused `gate_up` `(2 * width, K)` (gate rows
    first) (+ bias) for a few rows -> `(M, width)`: gate_up's output is never stored."""
    return _gemv(x, gate_up, bias, norm_weight=norm_weight, eps=eps, swiglu=True, splits=splits, fma=fma, tile=tile)


def matmul_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, splits: int | None = None,
                    fma: bool | None = None, tile: FmaTile | None = None) -> torch.Tensor:  # fmt: skip
    """residual + x W^T for a few rows (what `torch.addmm(residual, x, W.t())` gives)."""
    return _gemv(x, weight, None, residual=residual, splits=splits, fma=fma, tile=tile)


def _gemv(x, weight, bias, norm_weight=None, eps=0.0, swiglu=False, residual=None, splits=None, fma=None,
          tile=None) -> torch.Tensor:  # fmt: skip
    if fma if fma is not None else x.shape[0] <= FMA_MAX_ROWS:
        return fma_gemv(x, weight, bias, residual, norm_weight, eps, swiglu, splits, tile or FMA_TILE)
    rows, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    assert rows <= MIN_DOT_ROWS and weight.shape[1] == k and weight.is_contiguous()
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k = gemv_blocks(n, k, x.device, weight.element_size())
    blocks = triton.cdiv(n, block_n)
    splits, k_per_split = gemv_splits(blocks, k, block_k, x.device, splits)
    if splits > 1:
        assert blocks <= SPLIT_COUNTERS
        partials = torch.empty((splits, rows, weight.shape[0]), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    else:
        partials = counters = x
    pdl = pdl_for(x.device, weight)
    lines = prefetch_lines(block_n, k_per_split, weight.element_size())
    _gemv_kernel[(blocks, splits)](
        x, weight, x if norm_weight is None else norm_weight, x if bias is None else bias,
        x if residual is None else residual.contiguous(), out, partials, counters, rows, eps, splits,  # (x: any pointer, never read)
        ROWS_PAD=MIN_DOT_ROWS, N=n, K=k, HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, SWIGLU=swiglu, SPLIT=splits > 1, K_PER_SPLIT=k_per_split, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM_BLOCK=min(4096, triton.next_power_of_2(k)), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl, PREFETCH_LINES=lines, LINE_ELEMENTS=LINE_BYTES // weight.element_size(),
        num_warps=4, num_stages=GEMV_STAGES, **launch_options(pdl),
    )  # fmt: skip
    return out


GEMV_TILE_BYTES = 8192  # of the weight (each of gate and up), per program and step of its loop over K
GEMV_STAGES = 4  # tiles a program has in flight (software pipelining)


def gemv_blocks(n: int, k: int, device: torch.device, element_size: int) -> tuple[int, int]:
    """A program's output columns and K chunk: the widest column block (up to 64) that still
    gives every SM a program, and a chunk of the weight GEMV_TILE_BYTES in size."""
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < multiprocessors(device):
        block_n //= 2
    block_k = min(triton.next_power_of_2(k), GEMV_TILE_BYTES // (block_n * element_size))
    return block_n, max(block_k, 16)


# A GEMV with fewer column blocks than SMs splits K, into enough programs to give every SM
# MIN_PROGRAMS_PER_SM: below one block an SM splitting pays, past it the split sums cost more
# than they give (docs/BENCHMARKS.md, torch session 4).
MIN_PROGRAMS_PER_SM = 2


def gemv_splits(blocks: int, k: int, block_k: int, device: torch.device, wanted: int | None = None,
                per_sm: int = MIN_PROGRAMS_PER_SM) -> tuple[int, int]:  # fmt: skip
    """How many programs share each column block's K, and the K each takes (whole chunks):
    `wanted`, by default none unless the blocks are fewer than the SMs, then as few as give
    every SM `per_sm` programs (at most SPLIT_K), and no more than K has chunks."""
    if wanted is None:
        sms = multiprocessors(device)
        wanted = 1 if blocks >= sms else min(SPLIT_K, triton.cdiv(per_sm * sms, blocks))
    chunks = triton.cdiv(k, block_k)
    chunks_per_split = triton.cdiv(chunks, max(1, min(wanted, chunks)))
    return triton.cdiv(chunks, chunks_per_split), chunks_per_split * block_k


# -- the FMA GEMV: a row or two multiplied in registers -----------------------------------------

# `fma_gemv` takes up to FMA_MAX_ROWS rows by default (more take the tl.dot kernel; it runs up
# to FMA_MOST_ROWS); 0 turns it off. Off: in a decode step on the H100 it was no faster than
# tl.dot on Qwen3-0.6B and slower on Qwen3-8B (docs/BENCHMARKS.md), and a row would sum
# differently alone than among a verify's rows.
FMA_MAX_ROWS = 0
FMA_MOST_ROWS = 4
FMA_MAX_SPLITS = 16  # programs sharing a column block's K, at most
FMA_MIN_COLUMNS = 8  # a program's columns, at least
FMA_NORM_BLOCK = 1024


@dataclass(frozen=True)
class FmaTile:
    """What a program of the FMA GEMV takes (`blocks`): per step of K, `row_bytes` of each of
    its columns (a whole number of 128-byte lines); `columns` for one row. A thread loads 16
    bytes (8 values) of one column at a time, converts them to float32 and multiplies them
    with each row's x in registers, so the columns are what spread the cost of x (load,
    norm) over more weight: fewer columns for more rows and for SwiGLU's two weights. Where
    that leaves fewer than `per_sm` programs an SM even with K split (at most FMA_MAX_SPLITS
    ways), the columns halve until it does not: small shapes want more, smaller programs to
    keep more loads in flight. `reduce`: "step" sums each step's products over K across the
    threads at once; "end" keeps a float32 sum per 16-byte load a thread makes a step (of its
    8 products) and sums those across the threads once, at the end (no shuffles in the loop,
    more registers)."""

    columns: int = 64
    row_bytes: int = 512
    warps: int = 4
    per_sm: int = 4
    reduce: str = "end"
    pdl: bool = True  # launched early where `triton_pdl` has a kernel of this weight's size launch early

    def blocks(self, n: int, k: int, rows: int, swiglu: bool, element_size: int, sms: int) -> tuple[int, int]:
        """(columns, K) per program and step for `rows` rows of x and a weight `(n, k)`."""
        weights = triton.next_power_of_2(rows) * (2 if swiglu else 1)
        block_n = max(FMA_MIN_COLUMNS, self.columns // weights)
        block_k = min(triton.next_power_of_2(k), max(16, self.row_bytes // element_size))
        steps = min(FMA_MAX_SPLITS, triton.cdiv(k, block_k))
        while block_n > FMA_MIN_COLUMNS and triton.cdiv(n, block_n) * steps < self.per_sm * sms:
            block_n //= 2
        return block_n, block_k


FMA_TILE = FmaTile()


def fma_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             swiglu: bool = False, splits: int | None = None, tile: FmaTile = FMA_TILE) -> torch.Tensor:  # fmt: skip
    """The GEMV (`_gemv`'s fusions) for up to FMA_MOST_ROWS rows, multiplied in registers
    (`_gemv_fma_kernel`), a program taking `tile`; `splits` of K: by default `fma_plan`'s."""
    rows, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    assert rows <= FMA_MOST_ROWS and weight.shape[1] == k and weight.is_contiguous()
    assert tile.reduce in ("step", "end")
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k, blocks, splits, k_per_split = fma_plan(
        n, k, rows, swiglu, weight.element_size(), x.device, tile, splits
    )
    if splits > 1:
        assert blocks <= SPLIT_COUNTERS
        partials = torch.empty((splits, rows, weight.shape[0]), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    else:
        partials = counters = x
    pdl = tile.pdl and pdl_for(x.device, weight)
    lines = prefetch_lines(block_n, k_per_split, weight.element_size()) if pdl else 0
    _gemv_fma_kernel[(blocks, splits)](
        x, weight, x if norm_weight is None else norm_weight, x if bias is None else bias,
        x if residual is None else residual.contiguous(), out, partials, counters, rows, eps, splits,  # (x: any pointer, never read)
        ROWS=triton.next_power_of_2(rows), N=n, K=k, HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, SWIGLU=swiglu, SPLIT=splits > 1, K_PER_SPLIT=k_per_split,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, REDUCE_AT_END=tile.reduce == "end",
        NORM_BLOCK=min(FMA_NORM_BLOCK, triton.next_power_of_2(k)), PDL=pdl, PREFETCH_LINES=lines,
        LINE_ELEMENTS=LINE_BYTES // weight.element_size(), num_warps=tile.warps, num_stages=1,
        **launch_options(pdl),
    )  # fmt: skip
    return out


def fma_plan(n: int, k: int, rows: int, swiglu: bool, element_size: int, device: torch.device,
             tile: FmaTile = FMA_TILE, splits: int | None = None) -> tuple[int, int, int, int, int]:  # fmt: skip
    """How `fma_gemv` runs `rows` rows over a weight of `n` columns (each of gate and up with
    `swiglu`) and `k` values: (columns a program, K per step, column blocks, splits of K, K
    per split). `splits`: by default enough to give each SM `tile.per_sm` programs (at most
    FMA_MAX_SPLITS) with one row's blocks, whatever the rows: K is then split the same way
    for any rows, so a row's sums are added in the same order, and its output is the same
    in a step of one row or two."""
    sms = multiprocessors(device)
    block_n, block_k = tile.blocks(n, k, rows, swiglu, element_size, sms)
    blocks = triton.cdiv(n, block_n)
    if splits is None:
        one_row_blocks = triton.cdiv(n, tile.blocks(n, k, 1, swiglu, element_size, sms)[0])
        splits = max(1, min(FMA_MAX_SPLITS, triton.cdiv(tile.per_sm * sms, one_row_blocks)))
    splits, k_per_split = gemv_splits(blocks, k, block_k, device, splits)
    return block_n, block_k, blocks, splits, k_per_split


# -- kernels ------------------------------------------------------------------------------------

if triton is not None:
    from ferrum_mac.backends.torch.triton_pdl import prefetch_rows, wait_for_previous
    from ferrum_mac.backends.torch.triton_splits import arrived_last, sum_of_splits

    @triton.jit
    def _gemv_kernel(
        x_ptr, weight_ptr, norm_ptr, bias_ptr, residual_ptr, out_ptr, partials_ptr, counters_ptr, rows, eps, splits,
        ROWS_PAD: tl.constexpr, N: tl.constexpr, K: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr, K_PER_SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr,
    ):  # fmt: skip
        # One program per (block of BLOCK_N output columns, split of K) (with SWIGLU: of gate,
        # and the same columns of up, N rows further down the weight). x's few rows are padded
        # to ROWS_PAD for tl.dot; the padding is masked, so never read or written. Every
        # program norms x itself: x is a few KiB, the weight is what takes the time. Unsplit, a
        # program takes all of K and finishes its columns; SPLIT, each stores its float32 sums
        # in `partials` (splits, rows, N; up's N more), and the last to finish sums those.
        block, split = tl.program_id(0), tl.program_id(1)
        columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = columns < N
        if SPLIT:  # K_PER_SPLIT: a multiple of BLOCK_K, and a constant, so the loads are known aligned
            k_begin = split * K_PER_SPLIT
            k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
        else:
            k_begin, k_end = 0, K
        if PDL and PREFETCH_LINES > 0:  # the weight: no kernel writes it, so before the wait
            rows_ptr = weight_ptr + columns[:, None].to(tl.int64) * K
            prefetch_rows(rows_ptr, inside, k_begin, k_end, PREFETCH_LINES, LINE_ELEMENTS)
            if SWIGLU:
                prefetch_rows(rows_ptr + N * K, inside, k_begin, k_end, PREFETCH_LINES, LINE_ELEMENTS)
        wait_for_previous(PDL)
        row_ids = tl.arange(0, ROWS_PAD)
        live = row_ids < rows
        inv_rms = inverse_rms(x_ptr, rows, row_ids, eps, K, NORM_BLOCK) if HAS_NORM else None
        acc, up_acc = matmul_columns(
            x_ptr, weight_ptr, norm_ptr, inv_rms, row_ids, live, columns, inside, k_begin, k_end,
            N, K, HAS_NORM, SWIGLU, BLOCK_K, PRECISION,
        )  # fmt: skip

        finish_split_gemv(
            acc, up_acc, partials_ptr, counters_ptr, block, split, splits, rows,
            bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
            N, HAS_BIAS, HAS_RESIDUAL, SWIGLU, SPLIT,
        )  # fmt: skip

    @triton.jit
    def matmul_columns(
        x_ptr, weight_ptr, norm_ptr, inv_rms, row_ids, live, columns, inside, k_begin, k_end,
        N: tl.constexpr, K: tl.constexpr, HAS_NORM: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """x `(rows, K)` (rows `row_ids` where `live`, padded for tl.dot) times the weight's
        `columns` (where `inside`), summed over k_begin .. k_end in float32: `(rows, columns)`;
        with SWIGLU, also up's (the same columns, N rows further down the weight), else zeros.
        HAS_NORM: x normed first, by `inv_rms` and the norm weight, rounded as F.rms_norm."""
        tiles = weight_ptr + columns[:, None].to(tl.int64) * K
        acc = tl.zeros([row_ids.shape[0], columns.shape[0]], dtype=tl.float32)
        up_acc = tl.zeros([row_ids.shape[0], columns.shape[0]], dtype=tl.float32)
        for start in range(k_begin, k_end, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_inside = ks < K
            x = tl.load(x_ptr + row_ids[:, None] * K + ks[None, :], mask=live[:, None] & k_inside[None, :], other=0.0)
            if HAS_NORM:  # scaled by 1/rms and the weight in float32, rounded once
                norm = tl.load(norm_ptr + ks, mask=k_inside, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * inv_rms[:, None] * norm[None, :]).to(x.dtype)
            both = inside[:, None] & k_inside[None, :]
            w = tl.load(tiles + ks[None, :], mask=both, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if SWIGLU:
                up = tl.load(tiles + N * K + ks[None, :], mask=both, other=0.0)
                up_acc = tl.dot(x, tl.trans(up), up_acc, input_precision=PRECISION)
        return acc, up_acc

    @triton.jit
    def finish_split_gemv(
        acc, up_acc, partials_ptr, counters_ptr, block, split, splits, rows,
        bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
        N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
        SPLIT: tl.constexpr,
    ):  # fmt: skip
        """A program's float32 sums of its columns -> the output (`_finish_gemv`); with K split
        over programs, each stores its partial sums and the last to arrive adds them up first."""
        if SPLIT:
            width: tl.constexpr = 2 * N if SWIGLU else N
            here = row_ids[:, None] * width + columns[None, :]
            mine = live[:, None] & inside[None, :]
            split_stride = rows * width
            tl.store(partials_ptr + split * split_stride + here, acc, mask=mine)
            if SWIGLU:
                tl.store(partials_ptr + split * split_stride + N + here, up_acc, mask=mine)
            if arrived_last(counters_ptr + block, splits):
                acc = sum_of_splits(partials_ptr, here, mine, splits, split_stride)
                if SWIGLU:
                    up_acc = sum_of_splits(partials_ptr, N + here, mine, splits, split_stride)
                _finish_gemv(
                    acc, up_acc, bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
                    N, HAS_BIAS, HAS_RESIDUAL, SWIGLU,
                )  # fmt: skip
        else:
            _finish_gemv(
                acc, up_acc, bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
                N, HAS_BIAS, HAS_RESIDUAL, SWIGLU,
            )  # fmt: skip

    @triton.jit
    def _finish_gemv(
        acc, up_acc, bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
        N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
    ):  # fmt: skip
        """The GEMV's float32 sums of a block of columns -> its output: bias, residual, SwiGLU."""
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + columns, mask=inside, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                up_acc += tl.load(bias_ptr + N + columns, mask=inside, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:  # as addmm: added to the float32 sum, rounded once
            acc += tl.load(
                residual_ptr + row_ids[:, None] * N + columns[None, :], mask=live[:, None] & inside[None, :], other=0.0
            ).to(tl.float32)
        if SWIGLU:  # rounded where the torch path stores: gate, up, silu(gate), the product
            gate = acc.to(dtype).to(tl.float32)
            up = up_acc.to(dtype).to(tl.float32)
            acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        tl.store(out_ptr + row_ids[:, None] * N + columns[None, :], acc.to(dtype), mask=live[:, None] & inside[None, :])

    @triton.jit
    def inverse_rms(x_ptr, rows, row_ids, eps, K: tl.constexpr, BLOCK: tl.constexpr):
        """1 / rms of each row of x `(rows, K)`, at its place in a vector like `row_ids` (0 past `rows`)."""
        inv_rms = tl.zeros(row_ids.shape, dtype=tl.float32)
        for row in range(rows):
            squares = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, K, BLOCK):
                ks = start + tl.arange(0, BLOCK)
                v = tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
                squares += v * v
            inv_rms = tl.where(row_ids == row, 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps), inv_rms)
        return inv_rms

    # `rows` stays a runtime value, as in triton_quant's FMA kernel (a 1 would become a constant)
    @triton.jit(do_not_specialize=["rows"])
    def _gemv_fma_kernel(
        x_ptr, weight_ptr, norm_ptr, bias_ptr, residual_ptr, out_ptr, partials_ptr, counters_ptr, rows, eps, splits,
        ROWS: tl.constexpr, N: tl.constexpr, K: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr, K_PER_SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, REDUCE_AT_END: tl.constexpr,
        NORM_BLOCK: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr,
    ):  # fmt: skip
        # One program per (block of BLOCK_N output columns, split of K), as _gemv_kernel, but
        # multiplied in registers (`fma_columns`), x's rows padded to ROWS (a power of 2 up to 4).
        block, split = tl.program_id(0), tl.program_id(1)
        columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = columns < N
        if SPLIT:
            k_begin = split * K_PER_SPLIT
            k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
        else:
            k_begin, k_end = 0, K
        tiles = weight_ptr + columns[:, None].to(tl.int64) * K
        if PDL and PREFETCH_LINES > 0:  # the weight: no kernel writes it, so before the wait (see triton_pdl)
            prefetch_rows(tiles, inside, k_begin, k_end, PREFETCH_LINES, LINE_ELEMENTS)
            if SWIGLU:
                prefetch_rows(tiles + N * K, inside, k_begin, k_end, PREFETCH_LINES, LINE_ELEMENTS)
        wait_for_previous(PDL)
        row_ids = tl.arange(0, ROWS)
        live = row_ids < rows
        inv_rms = inverse_rms(x_ptr, rows, row_ids, eps, K, NORM_BLOCK) if HAS_NORM else None
        acc, up_acc = fma_columns(
            x_ptr, weight_ptr, norm_ptr, inv_rms, row_ids, rows, columns, inside, k_begin, k_end,
            N, K, HAS_NORM, SWIGLU, BLOCK_K, EVEN_K, REDUCE_AT_END,
        )  # fmt: skip
        finish_split_gemv(
            acc, up_acc, partials_ptr, counters_ptr, block, split, splits, rows,
            bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
            N, HAS_BIAS, HAS_RESIDUAL, SWIGLU, SPLIT,
        )  # fmt: skip

    @triton.jit
    def fma_columns(
        x_ptr, weight_ptr, norm_ptr, inv_rms, row_ids, rows, columns, inside, k_begin, k_end,
        N: tl.constexpr, K: tl.constexpr, HAS_NORM: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, REDUCE_AT_END: tl.constexpr,
    ):  # fmt: skip
        """As `matmul_columns`, multiplied in registers: x's rows `row_ids` (ROWS, a power of 2
        up to 4; those past `rows` masked) times the weight's `columns` over k_begin .. k_end
        -> `(ROWS, columns)` float32 sums (and up's with SWIGLU). Per step a (columns,
        BLOCK_K) tile of the weight (a column's values contiguous, so a thread loads 8
        neighbouring values of one column at once), in float32 times each row's x there, each
        row with its own sums (acc0..acc3, up0..up3). EVEN_K: every step's K is inside (the
        split is whole steps), so only the columns are masked."""
        ROWS: tl.constexpr = row_ids.shape[0]
        BLOCK_N: tl.constexpr = columns.shape[0]
        tiles = weight_ptr + columns[:, None].to(tl.int64) * K
        inv0 = row_value(inv_rms, row_ids, 0, HAS_NORM)
        inv1 = row_value(inv_rms, row_ids, 1, HAS_NORM and ROWS > 1)
        inv2 = row_value(inv_rms, row_ids, 2, HAS_NORM and ROWS > 2)
        inv3 = row_value(inv_rms, row_ids, 3, HAS_NORM and ROWS > 3)
        if REDUCE_AT_END:  # a sum per 8 values a thread holds
            zeros = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        else:
            zeros = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc0, acc1, acc2, acc3 = zeros, zeros, zeros, zeros
        up0, up1, up2, up3 = zeros, zeros, zeros, zeros
        for start in range(k_begin, k_end, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            if EVEN_K:
                k_in = ks < K  # (all of them, in whole 16-byte vectors)
                both = inside[:, None]
            else:
                k_in = ks < k_end
                both = inside[:, None] & k_in[None, :]
            w = tl.load(tiles + ks[None, :], mask=both, other=0.0).to(tl.float32)
            u = tl.load(tiles + N * K + ks[None, :], mask=both, other=0.0).to(tl.float32) if SWIGLU else w
            norm = tl.load(norm_ptr + ks, mask=k_in, other=0.0).to(tl.float32) if HAS_NORM else None
            x = x_row(x_ptr, 0, rows, ks, k_in, norm, inv0, K, HAS_NORM)
            acc0, up0 = plus_products(acc0, up0, w, u, x, SWIGLU, REDUCE_AT_END)
            if ROWS > 1:
                x = x_row(x_ptr, 1, rows, ks, k_in, norm, inv1, K, HAS_NORM)
                acc1, up1 = plus_products(acc1, up1, w, u, x, SWIGLU, REDUCE_AT_END)
            if ROWS > 2:
                x = x_row(x_ptr, 2, rows, ks, k_in, norm, inv2, K, HAS_NORM)
                acc2, up2 = plus_products(acc2, up2, w, u, x, SWIGLU, REDUCE_AT_END)
                x = x_row(x_ptr, 3, rows, ks, k_in, norm, inv3, K, HAS_NORM)
                acc3, up3 = plus_products(acc3, up3, w, u, x, SWIGLU, REDUCE_AT_END)
        if REDUCE_AT_END:
            acc0, up0 = tl.sum(acc0, axis=1), tl.sum(up0, axis=1)
            acc1, up1 = tl.sum(acc1, axis=1), tl.sum(up1, axis=1)
            acc2, up2 = tl.sum(acc2, axis=1), tl.sum(up2, axis=1)
            acc3, up3 = tl.sum(acc3, axis=1), tl.sum(up3, axis=1)
        return stacked_rows(row_ids, acc0, acc1, acc2, acc3), stacked_rows(row_ids, up0, up1, up2, up3)

    @triton.jit
    def x_row(x_ptr, row, rows, ks, k_in, norm, inv_rms, K: tl.constexpr, HAS_NORM: tl.constexpr):
        """Row `row` of x at `ks` in float32 (0 past `rows`), normed if HAS_NORM: by 1/rms and
        the norm weight in float32, rounded once to x's dtype (as F.rms_norm)."""
        x = tl.load(x_ptr + row * K + ks, mask=k_in & (row < rows), other=0.0)
        if HAS_NORM:
            x = (x.to(tl.float32) * inv_rms * norm).to(x.dtype)
        return x.to(tl.float32)

    @triton.jit
    def plus_products(acc, up_acc, w, u, x, SWIGLU: tl.constexpr, AT_END: tl.constexpr):
        """A row's sums plus a step's weight tile (and up's) times its x: summed over the
        step's K now, or (AT_END) kept per value for the caller to sum once."""
        if AT_END:  # summed over each thread's 8 neighbouring values (its 16-byte load): no shuffle
            acc += per_load(w * x[None, :])
            if SWIGLU:
                up_acc += per_load(u * x[None, :])
        else:
            acc += tl.sum(w * x[None, :], axis=1)
            if SWIGLU:
                up_acc += tl.sum(u * x[None, :], axis=1)
        return acc, up_acc

    @triton.jit
    def per_load(products):
        """(columns, K) -> (columns, K / 8): the sums of each 8 neighbouring values."""
        return tl.sum(tl.reshape(products, (products.shape[0], products.shape[1] // 8, 8)), axis=2)

    @triton.jit
    def row_value(values, row_ids, row, WANTED: tl.constexpr):
        """values[row] of a vector along `row_ids` (0 unless WANTED)."""
        if WANTED:
            value = tl.sum(tl.where(row_ids == row, values, 0.0), axis=0)
        else:
            value = 0.0
        return value

    @triton.jit
    def stacked_rows(row_ids, v0, v1, v2, v3):
        """(rows, columns) with v_i at row i (rows past 3 zero)."""
        ids = row_ids[:, None]
        out = tl.where(ids == 0, v0[None, :], 0.0)
        out = tl.where(ids == 1, v1[None, :], out)
        out = tl.where(ids == 2, v2[None, :], out)
        return tl.where(ids == 3, v3[None, :], out)
