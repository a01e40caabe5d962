"""A packed 4-bit or 8-bit weight (`quant.Packed`) written out dense by a Triton kernel
(`dequantize`): from `quant.DENSE_MIN_ROWS` rows prefill multiplies with the whole weight
dense in cuBLAS (`quant.dense_matmul`) rather than with `triton_quant.matmul`, which
dequantizes a tile per step of K. Its values are `Packed.dequantize`'s, rounded once to the
dense dtype. Entry functions launch on whatever tensors they are given (CUDA, or CPU tensors
under `TRITON_INTERPRET=1`); the module loads without triton.
"""

from __future__ import annotations

import torch

from ferrum_mac.backends.torch.quant import Packed

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# `dequantize`: a program's (rows, values of K) of the weight, and its warps
DEQUANT_BLOCK, DEQUANT_WARPS, DEQUANT_MANTISSA = (32, 256), 4, False


def dequantize(weight: Packed, out: torch.Tensor, block: tuple[int, int] = DEQUANT_BLOCK,
               warps: int = DEQUANT_WARPS, mantissa: bool = DEQUANT_MANTISSA) -> torch.Tensor:
    """The packed W `(N, K)` dense in `out` (contiguous, `(N, K)`, of the dtype wanted), as
    `Packed.dequantize(out.dtype)` computes it (scale * q + bias in float32, rounded once: the
    same bits wherever q * scale is exact, as it is for 16-bit scales); returns `out`. Prefill
    multiplies with it in cuBLAS (`quant.dense_matmul`). A program takes `block` (rows,
    values of K: powers of two); `mantissa`: q made a float as `triton_fma_gemv.values_at`
    makes it (an or and an add, exact) rather than by a conversion."""
    n, k = weight.shape
    assert out.shape == (n, k) and out.is_contiguous()
    block_n, block_k = block[0], max(block[1], weight.group_size)  # (whole groups)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.words, weight.scales, weight.biases, out, n,
        K=k, BITS=weight.bits, GROUP=weight.group_size, BLOCK_N=block_n, BLOCK_K=block_k, MANTISSA=mantissa,
        num_warps=warps,
    )
    return out


# -- kernels ------------------------------------------------------------------------------------

if triton is not None:
    from ferrum_mac.backends.torch.kernels.triton_quant import words_tile

    @triton.jit
    def _dequantize_kernel(words_ptr, scales_ptr, biases_ptr, out_ptr, n,
                           K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MANTISSA: tl.constexpr):
        # One program per (BLOCK_N rows, BLOCK_K values) tile of the weight: its words, scales
        # and biases read once each (as `triton_quant.words_tile` reads them), the dense tile
        # written in out's dtype.
        per_word: tl.constexpr = 32 // BITS
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        start = tl.program_id(1) * BLOCK_K
        inside = rows < n
        if MANTISSA:
            rows_64 = rows[:, None].to(tl.int64)
            wi = start // per_word + tl.arange(0, BLOCK_K // per_word)
            words = tl.load(words_ptr + rows_64 * (K // per_word) + wi[None, :],
                            mask=inside[:, None] & (wi * per_word < K)[None, :], other=0)
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
