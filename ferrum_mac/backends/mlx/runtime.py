"""`MlxLLM`: the `DecoderOnlyLLM` contract on MLX.

Every method is one call of `_forward` over a list of (cache, tokens, offset) segments:
prefill and decode are one segment, `decode_batch` many one-token segments,
`unified_forward` a mix. All checks run before any cache changes; device tokens (not
checked: that would wait for them) are clipped into the vocabulary before the embedding
lookup, which would read out of bounds and crash the process otherwise.
"""

from __future__ import annotations

import numbers
import os
from typing import Sequence

import mlx.core as mx

from ferrum_mac.backends.mlx.attention import Plan, Segment
from ferrum_mac.backends.mlx.dense_cache import dense_tensors
from ferrum_mac.backends.mlx.kv import KvManager
from ferrum_mac.backends.mlx.layers import TensorSource
from ferrum_mac.backends.mlx.memory import free_memory_bytes, on_cpu, wire_model_memory
from ferrum_mac.backends.mlx.models import FAMILIES
from ferrum_mac.errors import CacheStateError, UnsupportedError, UnsupportedModelError
from ferrum_mac.llm import (
    KV_MEMORY_SHARE,
    DecodeItem,
    DecoderOnlyLLM,
    ForwardItem,
    LlmRuntimeConfig,
    Token,
    host_tokens,
    kv_capacity_within,
)
from ferrum_mac.weights import Checkpoint

PREFILL_CHUNK = 2048  # longer prompts run in chunks so activations stay bounded
WARMUP_ID = "__ferrum_warmup__"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def compute_dtype(checkpoint: Checkpoint, override: str | None) -> mx.Dtype:
    if override:
        if override not in DTYPES:
            raise UnsupportedError(f"dtype {override!r} is not supported; choose one of: {', '.join(DTYPES)}")
        return DTYPES[override]
    if on_cpu():
        return mx.float32  # MLX's CPU build runs half-precision matmuls many times slower
    if checkpoint.config.quantization:
        scales = next((t for n, t in checkpoint.tensors.items() if n.endswith(".scales")), None)
        return scales.dtype if scales is not None else mx.float16
    return DTYPES.get(checkpoint.config.dtype, mx.float16)


def dequantize_on_cpu(checkpoint: Checkpoint, dtype: mx.Dtype) -> bool:
    """On MLX's CPU build quantized matmuls are slow (SmolLM2-135M Q4_1 prefills a 31-token
    prompt in 5.5 s quantized, 0.26 s dense with float32 matmuls on OpenBLAS, see
    cpu_blas.py): load them dense when that fits. The dense copy is kept on disk
    (dense_cache.py), so only the first open pays for dequantizing (~1 s for that model on
    2 cores). FERRUM_DEQUANTIZE_ON_CPU=0 keeps them quantized (the tests use it to run the
    quantized kernels)."""
    if not on_cpu() or not checkpoint.config.quantization or os.environ.get("FERRUM_DEQUANTIZE_ON_CPU") == "0":
        return False
    weights = checkpoint.quantized_weights
    if weights is None:  # at most 8 weights per uint32 (4-bit)
        weights = 8 * sum(t.size for n, t in checkpoint.tensors.items() if n.endswith(".weight") and t.dtype == mx.uint32)
    return weights * dtype.size < free_memory_bytes() // 3


