"""The KV manager: a pool of cache slots, one `(slots, kv_heads, tokens, head_dim)` key
buffer and one value buffer per layer, with a slot for each `cache_id` (the bookkeeping is
`SlotPool`'s).

Writes are in-place slice updates. The pool grows and shrinks as `SlotPool` says; a
reallocation goes layer by layer, each new buffer computed and the old one freed (MLX's
buffer cache cleared) before the next, so it holds the old and the new pool at once only
for one layer. Keeping every sequence in one buffer lets a batched decode write and
attend all of them with one operation each, instead of one per sequence.
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

    def _resize(self, slots: int, tokens: int, keep: list[int]) -> None:
        shape = (slots, self.kv_heads, tokens, self.head_dim)
        n, copied = len(keep), min(tokens, self.tokens)
        rows = slice(0, n) if keep == list(range(n)) else mx.array(keep)
        for buffers in (self.keys, self.values):
            for layer in range(self.num_layers):
                fresh = mx.zeros(shape, dtype=self.dtype)
                old = buffers[layer]
                if old is not None and n and copied:
                    fresh[:n, :, :copied, :] = old[rows, :, :copied, :]
                mx.eval(fresh)
                buffers[layer] = fresh
                del old
                mx.clear_cache()  # MLX keeps freed buffers for reuse; the old layer's must go now

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
        mx.clear_cache()
