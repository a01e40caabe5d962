"""Triton matmuls over packed 4-bit and 8-bit weights (`quant.Packed`): the weight is read
packed and dequantized in registers, never stored dense.

- `gemv`: a few rows (a decode step's), shaped as `triton_gemv`'s GEMVs and fusing what they
  fuse: optional RMSNorm of x first, bias, residual add, SwiGLU over a fused gate_up (a
  program takes matching gate and up columns); K split over several programs where the
  column blocks are fewer than the SMs (`triton_splits`). One row is
  `triton_dp4a_gemv.dp4a_gemv` (x as 16-bit integers, dp4a); up to FMA_MAX_ROWS rows
  `triton_fma_gemv.fma_gemv`, which multiplies in registers; more rows the tl.dot kernel here.
- `matmul`: any number of rows, a tile of the weight dequantized per step of K and
  multiplied with tl.dot (from `quant.DENSE_MIN_ROWS` rows prefill takes
  `triton_dequant.dequantize`, the whole weight written dense for cuBLAS, instead).
- `experts_plus`: `triton_moe.experts_plus` over packed experts: for a decode step's few
  tokens the FMA GEMV a token-expert pair at a time (the expert's id read on the device),
  for more the two tl.dot kernels here.

The tl.dot kernels dequantize a tile as `scale * q + bias` in float32 and round it once to x's
dtype, as `Packed.dequantize(x.dtype)` rounds the dense weight, so they compute the matmul
of the dequantized model; sums in float32, rounded once. A tile is unpacked one of
two ways (`UNPACK`): "gather", each k's word and group loaded by index (`ks // values per
word`, `ks // group`: neighbouring k share a word, so one cache line, and no layout shuffle);
"words", the tile's words and group scales loaded once each and spread over their values
with reshapes (fewer loads; whether the reshapes cost a shuffle is the compiler's choice).
`scripts/check-torch-quant.py` times both (`--sweep`: the GEMVs' variants). Entry functions
launch on whatever tensors they are given (CUDA, or CPU tensors under `TRITON_INTERPRET=1`);
the module loads without triton.
"""

from __future__ import annotations

import torch

from ferrum_mac.backends.torch.kernels import switches
from ferrum_mac.backends.torch.quant import ExpertStack, Packed
from ferrum_mac.backends.torch.kernels.triton_dp4a_gemv import X_BLOCK, dp4a_gemv
from ferrum_mac.backends.torch.kernels.triton_fma_gemv import FMA_MAX_ROWS, FMA_TILE, FmaTile, fma_expert_gemv, fma_gemv
from ferrum_mac.backends.torch.kernels.triton_gemv import gemv_splits
from ferrum_mac.backends.torch.kernels.triton_ops import MIN_DOT_ROWS, multiprocessors
from ferrum_mac.backends.torch.kernels.triton_splits import SPLIT_COUNTERS, split_buffers, split_counters

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
UNPACK = "words"  # or "gather" (see above; "gather" ran 4-15x slower on the H100)
# At most this many token-expert pairs take the FMA GEMV a pair at a time (each pair reads its
# expert, however many tokens share it); more take the tl.dot kernels, which read a chosen
# expert once but dequantize it far slower than it streams (so the FMA route's rereading
# costs less up to `ops.MOE_MAX_PAIRS`, all a decode step hands these kernels).
EXPERT_FMA_MAX_PAIRS = 256


