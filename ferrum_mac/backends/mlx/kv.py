"""The KV manager: a pool of cache slots, one `(slots, kv_heads, tokens, head_dim)` key
buffer and one value buffer per layer, with a slot for each `cache_id` (the bookkeeping is
`SlotPool`'s).

Writes are in-place slice updates. The pool grows in steps of `GROW_STEP` tokens (unless
`prepare` sized it up front) and doubles its slots when every one is taken; a released
sequence's slot goes back to a free list that new sequences take first. Keeping every
sequence in one buffer lets a batched decode write and attend all of them with one
operation each, instead of one per sequence.
"""

from __future__ import annotations

import mlx.core as mx

from ferrum_mac.backends.slot_pool import GROW_STEP, Slot, SlotPool

__all__ = ["GROW_STEP", "KvManager", "SequenceCache"]


class SequenceCache(Slot):
    def write(self, layer: int, k: mx.array, v: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Store k/v `(1, kv_heads, n, head_dim)` at `offset`; return every cached key/value up to them."""
        end, s = offset + k.shape[2], self.slot
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys[s : s + 1, :, offset:end, :] = k
        values[s : s + 1, :, offset:end, :] = v
        return keys[s : s + 1, :, :end, :], values[s : s + 1, :, :end, :]


class KvManager(SlotPool):
    slot_type = SequenceCache

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, capacity: int):
        super().__init__(capacity)
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.heads = mx.arange(kv_heads)
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers

    def _resize(self, slots: int, tokens: int) -> None:
        shape = (slots, self.kv_heads, tokens, self.head_dim)
        for buffers in (self.keys, self.values):
            for layer, old in enumerate(buffers):
                fresh = mx.zeros(shape, dtype=self.dtype)
                if old is not None and self.slots and self.tokens:
                    fresh[: self.slots, :, : self.tokens, :] = old
                buffers[layer] = fresh
        mx.eval(self.arrays())

    def batch_index(self, slots: mx.array, offsets: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Where a batched write puts sequence b's key: slot `slots[b]`, every head, token
        `offsets[b]` (indices broadcasting to `(B, kv_heads)`)."""
        return slots[:, None], self.heads[None, :], offsets[:, None]

    def write_batch(self, layer: int, index: tuple, k: mx.array, v: mx.array):
        """One new key/value `(B, kv_heads, head_dim)` per sequence at `index` (`batch_index`);
        returns the layer's whole key and value pools."""
        keys, values = self.keys[layer], self.values[layer]
        keys[index] = k
        values[index] = v
        return keys, values

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]

    def _drop(self) -> None:
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
