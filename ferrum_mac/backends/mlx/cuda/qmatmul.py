"""A quantized matmul for a few rows (a batched decode step's) on MLX's CUDA build.

MLX's `quantized_matmul` runs one row as a matrix-vector kernel, but from two rows on it
switches to a tiled matrix-matrix kernel that, at decode sizes, reads the weight slower than
the vector kernel reads it for one row, so a batch of 8 spent much of its step there; and
for one row of a large widening weight the
vector kernel is slower than this one. This kernel reads each packed weight word once for
all rows: a warp takes one or two output rows (`launch_shape`), its lanes walk the rows'
packed words (coalesced, eight words a lane loaded before any is used), dequantize each word
once and multiply it with every input row.

One row of a 4-bit weight (a lone sequence's decode step) has a kernel of its own, which reads
the weight in 512-byte runs a warp and twice as fast as MLX's vector kernel or the few-row one
(`_ONE_ROW_SOURCE`).

For a weight that stacks an MLP's gate rows over its up rows, both can write the SwiGLU,
silu(gate) * up, themselves (a warp computes a gate row and its up row): two nodes a layer fewer.

MLX-quantized (affine, 4- or 8-bit) weights only; x `(M, K)` with M up to MAX_ROWS.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn


MAX_ROWS = 8  # the input rows of one call are held in registers: up to this many
# One row the one-row kernel does not fit takes MLX's vector kernel but where the few-row one
# reads faster: a widening weight of at least this many values, not a small or narrowing one
# (docs/BENCHMARKS.md, the MLX CUDA table: qwen3-8b 4-bit, one row of a large widening weight).
ONE_ROW_MIN_WEIGHTS = 1 << 24
WARPS = 4  # per block, when the output has rows enough to fill the GPU so
ROWS_PER_WARP = 2  # output rows a warp computes from one read of its inputs, likewise
BLOCKS_WANTED = 264  # two per SM of an H100: narrower outputs get smaller blocks
# From this many input rows on, MLX's tiled kernel wins where the output is wide enough to
# fill the GPU with its tiles (the lm_head at 8 rows).
TILED_ROWS, TILED_MIN_OUT = 8, 16384
# One row of a 4-bit weight takes the one-row kernel (`_ONE_ROW_SOURCE`) where it fits: K a
# multiple of 1,024 (a warp's 512-byte reads) and at most this (x in 32 KB of shared memory).
ONE_ROW = True  # probes turn it off for A/B timing
ONE_ROW_MAX_K = 16384

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

# x (M, K), w packed (N, K*BITS/32) uint32, scales/biases (N, K/GROUP) -> out (M, N), or
# (M, N / 2) with SWIGLU. A warp takes R output rows (each one weight row, or a gate row and
# its up row: W weight rows); its lanes walk their words 8 / W at a time, loading every packed
# word, scale and bias of those before using any (so the loads overlap), then the inputs'
# values for each word once for all rows.
_SOURCE = """
  constexpr int PACK = 32 / BITS;
  constexpr int WORDS = K / PACK;
  constexpr int GROUPS = K / GROUP;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr int W = SWIGLU ? 2 * R : R;
  constexpr int UNROLL = 8 / W > 0 ? 8 / W : 1;
  constexpr int OUT = SWIGLU ? N / 2 : N;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first = (blockIdx.x * NW + warp) * R;
  if (first >= OUT) return;
  float acc[W][M];
  #pragma unroll
  for (int r = 0; r < W; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  }
  for (int base = 0; base < WORDS; base += 32 * UNROLL) {
    uint32_t packed[UNROLL][W];
    float scale[UNROLL][W], bias[UNROLL][W];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int word = base + 32 * u + lane;
      #pragma unroll
      for (int r = 0; r < W; ++r) {
        const int out_row = first + r % R;  // with SWIGLU, rows R.. are the up rows of 0..
        const bool inside = word < WORDS && out_row < OUT;
        const size_t n = inside ? out_row + (r >= R ? OUT : 0) : 0;
        const size_t group = n * GROUPS + (inside ? word * PACK / GROUP : 0);
        packed[u][r] = inside ? w[n * WORDS + word] : 0u;
        scale[u][r] = inside ? static_cast<float>(scales[group]) : 0.f;
        bias[u][r] = inside ? static_cast<float>(biases[group]) : 0.f;
      }
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int word = base + 32 * u + lane;
      if (word < WORDS) {
        float xv[M][PACK];
        #pragma unroll
        for (int m = 0; m < M; ++m) ferrum_load_floats<T, PACK>(x + m * K + word * PACK, xv[m]);
        #pragma unroll
        for (int r = 0; r < W; ++r) {
          #pragma unroll
          for (int p = 0; p < PACK; ++p) {
            const float wv = scale[u][r] * static_cast<float>((packed[u][r] >> (p * BITS)) & MASK) + bias[u][r];
            #pragma unroll
            for (int m = 0; m < M; ++m) acc[r][m] += wv * xv[m][p];
          }
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      // the product rounds to T as MLX's matmul output would, before the SwiGLU reads it
      const float total = static_cast<float>(static_cast<T>(ferrum_warp_sum(acc[r][m])));
      float value = total;
      if constexpr (SWIGLU) {
        const float up = static_cast<float>(static_cast<T>(ferrum_warp_sum(acc[r + R][m])));
        value = total / (1.f + expf(-total)) * up;
      }
      if (lane == 0 && first + r < OUT) out[(size_t)m * OUT + first + r] = static_cast<T>(value);
    }
  }
"""


# One row of 4-bit weights (a lone sequence's decode step), x `(K,)` 2-byte floats. The block
# stages x in shared memory once; a warp takes R output rows (W weight rows, as above), and each
# lane reads 16 bytes of a weight row at a time (four words, 32 values: a whole group of 32 or
# part of a larger one), so a warp's load is 512 consecutive bytes. The loads of up to BATCH
# such pieces a row are issued before any is used. A piece's dot product takes the group's
# scale and bias once: scale * sum(q * x) + bias * sum(x). Each lane reads its piece's x in a
# rotated order, so a quarter warp's reads of shared memory fall in distinct banks.
_ONE_ROW_SOURCE = """
  constexpr int WORDS = K / 8;
  constexpr int PIECES = WORDS / 128;  // a lane's 16-byte pieces of one weight row
  constexpr int BATCH = PIECES < 4 ? PIECES : 4;
  constexpr int GROUPS = K / GROUP;
  constexpr int W = SWIGLU ? 2 * R : R;
  constexpr int OUT = SWIGLU ? N / 2 : N;
  __shared__ uint4 xs4[K / 8];
  for (int i = threadIdx.x; i < K / 8; i += blockDim.x) xs4[i] = reinterpret_cast<const uint4*>(x)[i];
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first = (blockIdx.x * NW + warp) * R;
  if (first >= OUT) return;
  const uint4* rows[W];
  const T* row_scales[W];
  const T* row_biases[W];
  #pragma unroll
  for (int r = 0; r < W; ++r) {
    // past the last output row a warp recomputes the last (and does not write it)
    const int out_row = min(first + r % R, OUT - 1);
    const size_t n = out_row + (r >= R ? OUT : 0);  // with SWIGLU, rows R.. are the up rows of 0..
    rows[r] = reinterpret_cast<const uint4*>(w + n * WORDS);
    row_scales[r] = scales + n * GROUPS;
    row_biases[r] = biases + n * GROUPS;
  }
  const int turn = lane >> 1;
  float acc[W];
  #pragma unroll
  for (int r = 0; r < W; ++r) acc[r] = 0.f;
  #pragma unroll
  for (int p0 = 0; p0 < PIECES; p0 += BATCH) {
    uint4 q[BATCH][W];
    float scale[BATCH][W], bias[BATCH][W];
    #pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int piece = (p0 + b) * 32 + lane;
      #pragma unroll
      for (int r = 0; r < W; ++r) {
        q[b][r] = rows[r][piece];
        scale[b][r] = static_cast<float>(row_scales[r][piece * 32 / GROUP]);
        bias[b][r] = static_cast<float>(row_biases[r][piece * 32 / GROUP]);
      }
    }
    #pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int piece = (p0 + b) * 32 + lane;
      float dot[W], xsum = 0.f;
      #pragma unroll
      for (int r = 0; r < W; ++r) dot[r] = 0.f;
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int word = (j + turn) & 3;
        const uint4 raw = xs4[piece * 4 + word];
        const T* xv = reinterpret_cast<const T*>(&raw);
        float xf[8];
        #pragma unroll
        for (int k = 0; k < 8; ++k) {
          xf[k] = static_cast<float>(xv[k]);
          xsum += xf[k];
        }
        #pragma unroll
        for (int r = 0; r < W; ++r) {
          const uint32_t bits = word == 0 ? q[b][r].x : word == 1 ? q[b][r].y : word == 2 ? q[b][r].z : q[b][r].w;
          #pragma unroll
          for (int k = 0; k < 8; ++k) {
            // 2^23 + a nibble, as a float's bits, minus 2^23: the nibble as a float
            const float value = __int_as_float(0x4B000000 | ((bits >> (4 * k)) & 15u)) - 8388608.f;
            dot[r] += value * xf[k];
          }
        }
      }
      #pragma unroll
      for (int r = 0; r < W; ++r) acc[r] += scale[b][r] * dot[r] + bias[b][r] * xsum;
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const float total = static_cast<float>(static_cast<T>(ferrum_warp_sum(acc[r])));
    float value = total;
    if constexpr (SWIGLU) {
      const float up = static_cast<float>(static_cast<T>(ferrum_warp_sum(acc[r + R])));
      value = total / (1.f + expf(-total)) * up;
    }
    if (lane == 0 && first + r < OUT) out[first + r] = static_cast<T>(value);
  }
