"""The small ops around a decode step's matmuls, fused into single kernels on MLX's CUDA build.

A decode step of one sequence is bound by the host: MLX records every op of the step, and
each costs host time whatever its size (docs/BENCHMARKS.md, MLX CUDA). Between the matmuls
a layer has many tiny ops; two kernels here take the place of most:

- `heads`: the fused q/k/v projection's output -> q, k and v by heads, q and k each
  RMS-normed by head (Qwen3's q_norm / k_norm, where the model has them) and rotated
  (RoPE). One kernel instead of a split, three reshapes, two norms and two RoPEs.
- `add_rms_norm`: a residual add and the RMSNorm of its sum (both returned). One kernel
  instead of two.

Each rounds where MLX's own ops round (the norm's product in the activations' dtype before
its weight multiplies it, the sum before the norm reads it), so the results match MLX's up
to the order of a float32 sum. `scripts/check-mlx-cuda-fused.py` checks them against MLX's
ops on the GPU; elsewhere the callers keep MLX's ops.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from ferrum_mac import settings
from ferrum_mac.backends.mlx.cuda_attention import int32
from ferrum_mac.backends.mlx.memory import on_cuda_gpu

# FERRUM_MLX_CUDA_FUSED=0 keeps MLX's ops (A/B timing).
ENABLED = settings.value("FERRUM_MLX_CUDA_FUSED")
NORM_THREADS = 256  # a block per row of `add_rms_norm`; each thread holds width / NORM_THREADS values
MAX_NORM_WIDTH = NORM_THREADS * 32

_BLOCK_SUM = """
// The sum of every thread's x, in every thread of the block (blockDim.x a multiple of 32).
__device__ __forceinline__ float ferrum_block_sum(float x) {
  __shared__ float partial[32];
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = x;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += partial[w];
  return total;
}
"""

# qkv (rows, (H + 2 KV) * D); positions int32, (rows,) when PER_ROW, else one (row r at it + r); q_norm, k_norm (D,); freqs
# (D / 2,) float32 (the rotation periods, when FREQS); consts (3,) float32: eps, log2(base),
# RoPE's position scale. A block per (head, row), a thread per rotated pair of values.
_HEADS = """
  constexpr int HALF = D / 2;
  const int head = blockIdx.x, row = blockIdx.y, i = threadIdx.x;
  const T* src = qkv + ((size_t)row * (H + 2 * KV) + head) * D;
  const int a = TRADITIONAL ? 2 * i : i;
  const int b = TRADITIONAL ? 2 * i + 1 : i + HALF;
  if (head >= H + KV) {
    T* dst = v + ((size_t)row * KV + head - H - KV) * D;
    dst[a] = src[a];
    dst[b] = src[b];
    return;
  }
  const bool is_q = head < H;
  T* dst = is_q ? q + ((size_t)row * H + head) * D : k + ((size_t)row * KV + head - H) * D;
  float x1 = static_cast<float>(src[a]), x2 = static_cast<float>(src[b]);
  if (NORM) {
    const T* w = is_q ? q_norm : k_norm;
    const float n = rsqrt(ferrum_block_sum(x1 * x1 + x2 * x2) / D + consts[0]);
    x1 = static_cast<float>(w[a] * static_cast<T>(x1 * n));
    x2 = static_cast<float>(w[b] * static_cast<T>(x2 * n));
  }
  const float inv_freq = FREQS ? 1.0 / freqs[i] : exp2(-(static_cast<float>(i) / static_cast<float>(HALF)) * consts[1]);
  const int position = PER_ROW ? positions[row] : positions[0] + row;
  const float theta = consts[2] * static_cast<float>(position) * inv_freq;
  const float c = cos(theta), s = sin(theta);
  dst[a] = static_cast<T>(x1 * c - x2 * s);
  dst[b] = static_cast<T>(x1 * s + x2 * c);
"""

# x, y (rows, N); w (N,); eps (1,) float32 -> h = x + y, out = RMSNorm(h) * w. A block per row.
_ADD_RMS_NORM = """
  constexpr int PER = N / NT;
  const size_t base = (size_t)blockIdx.x * N;
  float values[PER];
  float squares = 0.f;
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    const size_t at = base + threadIdx.x + j * NT;
    const T sum = static_cast<T>(static_cast<float>(x[at]) + static_cast<float>(y[at]));
    h[at] = sum;
    values[j] = static_cast<float>(sum);
    squares += values[j] * values[j];
  }
  const float n = rsqrt(ferrum_block_sum(squares) / N + eps[0]);
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int at = threadIdx.x + j * NT;
    out[base + at] = w[at] * static_cast<T>(values[j] * n);
  }