class MlxLLM(DecoderOnlyLLM):
    device_array_types = (mx.array,)

    def __init__(self, checkpoint: Checkpoint, dtype: str | None = None, kv_capacity: int | None = None):
        c = checkpoint.config
        family = FAMILIES.get(c.model_type)
        if family is None:
            raise UnsupportedModelError(
                f"the MLX backend has no {c.model_type!r} model (supported: {', '.join(sorted(FAMILIES))})"
            )
        self.dtype = compute_dtype(checkpoint, dtype)
        tensors = checkpoint.tensors
        if dequantize_on_cpu(checkpoint, self.dtype):
            tensors = dense_tensors(checkpoint, self.dtype)
        source = TensorSource(tensors, c, self.dtype, str(checkpoint.path), fuse=not on_cpu())
        self.model = family(source, c)
        checkpoint.tensors.clear()  # the model holds what it needs (fused copies included)
        del tensors, source
        params = model_arrays(self.model)
        mx.eval(params)
        self.weight_bytes = sum(a.nbytes for a in params)
        wire_model_memory(self.weight_bytes)
        self.model_config = c
        self.source = checkpoint
        self._config = LlmRuntimeConfig.of_model(c, str(self.dtype).split(".")[-1])
        self._capacity = kv_capacity_within(self._config, free_memory_bytes(), self.dtype.size, kv_capacity)
        self.kv = KvManager(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self._capacity)

    # -- contract -------------------------------------------------------------------

    @property
    def config(self) -> LlmRuntimeConfig:
        return self._config

    def kv_capacity(self) -> int:
        return self._capacity

    def kv_free_tokens(self) -> int:
        return int(free_memory_bytes() * KV_MEMORY_SHARE) // self._config.kv_bytes_per_token(self.dtype.size)

    def kv_len(self, cache_id: str) -> int:
        return self.kv.length(cache_id)

    def kv_allocated_tokens(self) -> int:
        return self.kv.allocated_tokens

    def kv_used_tokens(self) -> int:
        return self.kv.used_tokens

    def kv_tokens_for(self, lengths: Sequence[int]) -> int:
        return self.kv.allocation_for(lengths)

    def prefill(self, cache_id: str, tokens: Sequence[int]) -> mx.array:
        tokens = host_tokens(cache_id, tokens)
        offset = self.kv.length(cache_id)
        self.check_call([(cache_id, tokens, offset)])
        for start in range(0, len(tokens) - PREFILL_CHUNK, PREFILL_CHUNK):
            self._forward([(cache_id, tokens[start : start + PREFILL_CHUNK], offset + start)])
            mx.eval(self.kv.arrays())
        last = (len(tokens) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
        h = self._forward([(cache_id, tokens[last:], offset + last)])
        return self.model.logits(h[:, -1:, :])[0, 0]

    def decode(self, cache_id: str, token: Token, pos: int) -> mx.array:
        self.check_call([(cache_id, token, pos)])
        h = self._forward([(cache_id, token, pos)])
        return self.model.logits(h)[0, 0]

    def decode_batch(self, items: Sequence[DecodeItem]) -> mx.array:
        segments = [(it.cache_id, it.token, it.pos) for it in items]
        self.check_call(segments)
        return self.model.logits(self._forward(segments))[0]

    def forward_verify(self, cache_id: str, tokens: Sequence[int]) -> mx.array:
        tokens = host_tokens(cache_id, tokens)
        offset = self.kv.length(cache_id)
        self.check_call([(cache_id, tokens, offset)])
        return self.model.logits(self._forward([(cache_id, tokens, offset)]))[0]

    def unified_forward(self, items: Sequence[ForwardItem]) -> list[mx.array | None]:
        segments = [(it.cache_id, host_tokens(it.cache_id, it.tokens), it.pos_offset) for it in items]
        self.check_call(segments)
        h = self._forward(segments)
        ends, row = [], 0
        for it in items:
            row += len(it.tokens)
            ends.append(row - 1)
        final_rows = [end for end, it in zip(ends, items) if it.is_final]
        if not final_rows:
            return [None] * len(items)
        logits = iter(self.model.logits(h[:, mx.array(final_rows), :])[0])
        return [next(logits) if it.is_final else None for it in items]

    def prepare(self, cache_id: str, max_tokens: int) -> None:
        self.kv.prepare(cache_id, min(max(1, max_tokens), self._capacity))
        warm = min(8, self._capacity - 1)
        if warm >= 1:
            logits = self.prefill(WARMUP_ID, [0] * warm)
            logits = self.decode(WARMUP_ID, mx.argmax(logits), warm)
            mx.eval(logits)
        self.release(WARMUP_ID)
        self.model.layers[0].attn.warm_up_kernels(self.dtype)  # the batched decode's, on CUDA

    def truncate_kv(self, cache_id: str, new_len: int) -> None:
        if new_len < 0:
            raise CacheStateError(f"cannot truncate {cache_id!r} to a negative length ({new_len})")
        self.kv.truncate(cache_id, new_len)

    def release(self, cache_id: str) -> None:
        self.kv.release(cache_id)

    def reset(self) -> None:
        self.kv.reset()
        mx.clear_cache()

    def sampler(self, params, context: Sequence[int] = ()):
        from ferrum_mac.backends.mlx.sampling import MlxSampler

        return MlxSampler(params, context, self._config.vocab_size)

    # -- one forward over segments ----------------------------------------------------

    def _forward(self, segments: list[tuple[str, object, int]]) -> mx.array:
        plan_segments, token_parts, start = [], [], 0
        for cache_id, tokens, offset in segments:
            ids = as_token_array(tokens, self._config.vocab_size)
            cache = self.kv.acquire(cache_id)
            self.kv.reserve(cache, offset + ids.size)
            plan_segments.append(Segment(cache, start, ids.size, offset))
            token_parts.append(ids)
            start += ids.size
        tokens = token_parts[0] if len(token_parts) == 1 else mx.concatenate(token_parts)
        h = self.model.hidden(tokens, Plan(plan_segments))
        for seg in plan_segments:
            seg.cache.length = seg.offset + seg.length
        return h


def as_token_array(tokens, vocab_size: int) -> mx.array:
    """Checked host ids, or a device array clipped into the vocabulary (negative ids wrap
    to large ones as uint32, so they clip to the last id)."""
    if isinstance(tokens, mx.array):
        tokens = tokens if tokens.ndim == 1 else tokens.reshape(-1)
        tokens = tokens if tokens.dtype == mx.uint32 else tokens.astype(mx.uint32)
        return mx.minimum(tokens, vocab_size - 1)
    if isinstance(tokens, numbers.Integral):  # int or a numpy integer
        return mx.array([int(tokens)], dtype=mx.uint32)
    return mx.array([int(t) for t in tokens], dtype=mx.uint32)  # int(): MLX takes no numpy scalars in a list


def model_arrays(obj, seen: set | None = None) -> list[mx.array]:
    """Every distinct array reachable from a model object (tied weights counted once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        children = obj
    elif hasattr(obj, "__dict__"):
        children = [v for k, v in vars(obj).items() if k != "config"]
    else:
        return []
    return [a for child in children for a in model_arrays(child, seen)]
