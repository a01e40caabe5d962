"""Triton matmuls over packed 4-bit and 8-bit weights (`quant.Packed`): the weight is read
packed and dequantized in registers, never stored dense.

- `gemv`: a few rows (a decode step's), shaped as `triton_gemv`'s GEMVs and fusing what they
  fuse: optional RMSNorm of x first, bias, residual add, SwiGLU over a fused gate_up (a
  program takes matching gate and up columns); K split over several programs where the
  column blocks are fewer than the SMs (`triton_splits`). Up to FMA_MAX_ROWS rows it is
  `fma_gemv`, made to stream the weight at memory speed: it multiplies in registers (no tensor
  cores: a row or four is 1/16 to 1/4 of a tl.dot tile, and feeding tl.dot costs a shared
  memory round trip per tile); more rows take the tl.dot kernel.
- `matmul`: any number of rows, a tile of the weight dequantized per step of K and
  multiplied with tl.dot (from `quant.DENSE_MIN_ROWS` rows prefill takes `dequantize`, the
  whole weight written dense for cuBLAS, instead).

`fma_gemv` computes sum_k (scale q_k + bias) x_k as scale * sum q_k x_k + bias * sum x_k
per group, in float32 from the exact values (it does not round the weight to x's dtype
first); its instructions per weight value are what bound it, so a value costs one integer
op (it is or-ed into a float's mantissa), one add and one FMA per row (`values_at`).

The tl.dot kernels dequantize a tile as `scale * q + bias` in float32 and round it once to x's
dtype, as `Packed.dequantize(x.dtype)` rounds the dense weight, so they compute the matmul
of the dequantized model; sums in float32, rounded once. A tile is unpacked one of
two ways (`UNPACK`): "gather", each k's word and group loaded by index (`ks // values per
word`, `ks // group`: neighbouring k share a word, so one cache line, and no layout shuffle);
"words", the tile's words and group scales loaded once each and spread over their values
with reshapes (fewer loads; whether the reshapes cost a shuffle is the compiler's choice).
`scripts/check-torch-quant.py` times both (`--sweep`: the GEMVs' variants). Entry functions launch on whatever
tensors they are given (CUDA, or CPU tensors under `TRITON_INTERPRET=1`); the module loads
without triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum_mac.backends.torch.quant import ExpertStack, Packed
from ferrum_mac.backends.torch.triton_gemv import gemv_splits
from ferrum_mac.backends.torch.triton_ops import MIN_DOT_ROWS, multiprocessors
from ferrum_mac.backends.torch.triton_pdl import LINE_BYTES, launch_options, pdl_for, prefetch_lines
from ferrum_mac.backends.torch.triton_splits import SPLIT_COUNTERS, split_counters

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

GEMV_TILE_BYTES = 4096  # of the packed weight (each of gate and up), per program and step over K
GEMV_STAGES = 1  # (more stages gave no gain on the H100 and run out of shared memory with "gather")
# prefill tiles (rows, columns, K per step, warps, stages): the wide one from MATMUL_WIDE_ROWS
# rows on, the usual shape of an SM90 bf16 tile; the narrow one for a few rows
MATMUL_NARROW, MATMUL_WIDE = (64, 64, 64, 4, 3), (128, 128, 64, 8, 3)
MATMUL_WIDE_ROWS = 256
# `dequantize`: a program's (rows, values of K) of the weight, and its warps
DEQUANT_BLOCK, DEQUANT_WARPS, DEQUANT_MANTISSA = (32, 256), 4, False
UNPACK = "words"  # or "gather" (see above; "gather" ran 4-15x slower on the H100)
# The FMA GEMV (`fma_gemv`) takes up to FMA_MAX_ROWS rows (more take the tl.dot one).
FMA_MAX_ROWS = 4
FMA_MAX_SPLITS = 16  # programs sharing a column block's K, at most
FMA_MIN_COLUMNS = 8  # a program's columns, at least
FMA_RESIDENT = 2  # programs of the default tile's bytes a step an SM holds at once (their registers)
FMA_NORM_BLOCK = 1024
FLOAT_2_23 = 0x4B000000  # 2.0**23's bits


def gemv(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
         splits: int | None = None, blocks: tuple[int, int] | None = None,
         unpack: str = UNPACK, fma: bool | None = None, tile: FmaTile | None = None) -> torch.Tensor:  # fmt: skip
    """x `(M, K)` (M up to 16) times the packed W `(N, K)` transposed -> `(M, N)`, with x first
    RMS-normed by `norm_weight` (and `eps`) if given, plus `bias` and `residual` if given;
    `swiglu`: W is a fused gate_up `(2 * width, K)`, gate rows first -> silu(gate) * up
    `(M, width)`. `fma` (by default up to FMA_MAX_ROWS rows): the kernel that multiplies in
    registers (`fma_gemv`, its `tile`), else the tl.dot one (its `blocks`, `unpack`).
    `splits` of K: by default as the kernel's rule chooses."""
    if fma if fma is not None else x.shape[0] <= FMA_MAX_ROWS:
        return fma_gemv(x, weight, bias, residual, norm_weight, eps, swiglu, splits, tile or FMA_TILE)
    rows, k = x.shape
    n_all, k_weight = weight.shape
    n = n_all // 2 if swiglu else n_all
    assert rows <= MIN_DOT_ROWS and k_weight == k
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k = blocks or gemv_blocks(n, k, x.device, weight.bits)
    block_k = max(block_k, weight.group_size) if unpack == "words" else block_k  # (whole groups)
    column_blocks = triton.cdiv(n, block_n)
    splits, k_per_split = gemv_splits(column_blocks, k, block_k, x.device, splits)
    if splits > 1:
        assert column_blocks <= SPLIT_COUNTERS
        partials = torch.empty((splits, rows, n_all), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    else:
        partials = counters = x
    _qgemv_kernel[(column_blocks, splits)](
        x, weight.words, weight.scales, weight.biases, x if norm_weight is None else norm_weight,
        x if bias is None else bias, x if residual is None else residual.contiguous(), out, partials, counters,
        rows, eps, splits,  # (x: any pointer, never read)
        ROWS_PAD=MIN_DOT_ROWS, N=n, K=k, BITS=weight.bits, GROUP=weight.group_size,
        HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        SWIGLU=swiglu, SPLIT=splits > 1, K_PER_SPLIT=k_per_split, BLOCK_N=block_n, BLOCK_K=block_k, WORDS=unpack == "words",
        NORM_BLOCK=min(4096, triton.next_power_of_2(k)), PRECISION=precision(x),
        num_warps=4, num_stages=GEMV_STAGES,
    )  # fmt: skip
    return out


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

    columns: int = 64  # (these two: the sweep's choice on the H100, docs/BENCHMARKS.md)
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
                longer_rows: bool) -> tuple[int, int]:  # fmt: skip
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
             swiglu: bool = False, splits: int | None = None, tile: FmaTile = FMA_TILE) -> torch.Tensor:  # fmt: skip
    """`gemv` for up to FMA_MAX_ROWS rows, multiplied in registers (`_qgemv_fma_kernel`), a
    program taking `tile`; `splits` of K: by default as many as `tile.per_sm` asks."""
    rows, k = x.shape
    n_all, k_weight = weight.shape
    n = n_all // 2 if swiglu else n_all
    assert rows <= FMA_MAX_ROWS and k_weight == k
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    plan = fma_plan(n, k, rows, swiglu, weight.bits, weight.group_size, x.device, tile, splits)
    block_n, block_w, column_blocks, splits, words_per_split = plan
    word_stride = k * weight.bits // 32
    if splits > 1:
        assert column_blocks <= SPLIT_COUNTERS
        partials = torch.empty((splits, rows, n_all), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    else:
        partials = counters = x
    pdl = tile.pdl and pdl_for(x.device, weight.words)
    _qgemv_fma_kernel[(column_blocks, splits)](
        x, weight.words, weight.scales, weight.biases, x if norm_weight is None else norm_weight,
        x if bias is None else bias, x if residual is None else residual.contiguous(), out, partials, counters,
        rows, n, k, word_stride, k // weight.group_size, words_per_split, splits, eps, FLOAT_2_23,  # (x: any pointer, never read)
        ROWS=triton.next_power_of_2(rows), BITS=weight.bits, GROUP=weight.group_size,
        HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        SWIGLU=swiglu, SPLIT=splits > 1, BLOCK_N=block_n, BLOCK_W=block_w, PREFETCH=tile.prefetch, NORM_BLOCK=FMA_NORM_BLOCK,
        PDL=pdl, PREFETCH_LINES=prefetch_lines(block_n, words_per_split, 4) if pdl else 0, LINE_ELEMENTS=LINE_BYTES // 4,
        num_warps=tile.warps, num_stages=1, **launch_options(pdl),
    )  # fmt: skip
    return out


def fma_plan(n: int, k: int, rows: int, swiglu: bool, bits: int, group: int, device: torch.device,
             tile: FmaTile = FMA_TILE, splits: int | None = None) -> tuple[int, int, int, int, int]:  # fmt: skip
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


def matmul(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None,
           blocks: tuple[int, int, int] | None = None, warps: int | None = None, stages: int | None = None,
           unpack: str = UNPACK) -> torch.Tensor:  # fmt: skip
    """x `(M, K)` times the packed W `(N, K)` transposed (+ bias) -> `(M, N)`, for any M
    (`blocks`: rows, columns, K per step, and `warps`, `stages`: by default MATMUL_WIDE's or
    MATMUL_NARROW's, its rows capped to M's)."""
    rows, k = x.shape
    n, k_weight = weight.shape
    assert k_weight == k
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    *tile, default_warps, default_stages = MATMUL_WIDE if rows >= MATMUL_WIDE_ROWS else MATMUL_NARROW
    block_m, block_n, block_k = blocks or tile
    if blocks is None:
        block_m = min(block_m, max(MIN_DOT_ROWS, triton.next_power_of_2(rows)))
    block_k = max(block_k, weight.group_size) if unpack == "words" else block_k
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _qmatmul_kernel[grid](
        x, weight.words, weight.scales, weight.biases, x if bias is None else bias, out, rows,
        N=n, K=k, BITS=weight.bits, GROUP=weight.group_size, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, WORDS=unpack == "words", PRECISION=precision(x),
        num_warps=warps or default_warps, num_stages=stages or default_stages,
    )  # fmt: skip
    return out


def dequantize(weight: Packed, out: torch.Tensor, block: tuple[int, int] = DEQUANT_BLOCK,
               warps: int = DEQUANT_WARPS, mantissa: bool = DEQUANT_MANTISSA) -> torch.Tensor:  # fmt: skip
    """The packed W `(N, K)` dense in `out` (contiguous, `(N, K)`, of the dtype wanted), as
    `Packed.dequantize(out.dtype)` computes it (scale * q + bias in float32, rounded once: the
    same bits wherever q * scale is exact, as it is for 16-bit scales); returns `out`. Prefill
    multiplies with it in cuBLAS (`quant.dense_matmul`). A program takes `block` (rows,
    values of K: powers of two); `mantissa`: q made a float as `values_at` makes it (an or
    and an add, exact) rather than by a conversion."""
    n, k = weight.shape
    assert out.shape == (n, k) and out.is_contiguous()
    block_n, block_k = block[0], max(block[1], weight.group_size)  # (whole groups)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.words, weight.scales, weight.biases, out, n,
        K=k, BITS=weight.bits, GROUP=weight.group_size, BLOCK_N=block_n, BLOCK_K=block_k, MANTISSA=mantissa,
        num_warps=warps,
    )  # fmt: skip
    return out


