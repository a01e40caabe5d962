"""Triton GEMVs for a CUDA decode step's few rows (up to 16): a weight read once for all of
them, a block of output columns per program, tl.dot over K in chunks with the weight as the
left operand (x's rows, padded to 16, the right one): every row runs the same instructions,
so sums as it would alone, whatever rows share the launch.

- `norm_matmul`: RMSNorm, then x W^T (every program norms the few rows itself).
- `norm_swiglu`: RMSNorm, gate_up and SwiGLU (a program takes matching gate and up columns).
- `matmul_residual`: x W^T + residual.

A program's tile (`gemv_tile`) is wide and deep, up to 128 columns by 32 KB of the weight a
step, with as many steps in flight as shared memory holds. Where even the narrowest blocks
would leave most SMs idle (`fills_the_machine`), their programs split K as well
(`dot_splits`; `triton_splits`: the last of a block's programs to finish adds the parts up
and finishes the block). `triton_splits.SPLIT_K` caps the splits.

A weight of at most ROW_GEMV_MAX_BYTES (a small model's) is streamed in a few microseconds,
and the tl.dot GEMV's time there goes to its ramp and tail. For one row (a single stream's
decode step) it is read by `_row_gemv_kernel` instead: many small programs (`RowTile`: a few
whole weight rows each, a chunk of each a load round, a few warps), so every lane has a load
in flight; where PDL launches it early, each loads its first chunk before the wait (the weight
is no kernel's output). A verify's rows (`rows_alike`) go through it too, a program for each
row and weight block, so that each row is summed as its one-row decode step was, to the bit.
A batch of rows otherwise takes the tl.dot GEMV (its rows may then round differently from the
same rows alone). Larger weights keep the tl.dot GEMV, which reads them about as fast as the
row GEMV reads one row, and a verify's rows 2-3 times faster.

Matmuls are summed in float32 and rounded once, the norm and SwiGLU rounded where the torch
path rounds them (see `triton_ops`). Entry functions launch on whatever tensors they are given
(CUDA, or CPU tensors under `TRITON_INTERPRET=1`); the module loads without triton.
"""

from dataclasses import dataclass

import torch

from ferrum_mac.backends.torch.kernels.triton_ops import MIN_DOT_ROWS, multiprocessors
from ferrum_mac.backends.torch.kernels.triton_pdl import LINE_BYTES, launch_options, pdl_for, prefetch_lines
from ferrum_mac.backends.torch.kernels.triton_splits import SPLIT_K, split_buffers

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


GEMV_TILE_BYTES = 32768  # of the weight (each of gate and up), per program and step of its loop over K
GEMV_STAGES = 4  # tiles a program has in flight (software pipelining), where shared memory holds them
MIN_STAGES = 2  # where it holds fewer, the chunks of K shorten
GEMV_WARPS = 4  # a program's fewest; a wide block takes a warp per 16 columns
GEMV_WIDEST = 128  # output columns a program takes at most
SHARED_MEMORY_SPARE = 8 << 10  # of an SM's shared memory, left to a program's other uses

# Column blocks at least FULL_GRID a SM keep the memory busy as they are; fewer, and they
# narrow, then split K over enough programs to give every SM MIN_PROGRAMS_PER_SM: the split
# sums cost more than they give past that.
FULL_GRID = 0.5
MIN_PROGRAMS_PER_SM = 2

ROW_GEMV_MAX_BYTES = 16 << 20
ROW_BLOCK_K = 1024  # elements of each weight row a program loads a round
ROW_TILE_ELEMENTS = 16384  # block_n x block_k at most: 32 KB of bf16 in flight a program
ROW_PROGRAMS_PER_SM = 2  # the fewest programs an SM is given, where the rows allow
ROW_WARPS = 4


@dataclass(frozen=True)
class GemvTile:
    """How a GEMV's programs are cut: `block_n` output columns each, K in chunks of `block_k`,
    `warps` and `stages` (tiles in flight) a program; `per_sm`: programs an SM when K splits."""

    block_n: int
    block_k: int
    warps: int = GEMV_WARPS
    stages: int = GEMV_STAGES
    per_sm: int = MIN_PROGRAMS_PER_SM


