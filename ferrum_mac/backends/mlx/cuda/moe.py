"""A decode-sized MoE block for MLX's CUDA build in three custom kernels: the router's top-k,
the chosen experts' gate/up projections with SwiGLU, and their down projections summed over
each token's experts. MLX-quantized (affine, 4- or 8-bit) expert weights only.

A decode step of a MoE model is bound by how many kernels it runs, not by the bytes it reads
(a token took many times as long as reading its weights). MLX's route is argpartition, take,
softmax, then a gathered quantized matmul, a
SwiGLU, another gathered matmul and a sum: here it is three kernels, each reading only the
chosen experts' weights. The matrix-vector products put one warp on each output row, its
lanes walking the row's packed words (coalesced; a lane loads all of its words before using
any, so the loads overlap) against the input held in shared memory.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from ferrum_mac.backends.mlx.cuda.qmatmul import WARP_SUM

WARPS = 8  # output rows per block (one warp each)
MAX_PAIRS = 128  # token-expert pairs up to which these kernels run (decode steps and batches)

_HEADER = (
    WARP_SUM
    + """

// One lane's share of a packed row (affine-quantized: value = scale * q + bias per group):
// its words, every one loaded before any is used so the loads overlap, then its share of the
// dot product with the float vector xs.
template <typename T, int BITS, int GROUP, int COLS>
struct FerrumQRow {
  static constexpr int PACK = 32 / BITS;
  static constexpr int WORDS = COLS / PACK;
  static constexpr int GROUPS = COLS / GROUP;
  static constexpr int PER_LANE = (WORDS + 31) / 32;
  uint32_t packed[PER_LANE];
  float scale[PER_LANE], bias[PER_LANE];

  __device__ __forceinline__ void load(const uint32_t* w, const T* scales, const T* biases, size_t row, int lane) {
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int word = lane + 32 * i;
      const bool inside = word < WORDS;
      const size_t group = row * GROUPS + (inside ? word * PACK / GROUP : 0);
      packed[i] = inside ? w[row * WORDS + word] : 0u;
      scale[i] = inside ? static_cast<float>(scales[group]) : 0.f;
      bias[i] = inside ? static_cast<float>(biases[group]) : 0.f;
    }
  }

  __device__ __forceinline__ float dot(const float* xs, int lane) const {
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    float acc = 0.f;
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int word = lane + 32 * i;
      if (word < WORDS) {
        const int col = word * PACK;
        float qx = 0.f, xsum = 0.f;
        #pragma unroll
        for (int p = 0; p < PACK; ++p) {
          const float xv = xs[col + p];
          qx += static_cast<float>((packed[i] >> (p * BITS)) & MASK) * xv;
          xsum += xv;
        }
        acc += scale[i] * qx + bias[i] * xsum;
      }
    }
    return acc;
  }
};
"""
)

# logits (T, E) -> experts (T, K) uint32, weights (T, K). One warp per token.
_ROUTER = """
  constexpr int PER = (E + 31) / 32;
  const int t = blockIdx.y;
  const int lane = threadIdx.x;
  float v[PER];
  float top = -INFINITY;
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? static_cast<float>(logits[t * E + e]) : -INFINITY;
    top = fmaxf(top, v[i]);
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
  float z = 0.f;
  #pragma unroll
  for (int i = 0; i < PER; ++i) z += expf(v[i] - top);
  z = ferrum_warp_sum(z);

  float picked[K];
  float picked_sum = 0.f;
  for (int j = 0; j < K; ++j) {
    float best = -INFINITY;
    int index = 0x7fffffff;
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int e = lane + 32 * i;
      if (v[i] > best || (v[i] == best && e < index)) { best = v[i]; index = e; }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffff, best, o);
      const int other_index = __shfl_xor_sync(0xffffffff, index, o);
      if (other > best || (other == best && other_index < index)) { best = other; index = other_index; }
    }
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (lane + 32 * i == index) v[i] = -INFINITY;
    }
    if (index >= E) index = j;  // NaN logits: still a real expert (its weight is NaN too)
    picked[j] = best;
    picked_sum += expf(best - top);
    if (lane == 0) experts[t * K + j] = static_cast<uint32_t>(index);
  }
  if (lane == 0) {
    for (int j = 0; j < K; ++j) {
      const float p = expf(picked[j] - top);
      weights[t * K + j] = static_cast<T>(RENORM ? p / picked_sum : p / z);
    }
  }