"""


@lru_cache(maxsize=None)
def _one_row_kernel():
    return mx.fast.cuda_kernel(
        name="ferrum_qmv", input_names=["x", "w", "scales", "biases"], output_names=["out"],
        source=_ONE_ROW_SOURCE, header=WARP_SUM,
    )


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(
        name="ferrum_qmm_rows", input_names=["x", "w", "scales", "biases"], output_names=["out"],
        source=_SOURCE, header=WARP_SUM + _LOAD,
    )


def runs(rows: int, out_dim: int, in_dim: int, group_size: int, bits: int, dtype: mx.Dtype = mx.bfloat16) -> bool:
    """Whether `quantized_matmul` takes `rows` rows of a linear of this format."""
    one_row = one_row_fits(in_dim, group_size, bits, dtype) or (
        out_dim > in_dim and out_dim * in_dim >= ONE_ROW_MIN_WEIGHTS
    )
    return (
        1 <= rows <= MAX_ROWS and bits in (4, 8)
        and (rows > 1 or one_row)
        and not (rows >= TILED_ROWS and out_dim >= TILED_MIN_OUT)
        and in_dim % group_size == 0 and in_dim % 32 == 0
    )


def one_row_fits(in_dim: int, group_size: int, bits: int, dtype: mx.Dtype) -> bool:
    """Whether one row of a linear of this format takes the one-row kernel."""
    return (
        ONE_ROW and bits == 4 and in_dim % 1024 == 0 and in_dim <= ONE_ROW_MAX_K
        and group_size % 32 == 0 and dtype in (mx.bfloat16, mx.float16)
    )


def one_row_launch(out_dim: int) -> tuple[int, int]:
    """Warps per block and output rows per warp of the one-row kernel: a warp a row, four for a
    head's wide output."""
    return 8, (4 if out_dim >= 65536 else 1)