def gemv(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
         splits: int | None = None, blocks: tuple[int, int] | None = None,
         unpack: str = UNPACK, fma: bool | None = None, tile: FmaTile | None = None,
         dp4a: bool | None = None) -> torch.Tensor:
    """x `(M, K)` (M up to 16) times the packed W `(N, K)` transposed -> `(M, N)`, with x first
    RMS-normed by `norm_weight` (and `eps`) if given, plus `bias` and `residual` if given;
    `swiglu`: W is a fused gate_up `(2 * width, K)`, gate rows first -> silu(gate) * up
    `(M, width)`. `fma` (by default up to FMA_MAX_ROWS rows): the kernel that multiplies in
    registers (`triton_fma_gemv.fma_gemv`, its `tile`), else the tl.dot one (its `blocks`,
    `unpack`); `dp4a` (by default `switches.dp4a` for one row): x as integers by dp4a
    (`triton_dp4a_gemv.dp4a_gemv`, its `tile`). `splits` of K: by default as the kernel's rule chooses."""
    if dp4a is None:
        dp4a = switches.dp4a and fma is None and takes_dp4a(x, weight)
    if dp4a:
        return dp4a_gemv(x, weight, bias, residual, norm_weight, eps, swiglu, splits, tile)
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
    partials, counters = split_buffers(splits, column_blocks, (rows, n_all), x)
    _qgemv_kernel[(column_blocks, splits)](
        x, weight.words, weight.scales, weight.biases, x if norm_weight is None else norm_weight,
        x if bias is None else bias, x if residual is None else residual.contiguous(), out, partials, counters,
        rows, eps, splits,  # (x: any pointer, never read)
        ROWS_PAD=MIN_DOT_ROWS, N=n, K=k, BITS=weight.bits, GROUP=weight.group_size,
        HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        SWIGLU=swiglu, SPLIT=splits > 1, K_PER_SPLIT=k_per_split, BLOCK_N=block_n, BLOCK_K=block_k, WORDS=unpack == "words",
        NORM_BLOCK=min(4096, triton.next_power_of_2(k)), PRECISION=precision(x),
        num_warps=4, num_stages=GEMV_STAGES,
    )
    return out


def takes_dp4a(x: torch.Tensor, weight: Packed) -> bool:
    """Whether `dp4a_gemv` takes x over `weight` by default: one row, groups of whole blocks,
    and not on ROCm (no PTX there: its dp4a would be plain integer ops, slower than FMAs)."""
    one_row = x.shape[0] == 1 and weight.bits in (4, 8) and weight.group_size % X_BLOCK == 0
    return one_row and torch.version.hip is None


def matmul(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None,
           blocks: tuple[int, int, int] | None = None, warps: int | None = None, stages: int | None = None,
           unpack: str = UNPACK) -> torch.Tensor:
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
    )
    return out


def experts_plus(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ExpertStack,
                 down: ExpertStack, residual: torch.Tensor, fma: bool | None = None) -> torch.Tensor:
    """`triton_moe.experts_plus` over packed experts: residual + the router-weighted sum of
    each token's chosen experts' SwiGLU MLPs, x `(T, H)`, ids/weights `(T, k)` -> `(T, H)`.
    `fma` (by default up to EXPERT_FMA_MAX_PAIRS pairs): a pair at a time through the FMA
    GEMV (`triton_fma_gemv.fma_expert_gemv`), else the tl.dot kernels, which read an expert
    once for all the tokens that chose it."""
    if fma if fma is not None else ids.numel() <= EXPERT_FMA_MAX_PAIRS:
        activations = fma_expert_gemv(x, ids, gate_up.packed, gate_up.experts, pair_weights=weights)
        return fma_expert_gemv(activations, ids, down.packed, down.experts, residual=residual)
    return expert_down_sum_plus(expert_gate_up_swiglu(x, ids, weights, gate_up), ids, down, residual)


def expert_gate_up_swiglu(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ExpertStack,
                          block_i: int = 16, block_h: int = 128) -> torch.Tensor:
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
    )
    return out


def expert_down_sum_plus(activations: torch.Tensor, ids: torch.Tensor, down: ExpertStack, residual: torch.Tensor,
                         block_h: int = 16, block_i: int = 512) -> torch.Tensor:
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
    )
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
    from ferrum_mac.backends.torch.kernels.triton_gemv import finish_split_gemv, inverse_rms
    from ferrum_mac.backends.torch.kernels.triton_moe import _swiglu_as_torch
    from ferrum_mac.backends.torch.kernels.triton_splits import arrived_last, sum_of_splits

    @triton.jit
    def dequantized_tile(words_ptr, scales_ptr, biases_ptr, columns, inside, ks, k_inside,
                         K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
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
                   K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
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
                    WORDS: tl.constexpr):
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
    ):
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
        )

    @triton.jit
    def _qmatmul_kernel(
        x_ptr, words_ptr, scales_ptr, biases_ptr, bias_ptr, out_ptr, rows,
        N: tl.constexpr, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
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
    def _expert_gate_up_swiglu_kernel(
        x_ptr, x_row_stride, ids_ptr, weights_ptr, words_ptr, scales_ptr, biases_ptr, out_ptr, tokens,
        K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        TOKENS_PAD: tl.constexpr, PAIRS_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_I: tl.constexpr,
        BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
    ):
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
    ):
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
