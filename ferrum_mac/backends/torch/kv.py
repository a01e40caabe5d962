"""The KV manager: a pool of cache slots, one `(layers, 2, slots, kv_heads, tokens + 1,
head_dim)` buffer holding every sequence's keys and values, with a slot for each `cache_id`
(the bookkeeping is `SlotPool`'s).

Writes are in place. The pool grows in steps of `GROW_STEP` tokens (unless `prepare` sized it
up front) and doubles its slots when every one is taken; each reallocation bumps `version`,
so a CUDA graph captured over the old buffer is never replayed over the new one. Sequences
decoding together sit in neighbouring slots, so a batched decode over a run of slots reads
their keys as one view and writes them with one kernel.

The extra last token column is scratch: a decode step writes the rows of slots it does not
serve there, so it never touches a sequence outside its batch.
"""

from __future__ import annotations

import torch

from ferrum_mac.backends.slot_pool import GROW_STEP, Slot, SlotPool

__all__ = ["GROW_STEP", "KvManager", "SequenceCache"]


class SequenceCache(Slot):
    @property
    def allocated(self) -> int:
        return self.pool.tokens

    def keys(self, layer: int) -> torch.Tensor:
        """`(kv_heads, tokens + 1, head_dim)`, a view into the pool."""
        return self.pool.kv[layer, 0, self.slot]

    def values(self, layer: int) -> torch.Tensor:
        return self.pool.kv[layer, 1, self.slot]


class KvManager(SlotPool):
    slot_type = SequenceCache

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int):
        super().__init__(capacity)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.kv: torch.Tensor | None = None
        self.version = 0  # bumped on every reallocation

    def _resize(self, slots: int, tokens: int) -> None:
        # zeros, not empty: masked-out slots still enter the attention product, and 0 * NaN is NaN
        fresh = torch.zeros(
            (self.num_layers, 2, slots, self.kv_heads, tokens + 1, self.head_dim), dtype=self.dtype, device=self.device
        )
        if self.kv is not None and self.slots and self.tokens:
            fresh[:, :, : self.slots, :, : self.tokens] = self.kv[:, :, :, :, : self.tokens]
        self.kv = fresh
        self.version += 1

    def _drop(self) -> None:
        self.kv = None
        self.version += 1
