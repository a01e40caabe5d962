"""Batched decode attention for MLX's CUDA build: one custom kernel that reads each
sequence's keys and values straight from the KV pool through its block table, up to that
sequence's own length.

MLX's fused `scaled_dot_product_attention` takes no per-sequence lengths, and with an array
mask its CUDA build leaves the fused kernel for a general path several times slower
(`scripts/probe-mlx-batch.py`); the batch's keys also
had to be gathered out of the pool first. Metal's fused kernel takes masks, so this module is
used on CUDA only.

One thread block serves one (sequence, kv head, split of its keys): its `group` query heads
share every key read. Each warp walks a strided share of the split's keys with an online
softmax in float32 (a lane holds `head_dim / 32` dims, dot products reduced across the warp);
the warps' partial results are then merged through shared memory. Small batches split each
sequence's keys over several blocks to fill the GPU, and a second kernel merges the splits.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS

WARPS = 4  # per block; each walks every WARPS-th run of UNROLL keys (at the 160 registers a thread
# ncu counted, 3 such blocks fit an SM, against 1 of 8 warps)
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

# Inputs: q (B, heads, D); keys/values (1, kv_heads, rows, D): block k is rows k*BT .. k*BT+BT-1;
# tables (B, blocks) int32: sequence b's key t is in row tables[b, t / BT] * BT + t % BT;
# positions (B,) int32; scale (1,) float32. Template: T, D, G (group), NW, U, BT (tokens a
# block). Grid z: B * S blocks, S splits of each sequence's keys (a launch value, not a
# template one: no new compile as sequences grow). Each block walks keys [begin, end) of its split.
_WALK = """
  constexpr int DPL = D / 32;  // dims per lane
  using Pack = FerrumPack<T, DPL>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int kvh = blockIdx.y;
  const int S = gridDim.z / q_shape[0];
  const int b = blockIdx.z / S;
  const int split = blockIdx.z % S;
  const int kv_heads = keys_shape[1];
  const int rows = keys_shape[2];
  const int heads = kv_heads * G;
  const int length = positions[b] + 1;
  const int chunk = (length + S - 1) / S;
  const int begin = split * chunk;
  const int end = min(length, begin + chunk);
  const int* table = tables + (size_t)b * tables_shape[1];
  const size_t base = (size_t)kvh * rows * D + lane * DPL;
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

  for (int t0 = begin + warp * U; t0 < end; t0 += NW * U) {
    Pack kp[U], vp[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t0 + u < end) {
        const int t = t0 + u;
        const size_t at = base + ((size_t)table[t / BT] * BT + t % BT) * D;
        kp[u] = *reinterpret_cast<const Pack*>(keys + at);
        vp[u] = *reinterpret_cast<const Pack*>(values + at);
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t0 + u < end) {  // (a guard, not a break: a break stops the unrolling, and the packs
                           // indexed by a loop variable then live in local memory)
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
    if (top > -INFINITY) {  // else this split saw no key
      #pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float f = expf(sm_m[w][g] - top);  // 0 for a warp that saw no key
        num += sm_acc[w][g][d] * f;
        den += sm_l[w][g] * f;
      }
    }
    const size_t h = (size_t)b * heads + kvh * G + g;
"""

# One split: the block's result is the output.
_WHOLE = (
    _WALK
    + """
    out[h * D + d] = static_cast<T>(num / den);
  }
"""
)

# Several splits: partial results (max, sum of weights, weighted values; float32) per split.
_PARTIAL = (
    _WALK
    + """
    part_acc[(h * S + split) * D + d] = num;
    if (d == 0) {
      part_m[h * S + split] = top;
      part_l[h * S + split] = den;
    }
  }
"""
)

# part_m, part_l (B*heads, S), part_acc (B*heads, S, D) -> out (B, heads, D). Thread (d, row).
_MERGE = """
  const int S = part_m_shape[1];
  const int d = threadIdx.x + blockIdx.x * blockDim.x;
  const size_t h = blockIdx.y;
  if (d >= D) return;
  float top = -INFINITY;
  for (int s = 0; s < S; ++s) top = fmaxf(top, part_m[h * S + s]);
  float num = 0.f, den = 0.f;
  for (int s = 0; s < S; ++s) {
    const float f = expf(part_m[h * S + s] - top);
    num += part_acc[(h * S + s) * D + d] * f;
    den += part_l[h * S + s] * f;
  }
  out[h * D + d] = static_cast<T>(num / den);
