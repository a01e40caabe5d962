"""MLX's CPU build: the workarounds its slow kernels need (`CpuOps`)."""

from __future__ import annotations

import mlx.core as mx

from ferrum_mac.backends.mlx.attention import Attention, Segment
from ferrum_mac.backends.mlx.cpu import attention as cpu_attention
from ferrum_mac.backends.mlx.memory import free_memory_bytes
from ferrum_mac.backends.mlx.ops import Ops
from ferrum_mac.backends.options import DEFAULTS, BackendOptions
from ferrum_mac.weights import Checkpoint

# A segment of several tokens with at least this many scores (heads x queries x keys) attends
# by numpy (`cpu_attention.numpy_causal_attention`); FERRUM_MLX_NUMPY_ATTENTION=0: never.
NUMPY_MIN_SCORES = 1 << 16


class CpuOps(Ops):
    """MLX's ops, but numpy's attention for long segments, dense weights and float32 experts."""

    device = "cpu"
    # The fused matmul is no faster here, and concatenating the weights costs ~0.25 s of a
    # 135M model's load.
    fuse_projections = False

    def __init__(self, options: BackendOptions = DEFAULTS):
        super().__init__(options)
        self.numpy_min_scores = NUMPY_MIN_SCORES

    def load_tensors(self, checkpoint: Checkpoint, dtype: mx.Dtype) -> dict:
        """Quantized linears dense where that fits (`dequantize`), from the copy on disk when
        there is one (`dense_cache`)."""
        if not self.dequantize(checkpoint, dtype):
            return checkpoint.tensors
        from ferrum_mac.backends.mlx.cpu.dense_cache import dense_tensors

        return dense_tensors(checkpoint, dtype, cached=self.options.dense_cache)

    def dequantize(self, checkpoint: Checkpoint, dtype: mx.Dtype) -> bool:
        """Whether to load a quantized checkpoint dense. Quantized matmuls are slow on MLX's CPU
        build (SmolLM2-135M Q4_1 prefills a 31-token prompt in 5.5 s quantized, 0.26 s dense
        with float32 matmuls on OpenBLAS, see blas.py); the dense copy is kept on disk
        (dense_cache.py), so only the first open pays for dequantizing (~1 s for that model on
        2 cores). FERRUM_DEQUANTIZE_ON_CPU=0 keeps them quantized (the tests use it to run
        the quantized kernels)."""
        if not checkpoint.config.quantization or not self.options.dequantize_on_cpu:
            return False
        weights = checkpoint.quantized_weights
        if weights is None:  # at most 8 weights per uint32 (4-bit)
            weights = 8 * sum(
                t.size for n, t in checkpoint.tensors.items() if n.endswith(".weight") and t.dtype == mx.uint32
            )
        return weights * dtype.size < free_memory_bytes() // 3

    def expert_weights(self, weight: mx.array) -> mx.array:
        return weight.astype(mx.float32)  # MLX's CPU gather_mm runs in float32 only

    def attend_segment(self, attn: Attention, q: mx.array, k: mx.array, v: mx.array, seg: Segment) -> mx.array:
        """A long segment by numpy: a long chunk's work is mostly its softmax, and MLX's CPU
        `exp` is some 20 times slower than numpy's (docs/BENCHMARKS.md)."""
        end = seg.offset + seg.length
        if seg.length == 1 or not self.options.numpy_attention or attn.heads * seg.length * end < self.numpy_min_scores:
            return attn.attend_segment(q, k, v, seg)
        keys, values = seg.cache.write(attn.layer, k, v, seg.write_rows, seg.read_rows)
        return cpu_attention.numpy_causal_attention(q, keys, values, attn.scale)