def launch_shape(out_dim: int, warps: int | None = None, rows_per_warp: int | None = None) -> tuple[int, int]:
    """Warps per block and output rows per warp: fewer of each where the output is too narrow
    to give the GPU BLOCKS_WANTED blocks otherwise (an output of 128 rows gets 128 one-warp blocks)."""
    r = rows_per_warp or (ROWS_PER_WARP if out_dim >= BLOCKS_WANTED * WARPS * ROWS_PER_WARP else 1)
    nw = warps or (WARPS if out_dim >= BLOCKS_WANTED * WARPS * r else 1)
    return nw, r


def quantized_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                     swiglu: bool = False, warps: int | None = None, rows_per_warp: int | None = None) -> mx.array:
    """x `(..., K)` with a few rows in all, times the dequantized `weight` `(N, K)` transposed -> `(..., N)`.
    `swiglu`: the weight is a gate's rows over an up projection's, and the result
    `silu(gate) * up` `(..., N / 2)`. `warps` and `rows_per_warp` override the launch shape
    (`one_row_launch` or `launch_shape`; for timing)."""
    K, N = x.shape[-1], weight.shape[0]
    M = x.size // K  # the kernels read x as (M, K) whatever its shape: no reshape node
    out_dim = N // 2 if swiglu else N
    template = [("T", x.dtype), ("K", K), ("N", N), ("GROUP", group_size), ("SWIGLU", swiglu)]
    if M == 1 and one_row_fits(K, group_size, bits, x.dtype):
        kernel, (nw, r) = _one_row_kernel(), one_row_launch(out_dim)
        nw, r = warps or nw, rows_per_warp or r
    else:
        kernel, template = _kernel(), template + [("M", M), ("BITS", bits)]
        # a SwiGLU warp reads two weight rows an output row: one output row each, where a plain one takes two
        nw, r = launch_shape(out_dim, warps, rows_per_warp or (1 if swiglu else None))
    (out,) = kernel(
        inputs=[x, weight, scales, biases],
        template=template + [("NW", nw), ("R", r)],
        grid=(32 * nw * -(-out_dim // (nw * r)), 1, 1),
        threadgroup=(32 * nw, 1, 1),
        output_shapes=[(*x.shape[:-1], out_dim)],
        output_dtypes=[x.dtype],
    )
    return out


def reference(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
              swiglu: bool = False) -> mx.array:
    """What `quantized_matmul` computes, by MLX's own ops (the GPU check compares them; CPU
    tests route the model through it)."""
    y = mx.quantized_matmul(x, weight, scales, biases, transpose=True, group_size=group_size, bits=bits)
    if not swiglu:
        return y
    gate, up = mx.split(y, 2, axis=-1)
    return nn.silu(gate) * up
