"""The KV manager: MLX buffers for `BlockPool`'s blocks. Per layer one key buffer and one
value buffer `(1, kv_heads, blocks * BLOCK_TOKENS + SPARE_ROWS, head_dim)`: block `b` is the token rows
`b * BLOCK_TOKENS ...` of one long token axis (the leading 1 lets a segment's
`(1, kv_heads, n, head_dim)` keys go in and come out with no reshape node).

A sequence whose blocks are consecutive (the usual case for one sequence) is written with a
slice update and read as one slice of the token axis, as a dense cache would be; otherwise
its rows are scattered and gathered through its block table (`SequenceBlocks.places`).

A reallocation goes layer by layer, each new buffer computed and the old one freed (MLX's
buffer cache cleared) before the next, so it holds the old and the new buffers at once only
for one layer. Keeping every sequence in one buffer lets a batched decode write and attend
all of them with one operation each, instead of one per sequence.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS, BlockPool, SequenceBlocks

__all__ = ["BLOCK_TOKENS", "KvManager", "SequenceCache"]

# Rows past the last block's, never written or read. MLX CUDA (0.32) attends one query over a
# slice of 256 keys or more with cuDNN when the slice's buffer has a multiple of 256 rows,
# taking it for mlx-lm's cache and reading from the buffer's row 0 (`unslice_kv`), while a
# sequence's rows start later (block 0 is scratch). With these no buffer is such a multiple,
# and MLX's vector kernel reads a sequence's keys in place, where they lie.
SPARE_ROWS = 8


class SequenceCache(SequenceBlocks):
    def rows(self, start: int, end: int) -> slice | mx.array:
        """The token rows of positions `start .. end - 1`: a slice where they lie in
        consecutive blocks, else an index array (scattered writes, gathered reads). A
        segment asks once, for every layer."""
        first = self.first_row_if_consecutive(start, end)
        return slice(first, first + end - start) if first is not None else self.places_array(start, end)

    def places_array(self, start: int, end: int) -> mx.array:
        """`places(start, end)` as an array, built in numpy from the block table (a long
        sequence has many rows, too many for a Python int each on every step)."""
        B = self.pool.block_tokens
        table = np.array(self.blocks[start // B : -(-end // B)], dtype=np.int32)
        rows = (table[:, None] * B + np.arange(B, dtype=np.int32)).reshape(-1)
        return mx.array(rows[start % B : start % B + end - start])

    def table(self, end: int) -> mx.array:
        """The block table of positions `0 .. end - 1`, `(1, blocks)` (a batch of one)."""
        return mx.array(np.array(self.blocks[: -(-end // self.pool.block_tokens)], dtype=np.int32)[None])

    def first_row_if_consecutive(self, start: int, end: int) -> int | None:
        """The token row of position `start` when positions `start .. end - 1` lie in
        consecutive blocks (one slice of the token axis), else None."""
        B = self.pool.block_tokens
        blocks = self.blocks[start // B : -(-end // B)]
        if any(b - a != 1 for a, b in zip(blocks, blocks[1:])):
            return None
        return blocks[0] * B + start % B

    def write(self, layer: int, k: mx.array, v: mx.array, write: slice | mx.array, read: slice | mx.array):
        """Store k/v `(1, kv_heads, n, head_dim)` at the token rows `write`; return every
        cached key/value up to them, the rows `read` `(1, kv_heads, end, head_dim)`."""
        keys, values = self.store(layer, k, v, write)
        return keys[:, :, read, :], values[:, :, read, :]

    def store(self, layer: int, k: mx.array, v: mx.array, write: slice | mx.array) -> tuple[mx.array, mx.array]:
        """Store k/v `(1, kv_heads, n, head_dim)` at the token rows `write`; returns the layer's
        whole key and value buffers."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys[:, :, write, :] = k
        values[:, :, write, :] = v
        return keys, values


