"""The KV manager: one static, preallocated key/value buffer per `cache_id`.

A sequence's buffer is `(layers, 2, kv_heads, allocated, head_dim)`: keys and values of
every layer in one allocation, written in place. It grows in steps of `GROW_STEP` tokens
unless `prepare` sized it up front; every reallocation bumps `version`, so a CUDA graph
captured over the old buffer is never replayed over the new one. Released caches go to a
free pool (with their graphs) that new sequences take from before allocating.
"""

from __future__ import annotations

import itertools

import torch

GROW_STEP = 256
_uids = itertools.count()


class SequenceCache:
    def __init__(self):
        self.uid = next(_uids)
        self.kv: torch.Tensor | None = None
        self.length = 0  # tokens held
        self.allocated = 0  # tokens the buffer can hold
        self.version = 0  # bumped on every reallocation

    @property
    def key(self) -> tuple[int, int]:
        """Identifies this buffer: the same key means the same memory."""
        return (self.uid, self.version)

    def keys(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]


class KvManager:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.capacity = dtype, device, capacity
        self.caches: dict[str, SequenceCache] = {}
        self.free: list[SequenceCache] = []

    def get(self, cache_id: str) -> SequenceCache | None:
        return self.caches.get(cache_id)

    def length(self, cache_id: str) -> int:
        cache = self.caches.get(cache_id)
        return cache.length if cache else 0

    def acquire(self, cache_id: str) -> SequenceCache:
        cache = self.caches.get(cache_id)
        if cache is None:
            cache = self.free.pop() if self.free else SequenceCache()
            cache.length = 0
            self.caches[cache_id] = cache
        return cache

    def reserve(self, cache: SequenceCache, tokens: int) -> None:
        """Make the buffer hold at least `tokens` (rounded up to the grow step, at most capacity)."""
        if tokens <= cache.allocated:
            return
        size = min(self.capacity, -(-tokens // GROW_STEP) * GROW_STEP)
        # zeros, not empty: masked-out slots still enter the attention product, and 0 * NaN is NaN
        fresh = torch.zeros(
            (self.num_layers, 2, self.kv_heads, size, self.head_dim), dtype=self.dtype, device=self.device
        )
        if cache.kv is not None and cache.length:
            fresh[:, :, :, : cache.length] = cache.kv[:, :, :, : cache.length]
        cache.kv, cache.allocated = fresh, size
        cache.version += 1

    def truncate(self, cache_id: str, new_len: int) -> None:
        cache = self.caches.get(cache_id)
        if cache is not None:
            cache.length = min(cache.length, new_len)

    def release(self, cache_id: str) -> None:
        cache = self.caches.pop(cache_id, None)
        if cache is not None:
            cache.length = 0
            self.free.append(cache)

    def reset(self) -> None:
        self.caches.clear()
        self.free.clear()