def gemv_tile(n: int, k: int, device: torch.device, element_size: int, tile_bytes: int | None = None,
              widest: int | None = None, weights: int = 1, **rest) -> GemvTile:
    """The widest column block (up to `widest`, by default GEMV_WIDEST) that still fills the
    machine (`fills_the_machine`), a chunk of the weight `tile_bytes` (GEMV_TILE_BYTES) in
    size, a warp per 16 columns (at least GEMV_WARPS), and as many stages (up to GEMV_STAGES)
    as shared memory holds of `weights` such tiles (2: gate's and up's) and x's rows.
    (`rest`: GemvTile's fields, to set any of them.)"""
    block_n = widest or GEMV_WIDEST
    while block_n > 16 and not fills_the_machine(triton.cdiv(n, block_n), device):
        block_n //= 2
    block_k = max(16, min(triton.next_power_of_2(k), (tile_bytes or GEMV_TILE_BYTES) // (block_n * element_size)))
    room = shared_memory(device) - SHARED_MEMORY_SPARE
    while block_k > 16 and room // stage_bytes(block_n, block_k, weights, element_size) < MIN_STAGES:
        block_k //= 2  # (a GPU of less shared memory: shorter chunks, still pipelined)
    stages = max(1, min(GEMV_STAGES, room // stage_bytes(block_n, block_k, weights, element_size)))
    rest = {"warps": max(GEMV_WARPS, block_n // 16), "stages": stages} | rest
    return GemvTile(block_n, block_k, **rest)


def stage_bytes(block_n: int, block_k: int, weights: int, element_size: int) -> int:
    """Shared memory a stage of the tl.dot GEMV takes: a chunk of each weight, and of x's rows."""
    return (weights * block_n + MIN_DOT_ROWS) * block_k * element_size


def fills_the_machine(blocks: int, device: torch.device) -> bool:
    """Whether a GEMV's `blocks` of columns, a program each, keep the memory busy (FULL_GRID)."""
    return blocks >= FULL_GRID * multiprocessors(device)


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory an SM has (a program may take nearly all of it)."""
    if device.type != "cuda":
        return 228 << 10
    return torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor


@dataclass(frozen=True)
class RowTile:
    """How `_row_gemv_kernel`'s programs are cut: `block_n` weight rows each (of gate and of
    up, for SwiGLU), `block_k` of each row a load round, `warps` a program."""

    block_n: int
    block_k: int
    warps: int = ROW_WARPS


def row_tile(n: int, k: int, device: torch.device) -> RowTile:
    """A chunk of ROW_BLOCK_K (all of K if shorter), and the most rows (up to 16) that keep the
    tile within ROW_TILE_ELEMENTS and still give every SM ROW_PROGRAMS_PER_SM programs."""
    block_k = min(ROW_BLOCK_K, triton.next_power_of_2(k))
    block_n = 16
    while block_n > 1 and (
        block_n * block_k > ROW_TILE_ELEMENTS or triton.cdiv(n, block_n) < ROW_PROGRAMS_PER_SM * multiprocessors(device)
    ):
        block_n //= 2
    return RowTile(block_n, block_k, ROW_WARPS)


def takes_rows(x: torch.Tensor, weight: torch.Tensor, rows_alike: bool) -> bool:
    """Whether `_row_gemv_kernel` reads `weight` for x: one row (or rows to be summed as each
    alone would be) of a weight of at most ROW_GEMV_MAX_BYTES."""
    return (x.shape[0] == 1 or rows_alike) and weight.numel() * weight.element_size() <= ROW_GEMV_MAX_BYTES


def norm_matmul(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None = None, splits: int | None = None, tile: GemvTile | RowTile | None = None,
                rows_alike: bool = False) -> torch.Tensor:
    """rms_norm(x) W^T (+ bias) for a few rows: x `(M, K)`, W `(N, K)` -> `(M, N)`. (`splits`
    of K and the `tile`, here and below: by default `dot_splits`' and `gemv_tile`'s, or
    `row_tile`'s; `rows_alike`: each row summed as it would be alone, see above.)"""
    return _gemv(x, weight, bias, norm_weight=norm_weight, eps=eps, splits=splits, tile=tile, rows_alike=rows_alike)


def norm_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
                bias: torch.Tensor | None = None, splits: int | None = None, tile: GemvTile | RowTile | None = None,
                rows_alike: bool = False) -> torch.Tensor:
    """silu(gate) * up from rms_norm(x) times the fused `gate_up` `(2 * width, K)` (gate rows
    first) (+ bias) for a few rows -> `(M, width)`: gate_up's output is never stored."""
    return _gemv(
        x, gate_up, bias, norm_weight=norm_weight, eps=eps, swiglu=True, splits=splits, tile=tile, rows_alike=rows_alike
    )


def matmul_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    splits: int | None = None,
    tile: GemvTile | RowTile | None = None,
    rows_alike: bool = False,
) -> torch.Tensor:
    """residual + x W^T for a few rows (what `torch.addmm(residual, x, W.t())` gives)."""
    return _gemv(x, weight, None, residual=residual, splits=splits, tile=tile, rows_alike=rows_alike)


def _gemv(
    x, weight, bias, norm_weight=None, eps=0.0, swiglu=False, residual=None, splits=None, tile=None, rows_alike=False
) -> torch.Tensor:
    rows, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    assert rows <= MIN_DOT_ROWS and weight.shape[1] == k and weight.is_contiguous()
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if isinstance(tile, RowTile) or (tile is None and splits is None and takes_rows(x, weight, rows_alike)):
        _row_gemv(x, weight, bias, norm_weight, eps, swiglu, residual, out, tile or row_tile(n, k, x.device))
        return out
    tile = tile or gemv_tile(n, k, x.device, weight.element_size(), weights=2 if swiglu else 1)
    block_n, block_k = tile.block_n, tile.block_k
    blocks = triton.cdiv(n, block_n)
    splits, k_per_split = dot_splits(blocks, k, tile, x.device, splits)
    partials, counters = split_buffers(splits, blocks, (rows, weight.shape[0]), x)
    pdl = pdl_for(x.device, weight)
    lines = prefetch_lines(block_n, k_per_split, weight.element_size())
    _gemv_kernel[(blocks, splits)](
        x, weight, x if norm_weight is None else norm_weight, x if bias is None else bias,
        x if residual is None else residual.contiguous(), out, partials, counters, rows, eps, splits,  # (x: any pointer, never read)
        ROWS_PAD=MIN_DOT_ROWS, N=n, K=k, HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, SWIGLU=swiglu, SPLIT=splits > 1, K_PER_SPLIT=k_per_split, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM_BLOCK=min(4096, triton.next_power_of_2(k)), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl, PREFETCH_LINES=lines, LINE_ELEMENTS=LINE_BYTES // weight.element_size(),
        num_warps=tile.warps, num_stages=tile.stages, **launch_options(pdl),
    )
    return out


def _row_gemv(x, weight, bias, norm_weight, eps, swiglu, residual, out, tile: RowTile, early=None) -> None:
    """(`early`: load the first chunk before the PDL wait, by default where PDL launches it.)"""
    rows, k = x.shape
    n = out.shape[1]
    pdl = pdl_for(x.device, weight)
    _row_gemv_kernel[(triton.cdiv(n, tile.block_n) * rows,)](
        x, weight, x if norm_weight is None else norm_weight, x if bias is None else bias,
        x if residual is None else residual.contiguous(), out, eps, rows,  # (x: any pointer, never read)
        N=n, K=k, HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        SWIGLU=swiglu, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NORM_BLOCK=min(4096, triton.next_power_of_2(k)),
        PDL=pdl, EARLY=pdl if early is None else early, num_warps=tile.warps, **launch_options(pdl),
    )


def dot_splits(blocks: int, k: int, tile: GemvTile, device: torch.device, wanted: int | None = None) -> tuple[int, int]:
    """The tl.dot GEMV's splits of K for `blocks` of `tile`'s columns (as `gemv_splits`): none
    where the blocks fill the machine, unless `wanted`."""
    if wanted is None and fills_the_machine(blocks, device):
        wanted = 1
    return gemv_splits(blocks, k, tile.block_k, device, wanted, tile.per_sm)


def gemv_splits(blocks: int, k: int, block_k: int, device: torch.device, wanted: int | None = None,
                per_sm: int = MIN_PROGRAMS_PER_SM) -> tuple[int, int]:
    """How many programs share each column block's K, and the K each takes (whole chunks):
    `wanted`, by default none unless the blocks are fewer than the SMs, then as few as give
    every SM `per_sm` programs (at most SPLIT_K), and no more than K has chunks."""
    if wanted is None:
        sms = multiprocessors(device)
        wanted = 1 if blocks >= sms else min(SPLIT_K, triton.cdiv(per_sm * sms, blocks))
    chunks = triton.cdiv(k, block_k)
    chunks_per_split = triton.cdiv(chunks, max(1, min(wanted, chunks)))
    return triton.cdiv(chunks, chunks_per_split), chunks_per_split * block_k


# -- kernels ------------------------------------------------------------------------------------

if triton is not None:
    from ferrum_mac.backends.torch.kernels.triton_pdl import prefetch_rows, wait_for_previous
    from ferrum_mac.backends.torch.kernels.triton_splits import arrived_last, sum_of_splits

    @triton.jit
    def _gemv_kernel(
        x_ptr, weight_ptr, norm_ptr, bias_ptr, residual_ptr, out_ptr, partials_ptr, counters_ptr, rows, eps, splits,
        ROWS_PAD: tl.constexpr, N: tl.constexpr, K: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr, K_PER_SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr,
    ):
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
        )

        finish_split_gemv(
            acc, up_acc, partials_ptr, counters_ptr, block, split, splits, rows,
            bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
            N, HAS_BIAS, HAS_RESIDUAL, SWIGLU, SPLIT,
        )

    @triton.jit
    def _row_gemv_kernel(
        x_ptr, weight_ptr, norm_ptr, bias_ptr, residual_ptr, out_ptr, eps, rows,
        N: tl.constexpr, K: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NORM_BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        # One program per BLOCK_N weight rows (with SWIGLU: of gate, and the same rows of up,
        # N rows further down) and row of x: every row runs the same code, so sums as it alone
        # would. The programs of one block of weight rows are launched side by side, so that
        # the block is read from memory once and by the rest from L2. Each round loads a
        # BLOCK_K chunk of every weight row and sums it against x's. EARLY (with PDL) loads the
        # first chunk before the wait; else every round loads alike, which Triton's pipeliner
        # takes (it streams a large weight faster).
        row, block = tl.program_id(0) % rows, tl.program_id(0) // rows
        columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = columns < N
        rows_ptr = weight_ptr + columns[:, None].to(tl.int64) * K
        ks = tl.arange(0, BLOCK_K)
        if EARLY:
            w, up_w = weight_chunk(rows_ptr, inside, ks, N, K, SWIGLU)  # no kernel writes the weight
        wait_for_previous(PDL)
        x_ptr += row * K
        out_ptr += row * N
        residual_ptr += row * N
        row_ids = tl.arange(0, 2)  # (this program's row, and a padding row, never written)
        live = row_ids < 1
        scale = 0.0
        if HAS_NORM:
            scale = tl.sum(inverse_rms(x_ptr, 1, row_ids, eps, K, NORM_BLOCK), axis=0)
        sums = tl.zeros([BLOCK_N], dtype=tl.float32)
        up_sums = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            if not EARLY:
                w, up_w = weight_chunk(rows_ptr, inside, start + ks, N, K, SWIGLU)
            elif start > 0:  # (the first is the one loaded before the wait)
                w, up_w = weight_chunk(rows_ptr, inside, start + ks, N, K, SWIGLU)
            more, more_up = chunk_sums(w, up_w, x_ptr, norm_ptr, scale, start + ks, K, HAS_NORM, SWIGLU)
            sums += more
            up_sums += more_up
        _finish_gemv(
            tl.where(live[:, None], sums[None, :], 0.0), tl.where(live[:, None], up_sums[None, :], 0.0),
            bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside, N, HAS_BIAS, HAS_RESIDUAL, SWIGLU,
        )

    @triton.jit
    def chunk_sums(w, up_w, x_ptr, norm_ptr, scale, ks, K: tl.constexpr, HAS_NORM: tl.constexpr, SWIGLU: tl.constexpr):
        """Float32 sums of weight rows `w` (and `up_w`, with SWIGLU) times x's columns `ks` (those
        before K), x first scaled by 1/rms `scale` and the norm weight, with HAS_NORM."""
        k_inside = ks < K
        x = tl.load(x_ptr + ks, mask=k_inside, other=0.0)
        if HAS_NORM:  # scaled by 1/rms and the weight in float32, rounded once
            norm = tl.load(norm_ptr + ks, mask=k_inside, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * scale * norm).to(x.dtype)
        x = x.to(tl.float32)[None, :]
        sums = tl.sum(w.to(tl.float32) * x, axis=1)
        up_sums = tl.sum(up_w.to(tl.float32) * x, axis=1) if SWIGLU else sums
        return sums, up_sums

    @triton.jit
    def weight_chunk(rows_ptr, inside, ks, N: tl.constexpr, K: tl.constexpr, SWIGLU: tl.constexpr):
        """The weight rows at `rows_ptr` (where `inside`), at columns `ks` (those before K):
        and with SWIGLU the same of up's rows (N rows further down), else the first again."""
        mask = inside[:, None] & (ks < K)[None, :]
        w = tl.load(rows_ptr + ks[None, :], mask=mask, other=0.0)
        up = tl.load(rows_ptr + N * K + ks[None, :], mask=mask, other=0.0) if SWIGLU else w
        return w, up

    @triton.jit
    def matmul_columns(
        x_ptr, weight_ptr, norm_ptr, inv_rms, row_ids, live, columns, inside, k_begin, k_end,
        N: tl.constexpr, K: tl.constexpr, HAS_NORM: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """x `(rows, K)` (rows `row_ids` where `live`, padded for tl.dot) times the weight's
        `columns` (where `inside`), summed over k_begin .. k_end in float32: `(rows, columns)`;
        with SWIGLU, also up's (the same columns, N rows further down the weight), else zeros.
        HAS_NORM: x normed first, by `inv_rms` and the norm weight, rounded as F.rms_norm."""
        # The weight is tl.dot's left operand (its columns the matrix rows, x's rows the padded
        # side): it reads a weight faster than the other way round, and every row of x still
        # takes the same instructions, so rounds as it would alone.
        tiles = weight_ptr + columns[:, None].to(tl.int64) * K
        acc = tl.zeros([columns.shape[0], row_ids.shape[0]], dtype=tl.float32)
        up_acc = tl.zeros([columns.shape[0], row_ids.shape[0]], dtype=tl.float32)
        for start in range(k_begin, k_end, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_inside = ks < K
            x = tl.load(x_ptr + row_ids[:, None] * K + ks[None, :], mask=live[:, None] & k_inside[None, :], other=0.0)
            if HAS_NORM:  # scaled by 1/rms and the weight in float32, rounded once
                norm = tl.load(norm_ptr + ks, mask=k_inside, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * inv_rms[:, None] * norm[None, :]).to(x.dtype)
            x = tl.trans(x)
            both = inside[:, None] & k_inside[None, :]
            w = tl.load(tiles + ks[None, :], mask=both, other=0.0)
            acc = tl.dot(w, x, acc, input_precision=PRECISION)
            if SWIGLU:
                up = tl.load(tiles + N * K + ks[None, :], mask=both, other=0.0)
                up_acc = tl.dot(up, x, up_acc, input_precision=PRECISION)
        return tl.trans(acc), tl.trans(up_acc)

    @triton.jit
    def finish_split_gemv(
        acc, up_acc, partials_ptr, counters_ptr, block, split, splits, rows,
        bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
        N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
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
                )
        else:
            _finish_gemv(
                acc, up_acc, bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
                N, HAS_BIAS, HAS_RESIDUAL, SWIGLU,
            )

    @triton.jit
    def _finish_gemv(
        acc, up_acc, bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
        N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
    ):
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
