"""The bookkeeping both backends' KV pools share: KV in fixed-size blocks, shared by reference.

The buffers hold `blocks` blocks of `block_tokens` token positions each (per layer, keys and
values); a backend lays them out so that block `b`'s positions are the token rows
`b * block_tokens ... (b + 1) * block_tokens - 1` of one long token axis. Each sequence
(`SequenceBlocks`) holds a list of blocks, its block table: position `p` of the sequence
lives in block `blocks[p // block_tokens]`, row `p % block_tokens`. Block 0 is scratch: never
handed out, so a decode step may send the rows it does not serve there.

Blocks are counted: every sequence holding a block and the prefix cache (`prefix`, a
`PrefixCache`: `prefix_cache`) holding it count one reference each. Two sequences that start
with the same token ids share their common full blocks; a sequence writes only into blocks it
alone references, copying a shared block first (copy on write: `reserve`). Memory follows the
blocks held: when a block is needed and none is free, the prefix cache gives up its least
recently used blocks if it is over its budget or memory is full, else the buffers grow; they
shrink (moving the blocks in use down, `_renumber`) when a release leaves more than half of
them free.

A backend's pool subclasses `BlockPool` and owns the buffers:
- `_resize(blocks, keep)`: reallocate for `blocks` blocks; new block `i` takes old block
  `keep[i]` (for `i < len(keep)`); the rest zeroed;
- `_copy_block(src, dst, tokens)`: copy the first `tokens` rows of block `src` into `dst`;
- `_drop()`: free the buffers;
- `_read_blocks(blocks)` / `_write_blocks(blocks, array)`: a host copy of blocks' keys and
  values, numpy `(layers, 2, kv_heads, len(blocks) * block_tokens, head_dim)`, for the disk tier.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Sequence

from ferrum_mac.backends.state.prefix_cache import PrefixCache
from ferrum_mac.errors import FerrumError

BLOCK_TOKENS = 32  # token positions per block: the prefix cache's unit of sharing
GROW_BLOCKS = 8  # the buffers grow by at least this many blocks, and by half their size
EVICT_AT_ONCE = 32  # blocks evicted together when memory is full (each eviction sorts the leaves)
SCRATCH = 0


class SequenceBlocks:
    """One sequence's block table and how many tokens it holds."""

    def __init__(self, pool: "BlockPool", cache_id: str):
        self.pool, self.cache_id = pool, cache_id
        self.blocks: list[int] = []
        self.length = 0

    def places(self, start: int, end: int) -> list[int]:
        """The token rows (on the buffers' token axis) of positions `start .. end - 1`."""
        B, blocks = self.pool.block_tokens, self.blocks
        return [blocks[p // B] * B + p % B for p in range(start, end)]

    def first_row_if_contiguous(self, end: int) -> int | None:
        """The token row of position 0 when positions `0 .. end - 1` lie in consecutive
        blocks (read as one slice of the token axis), else None (read by `places`)."""
        n = -(-end // self.pool.block_tokens)
        blocks = self.blocks[:n]
        if not blocks or blocks[-1] - blocks[0] != n - 1 or any(b - a != 1 for a, b in zip(blocks, blocks[1:])):
            return None
        return blocks[0] * self.pool.block_tokens


class BlockPool:
    """Sequences' block tables over buffers of counted blocks, and the prefix cache over them (`prefix`)."""

    block_tokens = BLOCK_TOKENS
    sequence_type = SequenceBlocks

    def __init__(self, capacity: int, max_blocks: int | None = None, cache_blocks: int = 0, disk=None):
        """`capacity`: most tokens one sequence holds; `max_blocks`: most blocks the buffers
        may hold (what memory allows; None: no limit); `cache_blocks`: most blocks kept for
        the prefix cache that no sequence uses (0 turns the cache off); `disk`: the disk
        tier (`prefix_disk.PrefixDisk`) or None."""
        self.capacity = capacity
        self.max_blocks = max_blocks
        self.blocks = 0  # blocks the buffers hold, scratch included
        self.refs: list[int] = []  # references per block
        self.free: list[int] = []  # unreferenced blocks, a heap: the lowest is taken first
        self.idle_blocks = 0  # kept when no sequence is live: set by `prepare`
        self.caches: dict[str, SequenceBlocks] = {}
        self.prefix = PrefixCache(self, cache_blocks, disk)
        self.renumbered: list[Callable[[dict[int, int]], None]] = []  # told when blocks move (`_renumber`)

    # -- accounting -------------------------------------------------------------------

    @property
    def allocated_tokens(self) -> int:
        """Token positions the buffers hold, used or not (scratch aside)."""
        return max(0, self.blocks - 1) * self.block_tokens

    @property
    def used_tokens(self) -> int:
        """Tokens the live sequences have cached (each counted, shared or not)."""
        return sum(seq.length for seq in self.caches.values())

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def allocation_for(self, lengths: Sequence[int]) -> int:
        """Token positions sequences of `lengths` would hold at once, each in blocks of its own
        (sharing only lowers it); cached blocks no sequence uses are not counted: they go
        when memory is needed."""
        return sum(self.blocks_for(n) + 1 for n in lengths) * self.block_tokens

    # -- sequences --------------------------------------------------------------------

    def get(self, cache_id: str) -> SequenceBlocks | None:
        return self.caches.get(cache_id)

    def length(self, cache_id: str) -> int:
        seq = self.caches.get(cache_id)
        return seq.length if seq else 0

    def acquire(self, cache_id: str) -> SequenceBlocks:
        seq = self.caches.get(cache_id)
        if seq is None:
            seq = self.caches[cache_id] = self.sequence_type(self, cache_id)
        return seq

    def reserve(self, seq: SequenceBlocks, start: int, end: int) -> None:
        """Make `seq` hold blocks for positions up to `end`, those from `start` on its own
        (a shared block is copied first: copy on write), before positions `start .. end - 1`
        are written."""
        B = self.block_tokens
        for i in range(start // B, min(len(seq.blocks), self.blocks_for(end))):
            block = seq.blocks[i]
            if self.refs[block] > 1:
                fresh = self._take_block()
                kept = min(B, max(0, start - i * B))
                if kept:
                    self._copy_block(block, fresh, kept)
                self._unref(block)
                seq.blocks[i] = fresh
        self._make_room(self.blocks_for(end) - len(seq.blocks))
        while len(seq.blocks) < self.blocks_for(end):
            seq.blocks.append(self._take_block())

    def release_before(self, seq: SequenceBlocks, position: int) -> None:
        """Let go of `seq`'s blocks wholly before `position` (a sliding window's past): its
        table names the scratch block for them."""
        for i in range(min(position // self.block_tokens, len(seq.blocks))):
            if seq.blocks[i] != SCRATCH:
                self._unref(seq.blocks[i])
                seq.blocks[i] = SCRATCH

    def prepare(self, cache_id: str, tokens: int) -> SequenceBlocks:
        """Acquire `cache_id`, make the buffers hold `tokens` more positions, and keep that
        room when the pool is idle."""
        seq = self.acquire(cache_id)
        wanted = self.blocks_for(tokens)
        self.idle_blocks = max(self.idle_blocks, 1 + wanted)
        if len(self.free) < wanted:
            self._grow(self.blocks + wanted - len(self.free))
        return seq

    def truncate(self, cache_id: str, new_len: int) -> None:
        seq = self.caches.get(cache_id)
        if seq is not None and new_len < seq.length:
            seq.length = new_len
            for block in seq.blocks[self.blocks_for(new_len) :]:
                self._unref(block)
            del seq.blocks[self.blocks_for(new_len) :]

    def release(self, cache_id: str) -> None:
        seq = self.caches.pop(cache_id, None)
        if seq is not None:
            self.prefix.offer_to_disk()
            for block in seq.blocks:
                self._unref(block)
            self.prefix.trim()
            self._shrink_to_fit()

    def reset(self) -> None:
        self.caches.clear()
        self.prefix.clear()
        self.blocks, self.refs, self.free = 0, [], []
        self._drop()

    # -- blocks -----------------------------------------------------------------------

    def _take_block(self) -> int:
        """A block for one reference: a free one, else a cached one evicted or the buffers grown."""
        if not self.free:
            at_limit = self.max_blocks is not None and self.blocks >= self.max_blocks
            if not ((self.prefix.over_budget or at_limit) and self.prefix.evict(EVICT_AT_ONCE)):
                self._grow(self.blocks + 1)
        block = heapq.heappop(self.free)
        self.refs[block] = 1
        return block

    def _make_room(self, wanted: int) -> None:
        """Grow once for `wanted` more blocks where they will be needed (rather than once per
        block taken), when memory and the cache's budget leave growing as `_take_block`'s choice."""
        short = wanted - len(self.free)
        if short <= 0 or self.prefix.over_budget:
            return
        if self.max_blocks is None or self.blocks + short <= self.max_blocks:
            self._grow(self.blocks + short)

    def _ref(self, block: int) -> None:
        self.refs[block] += 1
        if self.refs[block] == 2:
            self.prefix.block_held(block)

    def _unref(self, block: int) -> None:
        if block == SCRATCH:  # (a windowed sequence's table names it for the blocks it let go)
            return
        self.refs[block] -= 1
        if self.refs[block] == 0:
            heapq.heappush(self.free, block)
        elif self.refs[block] == 1:
            self.prefix.block_let_go(block)

    def _grow(self, wanted: int) -> None:
        blocks = max(wanted, self.blocks + max(GROW_BLOCKS, self.blocks // 2), 2)
        blocks = GROW_BLOCKS * math.ceil(blocks / GROW_BLOCKS)
        if self.max_blocks is not None:
            blocks = min(blocks, self.max_blocks)
            if blocks < wanted:
                raise FerrumError(
                    f"the KV cache is full ({self.allocated_tokens} tokens in use); "
                    "wait for running requests to finish, or shorten the prompts"
                )
        old = self.blocks
        self._resize(blocks, list(range(old)))
        self.refs += [0] * (blocks - old)
        if old == 0:
            self.refs[SCRATCH] = 1  # never handed out
            old = 1
        for block in range(old, blocks):
            heapq.heappush(self.free, block)
        self.blocks = blocks

    def _shrink_to_fit(self) -> None:
        in_use = [b for b in range(1, self.blocks) if self.refs[b] > 0]
        if not in_use and not self.caches and self.idle_blocks == 0:
            if self.blocks:
                self.blocks, self.refs, self.free = 0, [], []
                self._drop()
            return
        target = max(self.idle_blocks, 1 + len(in_use), 2)
        target = GROW_BLOCKS * math.ceil(target / GROW_BLOCKS)
        if 2 * target > self.blocks:
            return  # too small a saving to pay a copy for (and to reallocate again soon)
        keep = [SCRATCH] + in_use
        self._resize(target, keep)
        self._renumber({old: new for new, old in enumerate(keep) if old != new})
        self.refs = [self.refs[b] for b in keep] + [0] * (target - len(keep))
        self.free = list(range(len(keep), target))  # (sorted: a heap)
        self.blocks = target

    def _renumber(self, new_id: dict[int, int]) -> None:
        if not new_id:
            return
        for seq in self.caches.values():
            seq.blocks = [new_id.get(b, b) for b in seq.blocks]
        self.prefix.index.renumber(new_id)
        for listener in self.renumbered:
            listener(new_id)

    # -- what a backend provides -------------------------------------------------------

    def _resize(self, blocks: int, keep: list[int]) -> None:
        raise NotImplementedError

    def _copy_block(self, src: int, dst: int, tokens: int) -> None:
        raise NotImplementedError

    def _drop(self) -> None:
        raise NotImplementedError

    def _read_blocks(self, blocks: list[int]):
        raise NotImplementedError

    def _write_blocks(self, blocks: list[int], array) -> None:
        raise NotImplementedError