"""


@lru_cache(maxsize=None)
def _heads_kernel():
    return mx.fast.cuda_kernel(
        name="ferrum_qkv_heads", input_names=["qkv", "positions", "q_norm", "k_norm", "freqs", "consts"],
        output_names=["q", "k", "v"], source=_HEADS, header=_BLOCK_SUM,
    )  # fmt: skip


@lru_cache(maxsize=None)
def _add_rms_norm_kernel():
    return mx.fast.cuda_kernel(
        name="ferrum_add_rms_norm", input_names=["x", "y", "w", "eps"], output_names=["h", "out"],
        source=_ADD_RMS_NORM, header=_BLOCK_SUM,
    )  # fmt: skip


@lru_cache(maxsize=None)
def _floats(*values: float) -> mx.array:
    return mx.array(values, mx.float32)  # one array for every layer and step, not one each


def heads_run(head_dim: int) -> bool:
    """Whether `heads` runs here for heads of this size (a rotated pair a thread, whole warps)."""
    return ENABLED and head_dim % 64 == 0 and head_dim <= 2048 and on_cuda_gpu()


def add_rms_norm_runs(width: int) -> bool:
    return ENABLED and width % NORM_THREADS == 0 and width <= MAX_NORM_WIDTH and on_cuda_gpu()


class RopeSpec:
    """What `heads` needs of a `layers.Rope`: its constants as kernel inputs, made once."""

    def __init__(self, rope, eps: float):
        self.traditional = rope.traditional
        self.freqs = None if rope.freqs is None else rope.freqs.astype(mx.float32)
        log2_base = 0.0 if rope.base is None else math.log2(rope.base)
        self.consts = _floats(eps, log2_base, rope.scale)


def heads(qkv: mx.array, positions: mx.array, heads: int, kv_heads: int, head_dim: int,
          q_norm: mx.array | None, k_norm: mx.array | None, spec: RopeSpec) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    """qkv `(1, T, (heads + 2 kv_heads) * head_dim)`, positions a scalar (T = 1) or `(T,)` ->
    roped and normed q `(T, heads, dim)`, k `(T, kv_heads, dim)` and v likewise; for one token
    `(1, heads, 1, dim)` and so on (the layouts `Attention.project` returns)."""
    T = qkv.shape[1]
    per_row = positions.ndim == 1
    norm = q_norm is not None
    weights = (q_norm, k_norm) if norm else (qkv, qkv)  # unread without NORM
    freqs = spec.freqs if spec.freqs is not None else spec.consts  # unread without FREQS
    q, k, v = _heads_kernel()(
        inputs=[qkv, int32(positions), weights[0], weights[1], freqs, spec.consts],
        template=[("T", qkv.dtype), ("H", heads), ("KV", kv_heads), ("D", head_dim), ("NORM", norm),
                  ("FREQS", spec.freqs is not None), ("TRADITIONAL", spec.traditional), ("PER_ROW", per_row)],
        grid=(head_dim // 2 * (heads + 2 * kv_heads), T, 1),
        threadgroup=(head_dim // 2, 1, 1),
        output_shapes=[(T, heads, head_dim), (T, kv_heads, head_dim), (T, kv_heads, head_dim)],
        output_dtypes=[qkv.dtype] * 3,
    )  # fmt: skip
    if per_row:
        return q, k, v
    return tuple(a.reshape(1, a.shape[1], 1, head_dim) for a in (q, k, v))


def add_rms_norm(x: mx.array, y: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """`(x + y, mx.fast.rms_norm(x + y, weight, eps))` for x, y `(..., N)`, as one kernel."""
    N = x.shape[-1]
    rows = x.size // N
    h, out = _add_rms_norm_kernel()(
        inputs=[x, y, weight, _floats(eps)],
        template=[("T", x.dtype), ("N", N), ("NT", NORM_THREADS)],
        grid=(NORM_THREADS * rows, 1, 1),
        threadgroup=(NORM_THREADS, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )  # fmt: skip
    return h, out
