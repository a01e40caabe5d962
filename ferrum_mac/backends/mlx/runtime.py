"""`MlxLLM`: the `DecoderOnlyLLM` contract on MLX.

Every method is one forward over a list of (cache, tokens, offset) segments (`PooledLLM`
keeps the bookkeeping and checks): prefill and decode are one segment, `decode_batch`
many one-token segments, `unified_forward` a mix. Device tokens (not checked: that would
wait for them) are clipped into the vocabulary before the embedding lookup, which would
read out of bounds and crash the process otherwise.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import mlx.core as mx

from ferrum_mac.backends.mlx.attention import Plan, Segment
from ferrum_mac.backends.mlx.kv import BLOCK_TOKENS, KvManager
from ferrum_mac.backends.mlx.layers import TensorSource
from ferrum_mac.backends.mlx.memory import free_memory_bytes, on_cpu, wire_model_memory
from ferrum_mac.backends.mlx.models import FAMILIES
from ferrum_mac.backends.mlx.ops import Ops, device_ops
from ferrum_mac.backends.options import DEFAULTS, BackendOptions
from ferrum_mac.backends.state.manager import PooledState
from ferrum_mac.backends.state.pooled_llm import PooledLLM, model_family, named_dtype, pool_limits
from ferrum_mac.backends.state.recurrent import RecurrentStates, recurrent_tokens
from ferrum_mac.backends.state.windowed import WindowedKv
from ferrum_mac.llm import KV_MEMORY_SHARE, DecodeItem, LlmRuntimeConfig, kv_capacity_within
from ferrum_mac.weights import Checkpoint

WARMUP_ID = "__ferrum_warmup__"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def compute_dtype(checkpoint: Checkpoint, override: str | None) -> mx.Dtype:
    if override:
        return named_dtype(override, DTYPES)
    if on_cpu():
        return mx.float32  # MLX's CPU build runs half-precision matmuls many times slower
    if checkpoint.config.quantization:
        scales = next((t for n, t in checkpoint.tensors.items() if n.endswith(".scales")), None)
        return scales.dtype if scales is not None else mx.float16
    return DTYPES.get(checkpoint.config.dtype, mx.float16)


class MlxLLM(PooledLLM):
    device_array_types = (mx.array,)
    window_segment_type = Segment

    def __init__(
        self,
        checkpoint: Checkpoint,
        dtype: str | None = None,
        kv_capacity: int | None = None,
        options: BackendOptions = DEFAULTS,
        ops: Ops | None = None,
    ):
        """`ops`: the routes of the model's steps (default: those of MLX's device now, `device_ops`)."""
        c = checkpoint.config
        family = model_family(FAMILIES, c.model_type, "MLX")
        self.ops = ops or device_ops(options)
        self.segment_type = self.ops.segment_type
        self.dtype = compute_dtype(checkpoint, dtype)
        tensors = self.ops.load_tensors(checkpoint, self.dtype)
        source = TensorSource(tensors, c, self.dtype, str(checkpoint.path), self.ops)
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
        free = free_memory_bytes()
        self._capacity = kv_capacity_within(self._config, free, self.dtype.size, kv_capacity)
        self.model.use_context(self._capacity)
        max_blocks, cache_blocks = pool_limits(
            self._config, free, self.dtype.size, BLOCK_TOKENS, options.prefix_cache_mb
        )
        windowed = [i for i, w in enumerate(c.layer_windows) if w]
        if c.recurrent_layers:  # (the prefix cache keeps no recurrent state: nothing to reuse)
            cache_blocks = 0
        disk = cache_blocks and not windowed  # (the disk tier keeps every layer's blocks: none with windows)
        self.kv = KvManager(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.dtype,
            self._capacity,
            max_blocks,
            cache_blocks,
            self._prefix_disk(checkpoint, f"mlx-{self.ops.device}", options) if disk else None,
            layers=[i for i in range(c.num_layers) if i not in windowed and i not in c.recurrent_layers],
        )
        window_pool = KvManager(
            c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self._capacity, max_blocks, layers=windowed
        )
        self._state = PooledState(
            self.kv,
            self._config,
            self.device_array_types,
            free_tokens=self._free_tokens,
            windowed=WindowedKv(window_pool, max(c.layer_windows), self.kv.prefix) if windowed else None,
            recurrent=RecurrentStates(recurrent_tokens(c, self._config, self.dtype.size))
            if c.recurrent_layers
            else None,
        )

    def _free_tokens(self) -> int:
        """Tokens free memory holds now (the unified memory a Mac shares, which other programs take too)."""
        return int(free_memory_bytes() * KV_MEMORY_SHARE) // self._config.kv_bytes_per_token(self.dtype.size)

    # -- contract -------------------------------------------------------------------

    def prepare(self, cache_id: str, max_tokens: int) -> None:
        self.kv.prepare(cache_id, min(max(1, max_tokens), self._capacity))
        warm = min(8, self._capacity - 1)
        if warm >= 1:
            logits = self.prefill(WARMUP_ID, [0] * warm)
            logits = self.decode(WARMUP_ID, mx.argmax(logits), warm)
            mx.eval(logits)
        self.release(WARMUP_ID)
        attention = next(block.attn for block in self.model.layers if block.attn is not None)
        self.ops.warm_up(attention, self.dtype)  # the batched decode's, on CUDA

    def reset(self) -> None:
        self.state.reset()
        mx.clear_cache()

    def sampler(self, params, context: Sequence[int] = ()):
        from ferrum_mac.backends.mlx.sampling import MlxSampler

        return MlxSampler(params, context, self._config.vocab_size)

    # -- the forward (PooledLLM keeps the bookkeeping around it) ------------------------

    def _token_ids(self, tokens) -> mx.array:
        return as_token_array(tokens, self._config.vocab_size)

    def _hidden(
        self,
        token_parts: list[mx.array],
        segments: list[Segment],
        windowed: list | None = None,
        recurrent: list | None = None,
    ) -> mx.array:
        tokens = token_parts[0] if len(token_parts) == 1 else mx.concatenate(token_parts)
        plan = self.ops.plan(segments)
        if windowed is not None:  # the windowed layers' pool, attended by MLX's own ops
            plan.windowed = Plan(windowed)
        plan.recurrent = recurrent
        return self.model.hidden(tokens, plan)

    def _logits_at(self, h: mx.array, rows) -> mx.array:
        if rows == slice(None):
            return self.model.logits(h)[0]
        return self.model.logits(h[:, mx.array(rows) if isinstance(rows, list) else rows, :])[0]

    def _decode_batch(self, items: Sequence[DecodeItem]) -> mx.array:
        return self._logits_at(self._forward([(it.cache_id, it.token, it.pos) for it in items]), slice(None))

    def _after_chunk(self) -> None:
        recurrent = self._state.recurrent
        mx.eval(
            self.kv.arrays(), recurrent.arrays() if recurrent else []
        )  # the chunk's work, before the next one queues more


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
