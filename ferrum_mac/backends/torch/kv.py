"""The KV manager: the torch buffers of a `BlockPool`, one `(2, kv_heads, blocks * B, head_dim)`
buffer per layer (keys, values; B = `block_tokens`). Block `b` is the token rows
`b * B .. b * B + B - 1` of the long token axis, so a sequence's keys are the rows its block
table names (`SequenceBlocks.places`), and one slice of the axis where its blocks follow each
other (`first_row_if_contiguous`). Block 0 is scratch: a decode step sends the rows it does not
serve there.

Writes are in place. The pool grows and shrinks as `BlockPool` says; a reallocation goes
layer by layer, so it holds the old and the new buffers at once only for one layer, and bumps
`version`, so a CUDA graph captured over the old buffers is never replayed over the new ones.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS, BlockPool, SequenceBlocks

__all__ = ["BLOCK_TOKENS", "KvManager", "SequenceBlocks"]

# Freed buffers go back to the device only from this size on: handing memory back waits for
# the device (cudaFree), and a pool that shrinks by less is soon allocated again (the next
# prompt), which PyTorch's allocator then serves from what it kept.
GIVE_BACK_BYTES = 1 << 30


def host_ids(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ids (int64) to copy to `device` with `non_blocking=True`: in pinned memory for CUDA,
    as a copy from pageable memory would wait for the work queued there."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory() if device.type == "cuda" else host


class KvManager(BlockPool):
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int,
        max_blocks: int | None = None,
        cache_blocks: int = 0,
        disk=None,
        layers: Sequence[int] | None = None,
    ):
        """`layers`: the layers whose keys and values it holds (default: all `num_layers`;
        a model with sliding windows has a pool for them and one for the rest); the others'
        buffers are empty."""
        super().__init__(capacity, max_blocks, cache_blocks, disk)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.layers = set(range(num_layers) if layers is None else layers)
        self.dtype, self.device = dtype, device
        self.kv: list[torch.Tensor] = []  # one buffer per layer; empty when nothing is allocated
        self.version = 0  # bumped on every reallocation

    @property
    def token_rows(self) -> int:
        """Rows of a layer's token axis (per kv head): every block's."""
        return self.blocks * self.block_tokens

    def rows_of(self, blocks: list[int]) -> torch.Tensor | slice:
        """The token rows of `blocks`, in order: a slice when they follow each other."""
        B = self.block_tokens
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            return slice(blocks[0] * B, (blocks[-1] + 1) * B)
        table = host_ids(blocks, self.device).to(self.device, non_blocking=True)
        return (table[:, None] * B + torch.arange(B, device=self.device)).flatten()

    # -- BlockPool's hooks ------------------------------------------------------------

    def _resize(self, blocks: int, keep: list[int]) -> None:
        kept = self.rows_of(keep) if keep else None
        freed = self._bytes() * (self.blocks - blocks) // max(1, self.blocks)
        old = self.kv
        self.kv = []
        for layer in range(self.num_layers):
            if layer not in self.layers:
                self.kv.append(torch.empty(0, dtype=self.dtype, device=self.device))
                continue
            # zeros, not empty: masked-out keys still enter the attention product, and 0 * NaN is NaN
            fresh = torch.zeros(
                (2, self.kv_heads, blocks * self.block_tokens, self.head_dim), dtype=self.dtype, device=self.device
            )
            if old:
                if kept is not None:
                    fresh[:, :, : len(keep) * self.block_tokens] = old[layer][:, :, kept]
                old[layer] = None  # freed before the next layer's buffer is allocated
            self.kv.append(fresh)
        self.version += 1
        self._give_back(freed)

    def _copy_block(self, src: int, dst: int, tokens: int) -> None:
        B = self.block_tokens
        for kv in self.kv:
            if kv.numel():
                kv[:, :, dst * B : dst * B + tokens] = kv[:, :, src * B : src * B + tokens]

    def _drop(self) -> None:
        freed = self._bytes()
        self.kv = []
        self.version += 1
        self._give_back(freed)

    def _read_blocks(self, blocks: list[int]) -> np.ndarray:
        """`(layers, 2, kv_heads, len(blocks) * B, head_dim)` on the host; bfloat16 as its
        uint16 bits (numpy has no bfloat16)."""
        rows = self.rows_of(blocks)
        host = torch.stack([kv[:, :, rows] for kv in self.kv]).cpu()
        if self.dtype == torch.bfloat16:
            return host.view(torch.int16).numpy().view(np.uint16)
        return host.numpy()

    def _write_blocks(self, blocks: list[int], array: np.ndarray) -> None:
        """The inverse of `_read_blocks`."""
        array = np.ascontiguousarray(array)
        if self.dtype == torch.bfloat16:
            host = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            host = torch.from_numpy(array)
        rows = self.rows_of(blocks)
        for kv, layer in zip(self.kv, host.to(self.device, self.dtype)):
            kv[:, :, rows] = layer

    def _bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv in self.kv)

    def _give_back(self, freed: int) -> None:
        """Hand `freed` bytes of buffers back to the device when they are many (PyTorch's
        allocator keeps them otherwise)."""
        if self.device.type == "cuda" and freed >= GIVE_BACK_BYTES:
            torch.cuda.empty_cache()
