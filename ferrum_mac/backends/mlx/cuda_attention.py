"""Batched decode attention for MLX's CUDA build: one custom kernel that reads each
sequence's keys and values straight from the KV pool, up to that sequence's own length.

MLX's fused `scaled_dot_product_attention` takes no per-sequence lengths, and with an array
mask its CUDA build leaves the fused kernel for a general path several times slower (a
Qwen3-8B layer at batch 4: 316 us masked against 74 us unmasked, `scripts/probe-mlx-batch.py`);
the batch's keys also had to be gathered out of the pool first. Metal's fused kernel takes
masks, so this module is used on CUDA only.

One thread block serves one (sequence, kv head): its `group` query heads share every key
read. Each warp walks a strided share of the key positions with an online softmax in
float32 (a lane holds `head_dim / 32` dims, dot products reduced across the warp); the
warps' partial results are then merged through shared memory.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

WARPS = 8  # per block; each walks every WARPS-th run of UNROLL keys
UNROLL = 4  # keys loaded per warp before any is used, so loads overlap

_HEADER = """
template <typename T, int N>
struct alignas(sizeof(T) * N) FerrumPack {
  T v[N];
};

__device__ __forceinline__ float ferrum_warp_sum(float x) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}
"""

# Inputs: q (B, heads, D); keys/values (slots, kv_heads, tokens, D); slots, positions (B,)
# int32; scale (1,) float32. Output: out (B, heads, D). Template: T, D, G (group), NW, U.
_SOURCE = """
  constexpr int DPL = D / 32;  // dims per lane
  using Pack = FerrumPack<T, DPL>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int kv_heads = keys_shape[1];
  const int tokens = keys_shape[2];
  const int heads = kv_heads * G;
  const int length = positions[b] + 1;
  const size_t base = ((size_t)slots[b] * kv_heads + kvh) * tokens * D + lane * DPL;
  const float s = scale[0];

  float qr[G][DPL];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    Pack p = *reinterpret_cast<const Pack*>(q + ((size_t)b * heads + kvh * G + g) * D + lane * DPL);
    #pragma unroll
    for (int i = 0; i < DPL; ++i) qr[g][i] = static_cast<float>(p.v[i]) * s;
  }

  float m[G], l[G], acc[G][DPL];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
    #pragma unroll
    for (int i = 0; i < DPL; ++i) acc[g][i] = 0.f;
  }

  for (int t0 = warp * U; t0 < length; t0 += NW * U) {
    Pack kp[U], vp[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t0 + u < length) {
        kp[u] = *reinterpret_cast<const Pack*>(keys + base + (size_t)(t0 + u) * D);
        vp[u] = *reinterpret_cast<const Pack*>(values + base + (size_t)(t0 + u) * D);
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t0 + u >= length) break;
      #pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
        #pragma unroll
        for (int i = 0; i < DPL; ++i) dot += qr[g][i] * static_cast<float>(kp[u].v[i]);
        dot = ferrum_warp_sum(dot);
        const float m_new = fmaxf(m[g], dot);
        const float keep = expf(m[g] - m_new);
        const float p = expf(dot - m_new);
        l[g] = l[g] * keep + p;
        #pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] = acc[g][i] * keep + p * static_cast<float>(vp[u].v[i]);
        m[g] = m_new;
      }
    }
  }

  __shared__ float sm_m[NW][G];
  __shared__ float sm_l[NW][G];
  __shared__ float sm_acc[NW][G][D];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    #pragma unroll
    for (int i = 0; i < DPL; ++i) sm_acc[warp][g][lane * DPL + i] = acc[g][i];
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float top = -INFINITY;
    #pragma unroll
    for (int w = 0; w < NW; ++w) top = fmaxf(top, sm_m[w][g]);
    float num = 0.f, den = 0.f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = expf(sm_m[w][g] - top);  // 0 for a warp that saw no key
      num += sm_acc[w][g][d] * f;
      den += sm_l[w][g] * f;
    }
    out[((size_t)b * heads + kvh * G + g) * D + d] = static_cast<T>(num / den);
  }
"""


def supports(head_dim: int, group: int) -> bool:
    return head_dim % 32 == 0 and head_dim <= 256 and WARPS * group * head_dim * 4 <= 40_000


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(
        name="ferrum_decode_attention",
        input_names=["q", "keys", "values", "slots", "positions", "scale"],
        output_names=["out"],
        source=_SOURCE,
        header=_HEADER,
    )


def decode_attention(q: mx.array, keys: mx.array, values: mx.array, slots: mx.array, positions: mx.array, scale: float) -> mx.array:
    """q `(B, heads, dim)`; keys/values the whole pool `(slots, kv_heads, tokens, dim)`; row b
    attends slot `slots[b]`'s keys 0..`positions[b]`. Returns `(B, heads, dim)`."""
    B, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    (out,) = _kernel()(
        inputs=[q, keys, values, slots.astype(mx.int32), positions.astype(mx.int32), mx.array([scale], mx.float32)],
        template=[("T", q.dtype), ("D", dim), ("G", group), ("NW", WARPS), ("U", UNROLL)],
        grid=(32 * WARPS, kv_heads, B),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out
