"""The KV manager: a pool of cache slots, one `(layers, 2, slots, kv_heads, tokens + 1,
head_dim)` buffer holding every sequence's keys and values, with a slot for each `cache_id`.

Writes are in place. The pool grows in steps of `GROW_STEP` tokens (unless `prepare` sized it
up front) and doubles its slots when every one is taken; each reallocation bumps `version`,
so a CUDA graph captured over the old buffer is never replayed over the new one. A released
sequence's slot goes back to a free list, lowest slot first, so the sequences decoding
together sit in neighbouring slots: a batched decode over a run of slots reads their keys
as one view and writes them with one kernel.

The extra last token column is scratch: a decode step writes the rows of slots it does not
serve there, so it never touches a sequence outside its batch.
"""

from __future__ import annotations

import torch

GROW_STEP = 256


class SequenceCache:
    """One sequence's slot in the pool and how many tokens it holds."""

    def __init__(self, pool: "KvManager", slot: int):
        self.pool, self.slot, self.length = pool, slot, 0

    @property
    def allocated(self) -> int:
        return self.pool.tokens

    def keys(self, layer: int) -> torch.Tensor:
        """`(kv_heads, tokens + 1, head_dim)`, a view into the pool."""
        return self.pool.kv[layer, 0, self.slot]

    def values(self, layer: int) -> torch.Tensor:
        return self.pool.kv[layer, 1, self.slot]


class KvManager:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.capacity = dtype, device, capacity
        self.kv: torch.Tensor | None = None
        self.slots = 0  # slots the pool holds
        self.tokens = 0  # tokens each slot can hold (the scratch column not counted)
        self.version = 0  # bumped on every reallocation
        self.caches: dict[str, SequenceCache] = {}
        self.free: list[int] = []  # kept sorted high to low: pop() takes the lowest

    def get(self, cache_id: str) -> SequenceCache | None:
        return self.caches.get(cache_id)

    def length(self, cache_id: str) -> int:
        cache = self.caches.get(cache_id)
        return cache.length if cache else 0

    def acquire(self, cache_id: str) -> SequenceCache:
        cache = self.caches.get(cache_id)
        if cache is None:
            if not self.free:
                self._grow(max(1, 2 * self.slots), max(self.tokens, min(self.capacity, GROW_STEP)))
            cache = self.caches[cache_id] = SequenceCache(self, self.free.pop())
            cache.length = 0
        return cache

    def reserve(self, cache: SequenceCache, tokens: int) -> None:
        """Make every slot hold at least `tokens` (rounded up to the grow step, at most capacity)."""
        if tokens > self.tokens:
            self._grow(self.slots, min(self.capacity, -(-tokens // GROW_STEP) * GROW_STEP))

    def _grow(self, slots: int, tokens: int) -> None:
        # zeros, not empty: masked-out slots still enter the attention product, and 0 * NaN is NaN
        fresh = torch.zeros(
            (self.num_layers, 2, slots, self.kv_heads, tokens + 1, self.head_dim), dtype=self.dtype, device=self.device
        )
        if self.kv is not None and self.slots and self.tokens:
            fresh[:, :, : self.slots, :, : self.tokens] = self.kv[:, :, :, :, : self.tokens]
        self.kv = fresh
        self.free = sorted(set(self.free) | set(range(self.slots, slots)), reverse=True)
        self.slots, self.tokens = slots, tokens
        self.version += 1

    def truncate(self, cache_id: str, new_len: int) -> None:
        cache = self.caches.get(cache_id)
        if cache is not None:
            cache.length = min(cache.length, new_len)

    def release(self, cache_id: str) -> None:
        cache = self.caches.pop(cache_id, None)
        if cache is not None:
            cache.length = 0
            self.free = sorted(self.free + [cache.slot], reverse=True)

    def reset(self) -> None:
        self.caches.clear()
        self.kv = None
        self.slots = self.tokens = 0
        self.free = []
        self.version += 1