"""

# x (T, H), gate_up packed (E, 2I, H*BITS/32) + scales/biases (E, 2I, H/GROUP), experts and
# weights (T, K) -> a (T, K, I) = silu(gate) * up * weight. Block: WARPS rows of one pair.
_GATE_UP = """
  const int pair = blockIdx.y;
  const int t = pair / K;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = blockIdx.x * NW + warp;
  __shared__ float xs[H];
  for (int i = threadIdx.x; i < H; i += blockDim.x) xs[i] = static_cast<float>(x[t * H + i]);
  __syncthreads();
  if (r >= I) return;
  const size_t gate_row = (size_t)experts[pair] * 2 * I + r;
  FerrumQRow<T, BITS, GROUP, H> gate, up;
  gate.load(w, scales, biases, gate_row, lane);
  up.load(w, scales, biases, gate_row + I, lane);
  float g = ferrum_warp_sum(gate.dot(xs, lane));
  float u = ferrum_warp_sum(up.dot(xs, lane));
  if (lane == 0) {
    g = static_cast<float>(static_cast<T>(g));  // rounded as the projection's output would be
    u = static_cast<float>(static_cast<T>(u));
    const float silu = g / (1.f + expf(-g));
    out[(size_t)pair * I + r] = static_cast<T>(silu * u * static_cast<float>(weights[pair]));
  }
"""

# a (T, K, I), down packed (E, H, I*BITS/32) + scales/biases (E, H, I/GROUP), experts (T, K)
# -> y (T, H) = sum over the token's K experts of a @ down^T. Block: WARPS rows of one token.
_DOWN = """
  const int t = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = blockIdx.x * NW + warp;
  __shared__ float as[K * I];
  for (int i = threadIdx.x; i < K * I; i += blockDim.x) as[i] = static_cast<float>(a[(size_t)t * K * I + i]);
  __syncthreads();
  if (r >= H) return;
  FerrumQRow<T, BITS, GROUP, I> rows[K];
  #pragma unroll
  for (int j = 0; j < K; ++j) rows[j].load(w, scales, biases, (size_t)experts[t * K + j] * H + r, lane);
  float acc = 0.f;
  #pragma unroll
  for (int j = 0; j < K; ++j) acc += rows[j].dot(as + j * I, lane);
  acc = ferrum_warp_sum(acc);
  if (lane == 0) out[(size_t)t * H + r] = static_cast<T>(acc);
"""


@lru_cache(maxsize=None)
def _kernel(name: str):
    inputs, outputs, source = {
        "router": (["logits"], ["experts", "weights"], _ROUTER),
        "gate_up": (["x", "w", "scales", "biases", "experts", "weights"], ["out"], _GATE_UP),
        "down": (["a", "w", "scales", "biases", "experts"], ["out"], _DOWN),
    }[name]
    return mx.fast.cuda_kernel(
        name=f"ferrum_moe_{name}", input_names=inputs, output_names=outputs, source=source, header=_HEADER
    )


def supports(hidden: int, inter: int, top_k: int, group_size: int, bits: int) -> bool:
    """Shapes these kernels take: 4/8-bit groups dividing both dims, inputs fitting shared memory."""
    return (
        bits in (4, 8)
        and hidden % group_size == 0
        and inter % group_size == 0
        and hidden * 4 <= 40_000
        and top_k * inter * 4 <= 40_000
    )


def route(logits: mx.array, top_k: int, renormalise: bool, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """logits `(T, E)` -> expert ids `(T, k)` (uint32, best first) and weights `(T, k)`: softmax
    in float32, the top k, renormalised to sum to one when asked."""
    T, E = logits.shape
    experts, weights = _kernel("router")(
        inputs=[logits],
        template=[("T", dtype), ("E", E), ("K", top_k), ("RENORM", renormalise)],
        grid=(32, T, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(T, top_k), (T, top_k)],
        output_dtypes=[mx.uint32, dtype],
    )
    return experts, weights


def gate_up_swiglu(x: mx.array, linear, experts: mx.array, weights: mx.array, inter: int) -> mx.array:
    """x `(T, H)` through each chosen expert's fused gate/up (`linear`: an ExpertLinear, quantized)
    -> `(T, k, inter)` = silu(gate) * up * router weight."""
    T, H = x.shape
    k = experts.shape[1]
    (out,) = _kernel("gate_up")(
        inputs=[x, linear.weight, linear.scales, linear.biases, experts, weights],
        template=[
            ("T", x.dtype),
            ("H", H),
            ("I", inter),
            ("K", k),
            ("BITS", linear.bits),
            ("GROUP", linear.group_size),
            ("NW", WARPS),
        ],
        grid=(32 * WARPS * -(-inter // WARPS), T * k, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(T, k, inter)],
        output_dtypes=[x.dtype],
    )
    return out


def down_sum(a: mx.array, linear, experts: mx.array, hidden: int) -> mx.array:
    """a `(T, k, inter)` through each chosen expert's down projection, summed over k -> `(T, hidden)`."""
    T, k, inter = a.shape
    (out,) = _kernel("down")(
        inputs=[a, linear.weight, linear.scales, linear.biases, experts],
        template=[
            ("T", a.dtype),
            ("H", hidden),
            ("I", inter),
            ("K", k),
            ("BITS", linear.bits),
            ("GROUP", linear.group_size),
            ("NW", WARPS),
        ],
        grid=(32 * WARPS * -(-hidden // WARPS), T, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(T, hidden)],
        output_dtypes=[a.dtype],
    )
    return out