"""

BLOCKS_WANTED = 1056  # eight blocks per SM of an H100: below it, a sequence's keys are split
MIN_KEYS_PER_SPLIT = 32
MAX_SPLITS = 64


def supports(head_dim: int, group: int) -> bool:
    return head_dim % 32 == 0 and head_dim <= 256 and WARPS * group * head_dim * 4 <= 40_000


@lru_cache(maxsize=None)
def _kernel(name: str):
    inputs = ["q", "keys", "values", "tables", "positions", "scale"]
    outputs, source = {
        "whole": (["out"], _WHOLE),
        "partial": (["part_m", "part_l", "part_acc"], _PARTIAL),
        "merge": (["out"], _MERGE),
    }[name]
    if name == "merge":
        inputs = ["part_m", "part_l", "part_acc"]
    return mx.fast.cuda_kernel(
        name=f"ferrum_decode_attention_{name}", input_names=inputs, output_names=outputs, source=source, header=_HEADER
    )


def int32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.int32 else a.astype(mx.int32)  # astype always adds a node


@lru_cache(maxsize=None)
def _scale_array(scale: float) -> mx.array:
    return mx.array([scale], mx.float32)  # one array for every layer and step, not one each


def splits_for(batch: int, kv_heads: int, longest: int) -> int:
    """Splits of each sequence's keys so the batch fills the GPU, none shorter than MIN_KEYS_PER_SPLIT."""
    wanted = -(-BLOCKS_WANTED // (batch * kv_heads))
    return max(1, min(wanted, -(-longest // MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def decode_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    tables: mx.array,
    positions: mx.array,
    scale: float,
    longest: int | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> mx.array:
    """q `(B, heads, dim)`; keys/values the whole pool `(1, kv_heads, rows, dim)`, in blocks of
    `block_tokens` rows; row b attends keys 0..`positions[b]` of the sequence whose block table
    is `tables[b]` (`(B, blocks)`); `longest` (a host bound on the lengths, default what the
    tables hold) picks how many thread blocks share a sequence. Returns `(B, heads, dim)`."""
    B, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    S = splits_for(B, kv_heads, tables.shape[1] * block_tokens if longest is None else longest)
    inputs = [q, keys, values, int32(tables), int32(positions), _scale_array(scale)]
    template = [("T", q.dtype), ("D", dim), ("G", group), ("NW", WARPS), ("U", UNROLL), ("BT", block_tokens)]
    launch = dict(grid=(32 * WARPS, kv_heads, B * S), threadgroup=(32 * WARPS, 1, 1))
    if S == 1:
        (out,) = _kernel("whole")(
            inputs=inputs, template=template, output_shapes=[q.shape], output_dtypes=[q.dtype], **launch
        )
        return out
    rows = B * heads
    part_m, part_l, part_acc = _kernel("partial")(
        inputs=inputs, template=template, **launch,
        output_shapes=[(rows, S), (rows, S), (rows, S, dim)], output_dtypes=[mx.float32] * 3,
    )
    (out,) = _kernel("merge")(
        inputs=[part_m, part_l, part_acc], template=[("T", q.dtype), ("D", dim)],
        grid=(dim, rows, 1), threadgroup=(dim, 1, 1), output_shapes=[q.shape], output_dtypes=[q.dtype],
    )
    return out


@lru_cache(maxsize=None)
def warm_up(dtype: mx.Dtype, heads: int, kv_heads: int, dim: int) -> None:
    """Compile every kernel here for this layout now (once a process: every `prepare` asks): a
    first compile takes seconds, which a server would otherwise spend inside the first step
    that splits keys."""
    longest = 2 * MIN_KEYS_PER_SPLIT
    blocks = -(-longest // BLOCK_TOKENS)
    pool = mx.zeros((1, kv_heads, 2 * blocks * BLOCK_TOKENS, dim), dtype)
    tables = mx.arange(2 * blocks, dtype=mx.int32).reshape(2, blocks)
    q, positions = mx.zeros((2, heads, dim), dtype), mx.array([longest - 1, 3])
    mx.eval(
        decode_attention(q, pool, pool, tables, positions, 1.0, longest=1),  # one thread block a sequence
        decode_attention(q, pool, pool, tables, positions, 1.0, longest=longest),  # split, merged
    )
