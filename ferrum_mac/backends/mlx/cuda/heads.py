"""One token's q, k and v heads from the fused qkv projection in one kernel, on MLX's CUDA build.

A decode step of one sequence is bound by the host: MLX records every op of the step, and
each costs host time whatever its size. Between the qkv matmul and attention a layer has
eight small ops: a split, three reshapes, Qwen3's q_norm and k_norm, and two RoPEs. `heads`
does them in one kernel: q and k each RMS-normed by head (where the model has those norms)
and rotated, v copied out, each in the layout `Attention.project` returns.

Only a kernel that replaces several of MLX's ops pays: on an H200 a custom kernel took
about 18 us of host time a call where MLX's add or RMSNorm took 3-5, so fusing an add with a
norm, or SwiGLU, in a kernel
of its own was slower (SwiGLU now rides in the gate/up product's kernel, `cuda_qmatmul`).

It rounds where MLX's ops round (the norm's product in the activations' dtype before its
weight multiplies it; RoPE's angle as MLX computes it), and on the GPU its outputs equal
MLX's bit for bit: `scripts/check-mlx-cuda-heads.py` checks that. Elsewhere the caller
keeps MLX's ops (`CudaOps.project` routes here; FERRUM_MLX_CUDA_HEADS=0 never).
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from ferrum_mac.backends.mlx.cuda.attention import int32

MAX_TOKENS = 65535  # a block row per token: CUDA's limit on a grid's second dimension

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

# qkv (rows, (H + 2 KV) * D); positions int32: (rows,) when PER_ROW, else one (row r at it + r);
# q_norm, k_norm (D,); freqs (D / 2,) float32, the rotation periods (when FREQS); consts (3,)
# float32: eps, log2(base), RoPE's position scale. A block per (head, row), a thread per
# rotated pair of values.
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


@lru_cache(maxsize=None)
def _heads_kernel():
    return mx.fast.cuda_kernel(
        name="ferrum_qkv_heads", input_names=["qkv", "positions", "q_norm", "k_norm", "freqs", "consts"],
        output_names=["q", "k", "v"], source=_HEADS, header=_BLOCK_SUM,
    )


@lru_cache(maxsize=None)
def _floats(*values: float) -> mx.array:
    return mx.array(values, mx.float32)  # one array for every layer and step, not one each


def runs(head_dim: int) -> bool:
    """Whether `heads` takes heads of this size (a rotated pair a thread, whole warps)."""
    return head_dim % 64 == 0 and head_dim <= 2048


class RopeSpec:
    """What `heads` needs of a `layers.Rope`: its constants as kernel inputs, made once."""

    def __init__(self, rope, eps: float):
        self.traditional = rope.traditional
        self.freqs = None if rope.freqs is None else rope.freqs.astype(mx.float32)
        log2_base = 0.0 if rope.base is None else math.log2(rope.base)
        self.consts = _floats(eps, log2_base, rope.scale)


def heads(qkv: mx.array, positions: mx.array, heads: int, kv_heads: int, head_dim: int,
          q_norm: mx.array | None, k_norm: mx.array | None, spec: RopeSpec) -> tuple[mx.array, mx.array, mx.array]:
    """qkv `(1, T, (heads + 2 kv_heads) * head_dim)`, positions a scalar (T = 1) or `(T,)` ->
    roped and normed q `(T, heads, dim)`, k `(T, kv_heads, dim)` and v likewise; for one token
    `(1, heads, 1, dim)` and so on (the layouts `Attention.project` returns)."""
    T = qkv.shape[1]
    per_row = positions.ndim == 1
    if not per_row and T != 1:
        raise ValueError(f"heads: {T} tokens at one position; several tokens need a position each")
    norm = q_norm is not None
    weights = (q_norm, k_norm) if norm else (qkv, qkv)  # unread without NORM
    freqs = spec.freqs if spec.freqs is not None else spec.consts  # unread without FREQS
    # one token: the heads-first layout `(1, heads, 1, dim)`, the same bytes, shaped by the kernel
    shape = (lambda n: (T, n, head_dim)) if per_row else (lambda n: (1, n, 1, head_dim))
    return tuple(
        _heads_kernel()(
            inputs=[qkv, int32(positions), weights[0], weights[1], freqs, spec.consts],
            template=[("T", qkv.dtype), ("H", heads), ("KV", kv_heads), ("D", head_dim), ("NORM", norm),
                      ("FREQS", spec.freqs is not None), ("TRADITIONAL", spec.traditional), ("PER_ROW", per_row)],
            grid=(head_dim // 2 * (heads + 2 * kv_heads), T, 1),
            threadgroup=(head_dim // 2, 1, 1),
            output_shapes=[shape(heads), shape(kv_heads), shape(kv_heads)],
            output_dtypes=[qkv.dtype] * 3,
        )
    )


def reference(qkv, positions, heads, kv_heads, dim, q_norm, k_norm, rope, eps):
    """`heads`' contract by MLX's ops (what `Attention.project` computes), in the kernel's layouts:
    what the GPU check and the CPU tests hold the kernel to."""
    T = qkv.shape[1]
    q, k, v = mx.split(qkv, [heads * dim, (heads + kv_heads) * dim], axis=-1)
    q, k, v = q.reshape(T, heads, dim), k.reshape(T, kv_heads, dim), v.reshape(T, kv_heads, dim)
    if q_norm is not None:
        q, k = mx.fast.rms_norm(q, q_norm, eps), mx.fast.rms_norm(k, k_norm, eps)
    if positions.ndim == 0:
        q, k = (rope(a.reshape(1, a.shape[1], 1, dim), positions) for a in (q, k))
        return q, k, v.reshape(1, kv_heads, 1, dim)
    q, k = (rope(a[:, :, None, :], positions)[:, :, 0, :] for a in (q, k))
    return q, k, v
