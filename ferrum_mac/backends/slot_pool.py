"""The bookkeeping both backends' KV pools share: which slot each `cache_id` holds and how
many tokens it has, which slots are free, and the shape of the buffers (`slots` x `tokens`).

The buffers are a rectangle: every slot has the same token room, so a batched decode can
read and write a run of neighbouring slots as one view. The rectangle follows the live
sequences both ways:

- it grows when a sequence needs it: slots double when every one is taken (staying a power
  of two, which the torch decode steps' runs of slots rely on) and the token room grows in
  steps of `GROW_STEP` (at most the capacity);
- it shrinks when sequences are released: to the fewest slots (a power of two) that hold
  the live sequences and the token room the longest of them needs, but only when that at
  least halves what is allocated, so a pool that hovers around one size does not reallocate
  back and forth. A pool with no sequence goes back to its idle shape, the one the last
  `prepare` asked for (nothing, if none did).

Free slots are handed out lowest first, and a shrink moves the live sequences down to the
lowest slots (keeping their order), so the sequences decoding together stay packed low.

`allocated_tokens` and `used_tokens` say what the buffers hold against what the sequences
fill; `allocation_for` what they would hold with sequences of given lengths, which is what
admission must budget for. The prefix cache will replace slots with fixed-size blocks; these
three keep their meaning there (tokens in blocks held, tokens cached, blocks a set of
lengths takes) and callers need not change.

A backend's pool subclasses `SlotPool` and owns the buffers: `_resize(slots, tokens, keep)`
reallocates them (new slot `i` takes old slot `keep[i]`'s first tokens), `_drop()` frees them.
"""

from __future__ import annotations

from typing import Sequence

GROW_STEP = 256


class Slot:
    """One sequence's slot in a pool and how many tokens it holds."""

    def __init__(self, pool: "SlotPool", slot: int):
        self.pool, self.slot, self.length = pool, slot, 0


def power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


class SlotPool:
    slot_type = Slot

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slots = 0  # slots the buffers hold
        self.tokens = 0  # tokens each slot can hold
        self.idle = (0, 0)  # (slots, tokens) kept when no sequence is live: set by `prepare`
        self.caches: dict[str, Slot] = {}
        self.free: list[int] = []  # kept high to low: pop() takes the lowest

    # -- accounting -------------------------------------------------------------------

    @property
    def allocated_tokens(self) -> int:
        """Token positions the buffers hold, used or not."""
        return self.slots * self.tokens

    @property
    def used_tokens(self) -> int:
        """Tokens the live sequences have cached."""
        return sum(cache.length for cache in self.caches.values())

    def room_for(self, tokens: int) -> int:
        """The token room a sequence of `tokens` makes the pool allocate: the grow step's next multiple, at most the capacity."""
        return min(self.capacity, -(-tokens // GROW_STEP) * GROW_STEP)

    def allocation_for(self, lengths: Sequence[int]) -> int:
        """Tokens the buffers would hold with sequences of `lengths` live at once (never less
        than they hold now: a pool only shrinks when a sequence is released)."""
        if not lengths:
            return self.allocated_tokens
        slots = max(self.slots, power_of_two_at_least(len(lengths)))
        return slots * max(self.tokens, self.room_for(max(lengths)))

    # -- sequences --------------------------------------------------------------------

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
            self._grow(self.slots, self.room_for(tokens))

    def prepare(self, cache_id: str, tokens: int) -> Slot:
        """Acquire `cache_id` with room for `tokens`, and keep a slot of that room when the pool is idle."""
        cache = self.acquire(cache_id)
        self.reserve(cache, tokens)
        self.idle = (1, self.room_for(tokens))
        return cache

    def truncate(self, cache_id: str, new_len: int) -> None:
        cache = self.caches.get(cache_id)
        if cache is not None:
            cache.length = min(cache.length, new_len)

    def release(self, cache_id: str) -> None:
        cache = self.caches.pop(cache_id, None)
        if cache is not None:
            self.free = sorted(self.free + [cache.slot], reverse=True)
            self._shrink_to_fit()

    def reset(self) -> None:
        self.caches.clear()
        self.free = []
        self.slots = self.tokens = 0
        self._drop()

    # -- the buffers' shape -----------------------------------------------------------

    def _fitting_shape(self) -> tuple[int, int]:
        """The smallest (slots, tokens) holding every live sequence and room for its next
        token, the idle shape at least, the current shape at most (a release never grows)."""
        if not self.caches:
            slots, tokens = self.idle
        else:
            slots = max(self.idle[0], power_of_two_at_least(len(self.caches)))
            longest = max(cache.length for cache in self.caches.values())
            tokens = max(self.idle[1], self.room_for(longest + 1))
        return min(slots, self.slots), min(tokens, self.tokens)

    def _shrink_to_fit(self) -> None:
        slots, tokens = self._fitting_shape()
        if (slots, tokens) == (self.slots, self.tokens):
            return
        if self.caches and self.allocated_tokens <= 2 * slots * tokens:
            return  # too small a saving to pay a copy for (and to reallocate again soon)
        if slots == 0 or tokens == 0:
            self.slots = self.tokens = 0
            self.free = []
            self._drop()
            return
        live = sorted(self.caches.values(), key=lambda cache: cache.slot)
        self._resize(slots, tokens, [cache.slot for cache in live])
        for new_slot, cache in enumerate(live):
            cache.slot = new_slot
        self.free = list(range(slots - 1, len(live) - 1, -1))
        self.slots, self.tokens = slots, tokens

    def _grow(self, slots: int, tokens: int) -> None:
        self._resize(slots, tokens, list(range(self.slots)))
        self.free = sorted(set(self.free) | set(range(self.slots, slots)), reverse=True)
        self.slots, self.tokens = slots, tokens

    def _resize(self, slots: int, tokens: int, keep: list[int]) -> None:
        """Reallocate the buffers as `slots` x `tokens`; new slot `i` takes the first
        `min(tokens, self.tokens)` tokens of old slot `keep[i]`."""
        raise NotImplementedError

    def _drop(self) -> None:
        raise NotImplementedError