class KvManager(BlockPool):
    sequence_type = SequenceCache

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        capacity: int,
        max_blocks: int | None = None,
        cache_blocks: int = 0,
        disk=None,
        layers: Sequence[int] | None = None,
    ):
        """`layers`: the layers whose keys and values it holds (default: all `num_layers`;
        a model with sliding windows has a pool for them and one for the rest)."""
        super().__init__(capacity, max_blocks, cache_blocks, disk)
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.layers = list(range(num_layers) if layers is None else layers)
        self.heads = mx.arange(kv_heads)
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers

    # -- BlockPool's hooks --------------------------------------------------------------

    def _resize(self, blocks: int, keep: list[int]) -> None:
        B = self.block_tokens
        shape = (1, self.kv_heads, blocks * B + SPARE_ROWS, self.head_dim)
        kept = len(keep) * B
        rows = slice(0, kept) if keep == list(range(len(keep))) else mx.array(self.rows_of(keep))
        for buffers in (self.keys, self.values):
            for layer in self.layers:
                fresh = mx.zeros(shape, dtype=self.dtype)
                old = buffers[layer]
                if old is not None and kept:
                    fresh[:, :, :kept, :] = old[:, :, rows, :]
                mx.eval(fresh)
                buffers[layer] = fresh
                del old
                mx.clear_cache()  # MLX keeps freed buffers for reuse; the old layer's must go now

    def _copy_block(self, src: int, dst: int, tokens: int) -> None:
        B = self.block_tokens
        for buffers in (self.keys, self.values):
            for buffer in (b for b in buffers if b is not None):
                buffer[:, :, dst * B : dst * B + tokens, :] = buffer[:, :, src * B : src * B + tokens, :]

    def _drop(self) -> None:
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        mx.clear_cache()

    def _read_blocks(self, blocks: list[int]) -> np.ndarray:
        """`(layers, 2, kv_heads, len(blocks) * BLOCK_TOKENS, head_dim)`; bfloat16 as its uint16
        bits (numpy has no bfloat16)."""
        rows = mx.array(self.rows_of(blocks))
        layers = [
            mx.stack([mx.take(k[0], rows, axis=1), mx.take(v[0], rows, axis=1)]) for k, v in zip(self.keys, self.values)
        ]
        array = mx.stack(layers)
        return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)

    def _write_blocks(self, blocks: list[int], array: np.ndarray) -> None:
        """The inverse of `_read_blocks`."""
        data = mx.array(array)
        if self.dtype == mx.bfloat16:
            data = data.view(mx.bfloat16)
        data = data.astype(self.dtype)
        rows = mx.array(self.rows_of(blocks))
        for layer in range(self.num_layers):
            self.keys[layer][:, :, rows, :] = data[layer, 0][None]
            self.values[layer][:, :, rows, :] = data[layer, 1][None]
        mx.eval(self.arrays())

    # -- for attention ---------------------------------------------------------------

    def rows_of(self, blocks: list[int]) -> list[int]:
        """The token rows of `blocks`, in order."""
        B = self.block_tokens
        return [b * B + r for b in blocks for r in range(B)]

    def batch_index(self, rows: mx.array) -> tuple:
        """Where a batched write puts sequence b's key: token row `rows[b]`, every head
        (indices broadcasting to `(B, kv_heads)`)."""
        return 0, self.heads[None, :], rows[:, None]

    def gather_index(self, tables: np.ndarray) -> tuple:
        """Indices reading `(B, kv_heads, blocks * BLOCK_TOKENS, head_dim)` keys through
        block tables `(B, blocks)` (one gather, shared by every layer)."""
        B = self.block_tokens
        rows = (tables[:, :, None] * B + np.arange(B)).reshape(tables.shape[0], -1)
        return 0, self.heads[None, :, None], mx.array(rows)[:, None, :]

    def write_batch(self, layer: int, index: tuple, k: mx.array, v: mx.array):
        """One new key/value `(B, kv_heads, head_dim)` per sequence at `index` (`batch_index`);
        returns the layer's whole key and value buffers."""
        keys, values = self.keys[layer], self.values[layer]
        keys[index] = k
        values[index] = v
        return keys, values

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]
