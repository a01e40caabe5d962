"""The bookkeeping both backends' KV pools share: which slot each `cache_id` holds and how
many tokens it has, which slots are free, and when the pool must grow.

Slots double when every one is taken; each slot's token room grows in steps of `GROW_STEP`
(at most the capacity). Free slots are handed out lowest first, so the sequences decoding
together sit in neighbouring slots. A backend's pool subclasses `SlotPool` and owns the
buffers: `_resize(slots, tokens)` reallocates them (keeping what they hold), `_drop()` frees them.
"""

from __future__ import annotations

GROW_STEP = 256


class Slot:
    """One sequence's slot in a pool and how many tokens it holds."""

    def __init__(self, pool: "SlotPool", slot: int):
        self.pool, self.slot, self.length = pool, slot, 0


class SlotPool:
    slot_type = Slot

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slots = 0  # slots the buffers hold
        self.tokens = 0  # tokens each slot can hold
        self.caches: dict[str, Slot] = {}
        self.free: list[int] = []  # kept high to low: pop() takes the lowest

    def get(self, cache_id: str) -> Slot | None:
        return self.caches.get(cache_id)

    def length(self, cache_id: str) -> int:
        cache = self.caches.get(cache_id)
        return cache.length if cache else 0

    def acquire(self, cache_id: str) -> Slot:
        cache = self.caches.get(cache_id)
        if cache is None:
            if not self.free:
                self._grow(max(1, 2 * self.slots), self.tokens)
            cache = self.caches[cache_id] = self.slot_type(self, self.free.pop())
        return cache

    def reserve(self, cache: Slot, tokens: int) -> None:
        """Make every slot hold at least `tokens` (rounded up to the grow step, at most capacity)."""
        if tokens > self.tokens:
            self._grow(self.slots, min(self.capacity, -(-tokens // GROW_STEP) * GROW_STEP))

    def truncate(self, cache_id: str, new_len: int) -> None:
        cache = self.caches.get(cache_id)
        if cache is not None:
            cache.length = min(cache.length, new_len)

    def release(self, cache_id: str) -> None:
        cache = self.caches.pop(cache_id, None)
        if cache is not None:
            self.free = sorted(self.free + [cache.slot], reverse=True)

    def reset(self) -> None:
        self.caches.clear()
        self.free = []
        self.slots = self.tokens = 0
        self._drop()

    def _grow(self, slots: int, tokens: int) -> None:
        self._resize(slots, tokens)
        self.free = sorted(set(self.free) | set(range(self.slots, slots)), reverse=True)
        self.slots, self.tokens = slots, tokens

    def _resize(self, slots: int, tokens: int) -> None:
        raise NotImplementedError

    def _drop(self) -> None:
        raise NotImplementedError
