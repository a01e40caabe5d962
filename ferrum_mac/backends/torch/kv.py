"""The KV manager: a pool of cache slots, one `(2, slots, kv_heads, tokens + 1, head_dim)`
buffer per layer holding every sequence's keys and values, with a slot for each `cache_id`
(the bookkeeping is `SlotPool`'s).

Writes are in place. The pool grows and shrinks as `SlotPool` says; a reallocation goes
layer by layer, so it holds the old and the new pool at once only for one layer, and bumps
`version`, so a CUDA graph captured over the old buffers is never replayed over the new
ones. Sequences decoding together sit in neighbouring slots, so a batched decode over a run
of slots reads their keys as one view and writes them with one kernel.

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
        return self.pool.kv[layer][0, self.slot]

    def values(self, layer: int) -> torch.Tensor:
        return self.pool.kv[layer][1, self.slot]


class KvManager(SlotPool):
    slot_type = SequenceCache

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int
    ):
        super().__init__(capacity)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.kv: list[torch.Tensor] = []  # one buffer per layer; empty when nothing is allocated
        self.version = 0  # bumped on every reallocation

    def _resize(self, slots: int, tokens: int, keep: list[int]) -> None:
        n, copied = len(keep), min(tokens, self.tokens)
        rows = slice(0, n) if keep == list(range(n)) else torch.tensor(keep, device=self.device)
        shrinking = slots * tokens < self.slots * self.tokens
        old = self.kv
        self.kv = []
        for layer in range(self.num_layers):
            # zeros, not empty: masked-out slots still enter the attention product, and 0 * NaN is NaN
            fresh = torch.zeros(
                (2, slots, self.kv_heads, tokens + 1, self.head_dim), dtype=self.dtype, device=self.device
            )
            if old:
                if n and copied:
                    fresh[:, :n, :, :copied] = old[layer][:, rows, :, :copied]
                old[layer] = None  # freed before the next layer's buffer is allocated
            self.kv.append(fresh)
        self.version += 1
        if shrinking:
            self._give_back()

    def _drop(self) -> None:
        self.kv = []
        self.version += 1
        self._give_back()

    def _give_back(self) -> None:
        """Hand freed buffers back to the device (PyTorch's allocator keeps them otherwise)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