def experts_plus(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ExpertStack,
                 down: ExpertStack, residual: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`triton_moe.experts_plus` over packed experts: residual + the router-weighted sum of
    each token's chosen experts' SwiGLU MLPs, x `(T, H)`, ids/weights `(T, k)` -> `(T, H)`."""
    return expert_down_sum_plus(expert_gate_up_swiglu(x, ids, weights, gate_up), ids, down, residual)


def expert_gate_up_swiglu(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ExpertStack,
                          block_i: int = 16, block_h: int = 128) -> torch.Tensor:  # fmt: skip
    """As `triton_moe.gate_up_swiglu` over a packed gate_up `(E, 2I, H)`: the pairs'
    activations `(T * k, I)`, each chosen expert's weights read (and dequantized) once."""
    (tokens, hidden), (_, top_k), (_, double, _) = x.shape, ids.shape, gate_up.shape
    inter, packed = double // 2, gate_up.packed
    assert x.stride(1) == 1 and ids.is_contiguous() and weights.is_contiguous()
    pairs = tokens * top_k
    out = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _expert_gate_up_swiglu_kernel[(pairs, triton.cdiv(inter, block_i))](
        x, x.stride(0), ids, weights, packed.words, packed.scales, packed.biases, out, tokens,
        K=top_k, HIDDEN=hidden, INTER=inter, BITS=packed.bits, GROUP=packed.group_size,
        TOKENS_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(tokens)), PAIRS_PAD=triton.next_power_of_2(pairs),
        K_PAD=triton.next_power_of_2(top_k), BLOCK_I=block_i, BLOCK_H=min(block_h, triton.next_power_of_2(hidden)),
        PRECISION=precision(x), num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def expert_down_sum_plus(activations: torch.Tensor, ids: torch.Tensor, down: ExpertStack, residual: torch.Tensor,
                         block_h: int = 16, block_i: int = 512) -> torch.Tensor:  # fmt: skip
    """As `triton_moe.down_sum_plus` (split over the pairs) over a packed down `(E, H, I)`."""
    (tokens, top_k), (_, hidden, inter), packed = ids.shape, down.shape, down.packed
    assert activations.is_contiguous() and ids.is_contiguous() and residual.stride(1) == 1
    block_i = min(block_i, triton.next_power_of_2(inter))
    blocks = triton.cdiv(hidden, block_h)
    assert tokens * blocks <= SPLIT_COUNTERS
    out = torch.empty((tokens, hidden), dtype=residual.dtype, device=residual.device)
    products = torch.empty((tokens * top_k, hidden), dtype=torch.float32, device=residual.device)
    _expert_down_sum_plus_kernel[(tokens * top_k, blocks)](
        activations, ids, packed.words, packed.scales, packed.biases, residual, residual.stride(0), products,
        split_counters(residual.device), out,
        K=top_k, HIDDEN=hidden, INTER=inter, BITS=packed.bits, GROUP=packed.group_size,
        BLOCK_H=block_h, BLOCK_I=block_i, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def gemv_blocks(n: int, k: int, device: torch.device, bits: int) -> tuple[int, int]:
    """A program's output columns and K chunk: the widest column block (up to 64) that still
    gives every SM a program, and a chunk of GEMV_TILE_BYTES of the packed weight."""
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < multiprocessors(device):
        block_n //= 2
    block_k = min(triton.next_power_of_2(k), GEMV_TILE_BYTES * 8 // (block_n * bits))
    return block_n, max(block_k, 32)


# -- kernels ------------------------------------------------------------------------------------

if triton is not None:
    from ferrum_mac.backends.torch.triton_gemv import finish_split_gemv, inverse_rms
    from ferrum_mac.backends.torch.triton_moe import _swiglu_as_torch
    from ferrum_mac.backends.torch.triton_pdl import prefetch_rows, wait_for_previous
    from ferrum_mac.backends.torch.triton_splits import arrived_last, sum_of_splits

    @triton.jit
    def dequantized_tile(words_ptr, scales_ptr, biases_ptr, columns, inside, ks, k_inside,
                         K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
        """The packed weight's `columns` (where `inside`) at `ks` (where `k_inside`) as a dense
        float32 `(columns, ks)` tile: scale * q + bias (the caller rounds it once, to x's dtype)."""
        per_word: tl.constexpr = 32 // BITS
        mask = inside[:, None] & k_inside[None, :]
        row_words = columns[:, None].to(tl.int64) * (K // per_word)
        row_groups = columns[:, None].to(tl.int64) * (K // GROUP)
        words = tl.load(words_ptr + row_words + (ks // per_word)[None, :], mask=mask, other=0)
        q = (words >> ((ks % per_word) * BITS)[None, :]) & ((1 << BITS) - 1)  # (the mask drops the sign's bits)
        groups = (ks // GROUP)[None, :]
        scale = tl.load(scales_ptr + row_groups + groups, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(biases_ptr + row_groups + groups, mask=mask, other=0.0).to(tl.float32)
        return q.to(tl.float32) * scale + bias

    @triton.jit
    def words_tile(words_ptr, scales_ptr, biases_ptr, columns, inside, start, k_end,
                   K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """As `dequantized_tile` for ks = start .. start + BLOCK_K (whole groups), reading each
        word and each group's scale and bias once and spreading them with reshapes."""
        per_word: tl.constexpr = 32 // BITS
        words_per_tile: tl.constexpr = BLOCK_K // per_word
        groups_per_tile: tl.constexpr = BLOCK_K // GROUP
        block_n: tl.constexpr = columns.shape[0]
        rows = columns[:, None].to(tl.int64)
        wi = start // per_word + tl.arange(0, words_per_tile)
        words = tl.load(
            words_ptr + rows * (K // per_word) + wi[None, :],
            mask=inside[:, None] & (wi * per_word < k_end)[None, :],
            other=0,
        )
        q = (words[:, :, None] >> (tl.arange(0, per_word) * BITS)[None, None, :]) & ((1 << BITS) - 1)
        q = tl.reshape(q, (block_n, groups_per_tile, GROUP)).to(tl.float32)
        gi = start // GROUP + tl.arange(0, groups_per_tile)
        g_mask = inside[:, None] & (gi * GROUP < k_end)[None, :]
        scale = tl.load(scales_ptr + rows * (K // GROUP) + gi[None, :], mask=g_mask, other=0.0).to(tl.float32)
        bias = tl.load(biases_ptr + rows * (K // GROUP) + gi[None, :], mask=g_mask, other=0.0).to(tl.float32)
        return tl.reshape(q * scale[:, :, None] + bias[:, :, None], (block_n, BLOCK_K))

    @triton.jit
    def weight_tile(words_ptr, scales_ptr, biases_ptr, columns, inside, start, k_end,
                    K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                    WORDS: tl.constexpr):  # fmt: skip
        """The float32 tile of the weight's `columns` at start .. start + BLOCK_K (masked past
        k_end), unpacked as WORDS asks (`words_tile`, else `dequantized_tile`)."""
        if WORDS:
            w = words_tile(words_ptr, scales_ptr, biases_ptr, columns, inside, start, k_end, K, BITS, GROUP, BLOCK_K)
        else:
            ks = start + tl.arange(0, BLOCK_K)
            w = dequantized_tile(words_ptr, scales_ptr, biases_ptr, columns, inside, ks, ks < k_end, K, BITS, GROUP)
        return w

    @triton.jit
    def _qgemv_kernel(
        x_ptr, words_ptr, scales_ptr, biases_ptr, norm_ptr, bias_ptr, residual_ptr, out_ptr, partials_ptr,
        counters_ptr, rows, eps, splits,
        ROWS_PAD: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
        SPLIT: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        WORDS: tl.constexpr, NORM_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # As triton_gemv._gemv_kernel, over a packed weight: one program per (block of BLOCK_N
        # output columns, split of K); with SWIGLU also up's columns, N rows further down. x's
        # few rows are padded to ROWS_PAD for tl.dot (the padding masked). SPLIT: each program
        # stores its float32 sums in `partials`, and the last to finish adds them up.
        block, split = tl.program_id(0), tl.program_id(1)
        columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = columns < N
        if SPLIT:
            k_begin = split * K_PER_SPLIT
            k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
        else:
            k_begin, k_end = 0, K
        row_ids = tl.arange(0, ROWS_PAD)
        live = row_ids < rows
        inv_rms = inverse_rms(x_ptr, rows, row_ids, eps, K, NORM_BLOCK) if HAS_NORM else None
        acc = tl.zeros([ROWS_PAD, BLOCK_N], dtype=tl.float32)
        up_acc = tl.zeros([ROWS_PAD, BLOCK_N], dtype=tl.float32)
        for start in range(k_begin, k_end, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_inside = ks < k_end
            x = tl.load(x_ptr + row_ids[:, None] * K + ks[None, :], mask=live[:, None] & k_inside[None, :], other=0.0)
            if HAS_NORM:  # scaled by 1/rms and the weight in float32, rounded once (as F.rms_norm)
                norm = tl.load(norm_ptr + ks, mask=k_inside, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * inv_rms[:, None] * norm[None, :]).to(x.dtype)
            w = weight_tile(
                words_ptr, scales_ptr, biases_ptr, columns, inside, start, k_end, K, BITS, GROUP, BLOCK_K, WORDS
            ).to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if SWIGLU:
                up = weight_tile(
                    words_ptr, scales_ptr, biases_ptr, columns + N, inside, start, k_end, K, BITS, GROUP, BLOCK_K, WORDS
                ).to(x.dtype)
                up_acc = tl.dot(x, tl.trans(up), up_acc, input_precision=PRECISION)

        finish_split_gemv(
            acc, up_acc, partials_ptr, counters_ptr, block, split, splits, rows,
            bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
            N, HAS_BIAS, HAS_RESIDUAL, SWIGLU, SPLIT,
        )  # fmt: skip

    # `rows` stays a runtime value: Triton would make a 1 a constant, which `finish_split_gemv`
    # then multiplies with the runtime `n` as if both were
    @triton.jit(do_not_specialize=["rows"])
    def _qgemv_fma_kernel(
        x_ptr, words_ptr, scales_ptr, biases_ptr, norm_ptr, bias_ptr, residual_ptr, out_ptr, partials_ptr,
        counters_ptr, rows, n, k, word_stride, group_stride, words_per_split, splits, eps, float_2_23,
        ROWS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_NORM: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PREFETCH: tl.constexpr, NORM_BLOCK: tl.constexpr, PDL: tl.constexpr,
        PREFETCH_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr,
    ):  # fmt: skip
        # One program per (block of BLOCK_N output columns, split of K), as _qgemv_kernel, but
        # no tl.dot: per step a (BLOCK_N, BLOCK_W) tile of words (a column's words contiguous,
        # so each thread loads a few neighbouring words of one column with one 16-byte load);
        # value j of every word is unpacked at once (`values_at`) and multiplied with each
        # row's x at those places into per-word sums of q x; per group, those sums times the
        # scale plus the bias times the sum of x are the group's share of (scale q + bias) x.
        # Everything stays in the words' layout but the per-group sums (a small shuffle a
        # step). The sizes the compiler needs known (strides, the split) are ints it
        # specializes as multiples of 16. x's rows are ROWS (a power of 2 up to 4), each with
        # its own sums (acc0..acc3, up0..up3), padding rows masked.
        per_word: tl.constexpr = 32 // BITS
        block, split = tl.program_id(0), tl.program_id(1)
        columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = columns < n
        if SPLIT:
            w_begin = split * words_per_split
            w_end = tl.minimum(w_begin + words_per_split, word_stride)
        else:
            w_begin, w_end = 0, word_stride
        if PDL and PREFETCH_LINES > 0:  # the weight: no kernel writes it, so before the wait (see triton_pdl)
            rows_ptr = words_ptr + columns[:, None].to(tl.int64) * word_stride
            prefetch_rows(rows_ptr, inside, w_begin, w_end, PREFETCH_LINES, LINE_ELEMENTS)
            if SWIGLU:
                prefetch_rows(rows_ptr + n * word_stride, inside, w_begin, w_end, PREFETCH_LINES, LINE_ELEMENTS)
        wait_for_previous(PDL)
        inv0 = row_inverse_rms(x_ptr, 0, rows, k, eps, HAS_NORM, NORM_BLOCK)
        inv1 = row_inverse_rms(x_ptr, 1, rows, k, eps, HAS_NORM and ROWS > 1, NORM_BLOCK)
        inv2 = row_inverse_rms(x_ptr, 2, rows, k, eps, HAS_NORM and ROWS > 2, NORM_BLOCK)
        inv3 = row_inverse_rms(x_ptr, 3, rows, k, eps, HAS_NORM and ROWS > 3, NORM_BLOCK)
        zeros = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc0, acc1, acc2, acc3 = zeros, zeros, zeros, zeros
        up0, up1, up2, up3 = zeros, zeros, zeros, zeros
        if PREFETCH:  # the first step's words, scales and biases (gate's, and up's with SWIGLU)
            next_words, next_s, next_b = packed_words(words_ptr, scales_ptr, biases_ptr, columns, inside, w_begin,
                                                      w_end, word_stride, group_stride, BLOCK_W, GROUP // per_word)  # fmt: skip
            if SWIGLU:
                next_up_words, next_up_s, next_up_b = packed_words(
                    words_ptr, scales_ptr, biases_ptr, columns + n, inside, w_begin, w_end, word_stride, group_stride,
                    BLOCK_W, GROUP // per_word,
                )  # fmt: skip
        for w0 in range(w_begin, w_end, BLOCK_W):
            wi = w0 + tl.arange(0, BLOCK_W)
            w_in = wi < w_end
            if PREFETCH:  # this step's, loaded during the step before; the next step's loaded now
                words, s, b = next_words, next_s, next_b
                next_words, next_s, next_b = packed_words(words_ptr, scales_ptr, biases_ptr, columns, inside,
                                                          w0 + BLOCK_W, w_end, word_stride, group_stride, BLOCK_W,
                                                          GROUP // per_word)  # fmt: skip
                if SWIGLU:
                    up_words, up_s, up_b = next_up_words, next_up_s, next_up_b
                    next_up_words, next_up_s, next_up_b = packed_words(
                        words_ptr, scales_ptr, biases_ptr, columns + n, inside, w0 + BLOCK_W, w_end, word_stride,
                        group_stride, BLOCK_W, GROUP // per_word,
                    )  # fmt: skip
                else:
                    up_words, up_s, up_b = words, s, b
            else:
                words, s, b = packed_words(words_ptr, scales_ptr, biases_ptr, columns, inside, w0, w_end, word_stride,
                                           group_stride, BLOCK_W, GROUP // per_word)  # fmt: skip
                if SWIGLU:
                    up_words, up_s, up_b = packed_words(words_ptr, scales_ptr, biases_ptr, columns + n, inside, w0,
                                                        w_end, word_stride, group_stride, BLOCK_W, GROUP // per_word)  # fmt: skip
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

        row_ids = tl.arange(0, ROWS)
        live = row_ids < rows
        acc = rows_stacked(row_ids, acc0, acc1, acc2, acc3)
        up_acc = rows_stacked(row_ids, up0, up1, up2, up3)
        finish_split_gemv(
            acc, up_acc, partials_ptr, counters_ptr, block, split, splits, rows,
            bias_ptr, residual_ptr, out_ptr, row_ids, live, columns, inside,
            n, HAS_BIAS, HAS_RESIDUAL, SWIGLU, SPLIT,
        )  # fmt: skip

    @triton.jit
    def packed_words(words_ptr, scales_ptr, biases_ptr, columns, inside, w0, w_end, word_stride, group_stride,
                     BLOCK_W: tl.constexpr, WORDS_PER_GROUP: tl.constexpr):  # fmt: skip
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

    @triton.jit
    def _qmatmul_kernel(
        x_ptr, words_ptr, scales_ptr, biases_ptr, bias_ptr, out_ptr, rows,
        N: tl.constexpr, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # One program per (BLOCK_M rows, BLOCK_N columns) tile of the output; per step of K a
        # tile of the weight dequantized in registers and multiplied with tl.dot.
        row_ids = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        live, inside = row_ids < rows, columns < N
        dtype = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_rows = x_ptr + row_ids[:, None].to(tl.int64) * K
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_inside = ks < K
            x = tl.load(x_rows + ks[None, :], mask=live[:, None] & k_inside[None, :], other=0.0)
            w = weight_tile(
                words_ptr, scales_ptr, biases_ptr, columns, inside, start, K, K, BITS, GROUP, BLOCK_K, WORDS
            ).to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + columns, mask=inside, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + row_ids[:, None].to(tl.int64) * N + columns[None, :]
        tl.store(out, acc.to(dtype), mask=live[:, None] & inside[None, :])

    @triton.jit
    def _dequantize_kernel(words_ptr, scales_ptr, biases_ptr, out_ptr, n,
                           K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MANTISSA: tl.constexpr):  # fmt: skip
        # One program per (BLOCK_N rows, BLOCK_K values) tile of the weight: its words, scales
        # and biases read once each (as `words_tile` reads them), the dense tile written in
        # out's dtype.
        per_word: tl.constexpr = 32 // BITS
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        start = tl.program_id(1) * BLOCK_K
        inside = rows < n
        if MANTISSA:
            rows_64 = rows[:, None].to(tl.int64)
            wi = start // per_word + tl.arange(0, BLOCK_K // per_word)
            words = tl.load(words_ptr + rows_64 * (K // per_word) + wi[None, :],
                            mask=inside[:, None] & (wi * per_word < K)[None, :], other=0)  # fmt: skip
            q = (words[:, :, None] >> (tl.arange(0, per_word) * BITS)[None, None, :]) & ((1 << BITS) - 1)
            q = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # (2.0**23's bits: exact, q < 2^23)
            q = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP))
            gi = start // GROUP + tl.arange(0, BLOCK_K // GROUP)
            groups = rows_64 * (K // GROUP) + gi[None, :]
            g_mask = inside[:, None] & (gi * GROUP < K)[None, :]
            scale = tl.load(scales_ptr + groups, mask=g_mask, other=0.0).to(tl.float32)
            bias = tl.load(biases_ptr + groups, mask=g_mask, other=0.0).to(tl.float32)
            w = tl.reshape(q * scale[:, :, None] + bias[:, :, None], (BLOCK_N, BLOCK_K))
        else:
            w = words_tile(words_ptr, scales_ptr, biases_ptr, rows, inside, start, K, K, BITS, GROUP, BLOCK_K)
        ks = start + tl.arange(0, BLOCK_K)
        out = out_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=inside[:, None] & (ks < K)[None, :])

    @triton.jit
    def _expert_gate_up_swiglu_kernel(
        x_ptr, x_row_stride, ids_ptr, weights_ptr, words_ptr, scales_ptr, biases_ptr, out_ptr, tokens,
        K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        TOKENS_PAD: tl.constexpr, PAIRS_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_I: tl.constexpr,
        BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # As triton_moe._gate_up_swiglu_kernel: one program per (pair, block of BLOCK_I
        # intermediate columns); only the expert's first pair works, for every token that chose
        # it. The expert's gate rows are rows expert * 2I + columns of the packed stack, its up
        # rows INTER further.
        pair, block = tl.program_id(0), tl.program_id(1)
        expert = tl.load(ids_ptr + pair)
        before = tl.arange(0, PAIRS_PAD)
        earlier_ids = tl.load(ids_ptr + before, mask=before < pair, other=-1)
        if tl.max((earlier_ids == expert).to(tl.int32), axis=0) == 0:
            rows = tl.arange(0, TOKENS_PAD)
            slots = tl.arange(0, K_PAD)
            pairs = rows[:, None] * K + slots[None, :]
            ids = tl.load(ids_ptr + pairs, mask=(rows[:, None] < tokens) & (slots[None, :] < K), other=-1)
            hits = ids == expert
            uses = tl.max(hits.to(tl.int32), axis=1) > 0
            pair_of = tl.sum(tl.where(hits, pairs, 0), axis=1)
            columns = block * BLOCK_I + tl.arange(0, BLOCK_I)
            in_columns = columns < INTER
            gate_rows = expert * (2 * INTER) + columns
            gate = tl.zeros([TOKENS_PAD, BLOCK_I], dtype=tl.float32)
            up = tl.zeros([TOKENS_PAD, BLOCK_I], dtype=tl.float32)
            for start in range(0, HIDDEN, BLOCK_H):
                hidden = start + tl.arange(0, BLOCK_H)
                in_hidden = hidden < HIDDEN
                x = tl.load(
                    x_ptr + rows[:, None] * x_row_stride + hidden[None, :],
                    mask=uses[:, None] & in_hidden[None, :],
                    other=0.0,
                )
                wg = dequantized_tile(
                    words_ptr, scales_ptr, biases_ptr, gate_rows, in_columns, hidden, in_hidden, HIDDEN, BITS, GROUP
                ).to(x.dtype)
                wu = dequantized_tile(
                    words_ptr,
                    scales_ptr,
                    biases_ptr,
                    gate_rows + INTER,
                    in_columns,
                    hidden,
                    in_hidden,
                    HIDDEN,
                    BITS,
                    GROUP,
                ).to(x.dtype)
                gate = tl.dot(x, tl.trans(wg), gate, input_precision=PRECISION)
                up = tl.dot(x, tl.trans(wu), up, input_precision=PRECISION)
            weight = tl.load(weights_ptr + pair_of, mask=uses, other=0.0).to(tl.float32)
            out = _swiglu_as_torch(gate, up, weight[:, None], out_ptr.dtype.element_ty)
            tl.store(
                out_ptr + pair_of[:, None] * INTER + columns[None, :], out, mask=uses[:, None] & in_columns[None, :]
            )

    @triton.jit
    def _expert_down_sum_plus_kernel(
        activations_ptr, ids_ptr, words_ptr, scales_ptr, biases_ptr, residual_ptr, residual_row_stride, products_ptr,
        counters_ptr, out_ptr,
        K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
    ):  # fmt: skip
        # As triton_moe._down_split_sum_plus_kernel: one program per (pair, block of BLOCK_H
        # hidden columns), its expert's rows (expert * H + columns of the packed stack) dotted
        # with the pair's activation into `products`; the last of a token's K programs for the
        # block sums them in slot order and adds the residual.
        pair, block = tl.program_id(0), tl.program_id(1)
        token = pair // K
        columns = block * BLOCK_H + tl.arange(0, BLOCK_H)
        in_columns = columns < HIDDEN
        expert = tl.load(ids_ptr + pair)
        rows = expert * HIDDEN + columns
        acc = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)
        for start in range(0, INTER, BLOCK_I):
            inner = start + tl.arange(0, BLOCK_I)
            in_inner = inner < INTER
            a = tl.load(activations_ptr + pair * INTER + inner, mask=in_inner, other=0.0).to(tl.float32)
            w = dequantized_tile(
                words_ptr, scales_ptr, biases_ptr, rows, in_columns, inner, in_inner, INTER, BITS, GROUP
            )
            acc += (
                w.to(activations_ptr.dtype.element_ty).to(tl.float32) * a[None, :]
            )  # (the weight as the torch path rounds it)
        tl.store(products_ptr + pair * HIDDEN + columns, tl.sum(acc, axis=1), mask=in_columns)
        if arrived_last(counters_ptr + token * tl.num_programs(1) + block, K):
            products = sum_of_splits(products_ptr, token * K * HIDDEN + columns, in_columns, K, HIDDEN)
            residual = tl.load(residual_ptr + token * residual_row_stride + columns, mask=in_columns, other=0.0)
            out = residual.to(tl.float32) + products
            tl.store(out_ptr + token * HIDDEN + columns, out.to(residual.dtype), mask=in_columns)
