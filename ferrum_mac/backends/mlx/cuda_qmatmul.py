"""A quantized matmul for a few rows (a batched decode step's) on MLX's CUDA build.

MLX's `quantized_matmul` runs one row as a matrix-vector kernel, but from two rows on it
switches to a tiled matrix-matrix kernel that, at decode sizes, reads the weight slower than
the vector kernel reads it for one row: on an H100, Qwen3-30B-A3B's projections took 44 us a
call at 8 rows against 9 us at one, so a batch of 8 spent 4 of its 15 ms there. This kernel
reads each packed weight word once for all rows: a warp takes ROWS_PER_WARP output rows, its
lanes walk the rows' packed words (coalesced), dequantize each word once and multiply it with
every input row (held in registers for the warp's rows).

MLX-quantized (affine, 4- or 8-bit) weights only; x `(M, K)` with M up to MAX_ROWS.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from ferrum_mac.backends.mlx.memory import on_cuda_gpu

MAX_ROWS = 8  # the input rows of one call are held in registers: up to this many
MIN_ROWS = 2  # one row: MLX's own vector kernel
WARPS = 4  # per block
ROWS_PER_WARP = 2  # output rows a warp computes from one read of its inputs
# FERRUM_MLX_CUDA_QMM=0 keeps MLX's quantized_matmul for every row count (A/B timing).
ENABLED = os.environ.get("FERRUM_MLX_CUDA_QMM", "1") != "0"

WARP_SUM = """
__device__ __forceinline__ float ferrum_warp_sum(float x) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}
"""

# PACK consecutive values of src as floats: 16-byte loads where the address allows.
_LOAD = """
template <typename T, int PACK>
__device__ __forceinline__ void ferrum_load_floats(const T* src, float* dst) {
  constexpr int VECTORS = sizeof(T) * PACK / 16;
  if (VECTORS > 0 && sizeof(T) * PACK % 16 == 0 && (reinterpret_cast<size_t>(src) & 15) == 0) {
    #pragma unroll
    for (int v = 0; v < (VECTORS > 0 ? VECTORS : 1); ++v) {
      const uint4 raw = reinterpret_cast<const uint4*>(src)[v];
      const T* values = reinterpret_cast<const T*>(&raw);
      #pragma unroll
      for (int i = 0; i < 16 / (int)sizeof(T); ++i) dst[v * (16 / sizeof(T)) + i] = static_cast<float>(values[i]);
    }
  } else {
    #pragma unroll
    for (int p = 0; p < PACK; ++p) dst[p] = static_cast<float>(src[p]);
  }
}
"""

# x (M, K), w packed (N, K*BITS/32) uint32, scales/biases (N, K/GROUP) -> out (M, N).
_SOURCE = """
  constexpr int PACK = 32 / BITS;
  constexpr int WORDS = K / PACK;
  constexpr int GROUPS = K / GROUP;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first = (blockIdx.x * NW + warp) * R;
  if (first >= N) return;
  float acc[R][M];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  }
  for (int word = lane; word < WORDS; word += 32) {
    const int col = word * PACK;
    float xv[M][PACK];
    #pragma unroll
    for (int m = 0; m < M; ++m) ferrum_load_floats<T, PACK>(x + m * K + col, xv[m]);
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const int n = first + r;
      if (n < N) {
        const uint32_t packed = w[(size_t)n * WORDS + word];
        const float s = static_cast<float>(scales[(size_t)n * GROUPS + col / GROUP]);
        const float b = static_cast<float>(biases[(size_t)n * GROUPS + col / GROUP]);
        #pragma unroll
        for (int p = 0; p < PACK; ++p) {
          const float wv = s * static_cast<float>((packed >> (p * BITS)) & MASK) + b;
          #pragma unroll
          for (int m = 0; m < M; ++m) acc[r][m] += wv * xv[m][p];
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      const float total = ferrum_warp_sum(acc[r][m]);
      if (lane == 0 && first + r < N) out[(size_t)m * N + first + r] = static_cast<T>(total);
    }
  }
"""


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(
        name="ferrum_qmm_rows", input_names=["x", "w", "scales", "biases"], output_names=["out"],
        source=_SOURCE, header=WARP_SUM + _LOAD,
    )  # fmt: skip


def runs(rows: int, in_dim: int, group_size: int, bits: int) -> bool:
    """Whether `quantized_matmul` takes `rows` rows of a linear of this format here."""
    return (
        ENABLED and MIN_ROWS <= rows <= MAX_ROWS and bits in (4, 8)
        and in_dim % group_size == 0 and in_dim % 32 == 0 and on_cuda_gpu()
    )  # fmt: skip


def quantized_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """x `(..., K)` with a few rows in all, times the dequantized `weight` `(N, K)` transposed -> `(..., N)`."""
    K, N = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, K)
    M = flat.shape[0]
    (out,) = _kernel()(
        inputs=[flat, weight, scales, biases],
        template=[("T", x.dtype), ("M", M), ("K", K), ("N", N), ("BITS", bits), ("GROUP", group_size), ("NW", WARPS), ("R", ROWS_PER_WARP)],
        grid=(32 * WARPS * -(-N // (WARPS * ROWS_PER_WARP)), 1, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*x.shape[:-1], N)
