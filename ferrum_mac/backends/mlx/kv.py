"""The KV manager: one preallocated key/value buffer pair per layer for each `cache_id`.

Buffers are `(1, kv_heads, allocated, head_dim)`; writes are in-place slice updates.
A cache grows in steps of `GROW_STEP` tokens unless `prepare` sized it up front, and
released caches go to a free pool that new sequences take from before allocating.
"""

from __future__ import annotations

import mlx.core as mx

GROW_STEP = 256


class SequenceCache:
    def __init__(self, num_layers: int):
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.length = 0  # tokens held
        self.allocated = 0  # tokens the buffers can hold

    def write(self, layer: int, k: mx.array, v: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Store k/v `(1, kv_heads, n, head_dim)` at `offset`; return every cached key/value up to them."""
        end = offset + k.shape[2]
        self.keys[layer][..., offset:end, :] = k
        self.values[layer][..., offset:end, :] = v
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]


class KvManager:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, capacity: int):
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.capacity = capacity
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
            cache = self.free.pop() if self.free else SequenceCache(self.num_layers)
            cache.length = 0
            self.caches[cache_id] = cache
        return cache

    def reserve(self, cache: SequenceCache, tokens: int) -> None:
        """Make the buffers hold at least `tokens` (rounded up to the grow step, at most capacity)."""
        if tokens <= cache.allocated:
            return
        size = min(self.capacity, -(-tokens // GROW_STEP) * GROW_STEP)
        shape = (1, self.kv_heads, size, self.head_dim)
        for layer in range(self.num_layers):
            for buffers in (cache.keys, cache.values):
                fresh = mx.zeros(shape, dtype=self.dtype)
                old = buffers[layer]
                if old is not None and cache.length:
                    fresh[..., : cache.length, :] = old[..., : cache.length, :]
                buffers[layer] = fresh
        cache.allocated = size
        mx.eval(cache.arrays())

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

    def bytes_in_use(self) -> int:
        per_token = 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.size
        return sum(c.allocated for c in self.caches.values()) * per_token
