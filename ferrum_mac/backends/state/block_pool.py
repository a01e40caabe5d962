"""The bookkeeping both backends' KV pools share: KV in fixed-size blocks, shared by reference.

The buffers hold `blocks` blocks of `block_tokens` token positions each (per layer, keys and
values); a backend lays them out so that block `b`'s positions are the token rows
`b * block_tokens ... (b + 1) * block_tokens - 1` of one long token axis. Each sequence
(`SequenceBlocks`) holds a list of blocks, its block table: position `p` of the sequence
lives in block `blocks[p // block_tokens]`, row `p % block_tokens`. Block 0 is scratch: never
handed out, so a decode step may send the rows it does not serve there.

Blocks are counted: every sequence holding a block and the prefix index (`prefix_index`)
holding it count one reference each. Two sequences that start with the same token ids share
their common full blocks; a sequence writes only into blocks it alone references, copying a
shared block first (copy on write: `reserve`). A released sequence's blocks stay cached for
as long as the index holds them, which is until memory is needed or the cache passes its
budget (`cache_blocks`): then the least recently used go first.

`reuse(cache_id, tokens)` gives a new sequence the longest cached prefix of a prompt (the
disk tier's blocks too, when there is one: `prefix_disk`), `remember(cache_id, tokens)`
indexes what a sequence holds. What the disk tier should write is handed to it when a
sequence is released, so reading the blocks back to the host never delays a first token. Memory follows the blocks held: the buffers grow when a block
is needed and none is free, and shrink (moving the blocks in use down, `_renumber`) when a
release leaves more than half of them free.

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
from typing import Sequence

import numpy as np

from ferrum_mac.backends.state.prefix_index import Match, PrefixIndex
from ferrum_mac.errors import FerrumError
from ferrum_mac.llm import MISS_NO_PREFIX, MISS_OTHER_MODEL, PrefixReuse, PrefixStats

BLOCK_TOKENS = 32  # token positions per block: the prefix cache's unit of sharing
GROW_BLOCKS = 8  # the buffers grow by at least this many blocks, and by half their size
DISK_WRITE_AT_ONCE = 16  # blocks read from disk copied to the device in one call (bounds the host copy)
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
    block_tokens = BLOCK_TOKENS
    sequence_type = SequenceBlocks

    def __init__(self, capacity: int, max_blocks: int | None = None, cache_blocks: int = 0, disk=None):
        """`capacity`: most tokens one sequence holds; `max_blocks`: most blocks the buffers
        may hold (what memory allows; None: no limit); `cache_blocks`: most blocks kept for
        the prefix cache that no sequence uses (0 turns the cache off); `disk`: the disk
        tier (`prefix_disk.PrefixDisk`) or None."""
        self.capacity = capacity
        self.max_blocks = max_blocks
        self.cache_blocks = cache_blocks
        self.disk = disk
        # Prefixes to offer the disk tier, when a sequence is released: its host copies are
        # read then, off the path of a request's first token.
        self.disk_offers: list[tuple[list, bool]] = []
        self.blocks = 0  # blocks the buffers hold, scratch included
        self.refs: list[int] = []  # references per block
        self.free: list[int] = []  # unreferenced blocks, a heap: the lowest is taken first
        self.cached_unused = 0  # indexed blocks only the index references: what may be evicted
        self.idle_blocks = 0  # kept when no sequence is live: set by `prepare`
        self.caches: dict[str, SequenceBlocks] = {}
        self.index = PrefixIndex(self.block_tokens)
        self.stats = PrefixStats()

    # -- accounting -------------------------------------------------------------------

    @property
    def allocated_tokens(self) -> int:
        """Token positions the buffers hold, used or not (scratch aside)."""
        return max(0, self.blocks - 1) * self.block_tokens

    @property
    def used_tokens(self) -> int:
        """Tokens the live sequences have cached (each counted, shared or not)."""
        return sum(seq.length for seq in self.caches.values())

    @property
    def cached_tokens(self) -> int:
        """Tokens the prefix index can hand out."""
        return self.index.tokens

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
            self._offer_to_disk()
            for block in seq.blocks:
                self._unref(block)
            self._trim_cache()
            self._shrink_to_fit()

    def reset(self) -> None:
        self.caches.clear()
        self.index.clear()
        self.blocks, self.refs, self.free, self.cached_unused = 0, [], [], 0
        self._drop()

    # -- the prefix cache -------------------------------------------------------------

    def reuse(self, cache_id: str, tokens: Sequence[int]) -> PrefixReuse:
        """`StateManager.reuse`."""
        seq = self.acquire(cache_id)
        held, limit = seq.length, len(tokens) - 1
        self.stats.lookups += 1
        if not self.cache_blocks or limit <= held:
            self.stats.missed_tokens += max(0, len(tokens) - held)
            return PrefixReuse(held, 0, None)
        match = self.index.match(tokens, limit)
        pinned = self._pin(match)  # nothing taken below may evict what was found
        self._make_room(self.blocks_for(len(tokens)) - len(match.nodes))  # loaded or computed: one growth
        self._load_from_disk(match, tokens, limit, pinned)
        found = match.tokens(self.block_tokens)
        if match.miss:
            self.stats.misses[match.miss] = self.stats.misses.get(match.miss, 0) + 1
        if found <= held:
            for block in pinned:
                self._unref(block)
            self.stats.missed_tokens += len(tokens) - held
            return PrefixReuse(held, 0, match.miss)
        self._adopt(seq, match)
        for block in pinned:
            self._unref(block)
        self.stats.hits += 1
        self.stats.reused_tokens += found - held
        self.stats.missed_tokens += len(tokens) - found
        if self.disk is not None:
            self.disk_offers.append((match.nodes, True))
        return PrefixReuse(found, found - held, match.miss)

    def remember(self, cache_id: str, tokens: Sequence[int]) -> None:
        """`StateManager.remember`."""
        seq = self.caches.get(cache_id)
        if seq is None or not self.cache_blocks:
            return
        n = min(len(tokens), seq.length)
        added, dropped = self.index.insert(tokens[:n], seq.blocks[: self.blocks_for(n)])
        for block in added:  # (the sequence holds each too: not evictable while it runs)
            self.refs[block] += 1
        for block in dropped:  # a partial node a longer one replaced: no longer indexed
            self.cached_unused -= self.refs[block] == 1
            self._unref(block)
        if self.disk is not None:
            self.disk_offers.append((self.index.match(tokens[:n], n).nodes, False))
        self._trim_cache()

    def _offer_to_disk(self) -> None:
        """Hand the disk tier the prefixes kept for it (`disk_offers`), those of their nodes
        still indexed (an evicted node's block may hold another sequence's keys by now)."""
        offers, self.disk_offers = self.disk_offers, []
        for nodes, reused in offers:
            alive = []
            for node in nodes:
                if self.index.nodes_by_block.get(node.block) is not node:
                    break
                alive.append(node)
            if alive:
                self.disk.offer(self, alive, reused=reused)

    def prefix_stats(self) -> PrefixStats:
        self.stats.cached_tokens = self.cached_tokens
        if self.disk is not None:
            self.disk.count(self.stats)
        return self.stats

    def _pin(self, match: Match) -> list[int]:
        """Hold one more reference on every block of `match` while it is being adopted."""
        pinned = match.blocks + ([match.partial.block] if match.partial is not None else [])
        for block in pinned:
            self._ref(block)
        return pinned

    def _adopt(self, seq: SequenceBlocks, match: Match) -> None:
        """Make `seq` hold `match` (pinned): its full blocks shared, its partial block copied."""
        for block in match.blocks:
            self._ref(block)
        for block in seq.blocks:
            self._unref(block)
        seq.blocks = match.blocks
        if match.partial is not None:
            fresh = self._take_block()
            self._copy_block(match.partial.block, fresh, match.partial_tokens)
            seq.blocks.append(fresh)
        seq.length = match.tokens(self.block_tokens)

    def _load_from_disk(self, match: Match, tokens: Sequence[int], limit: int, pinned: list[int]) -> None:
        """Extend `match` with full blocks the disk tier holds, read into new blocks, indexed and pinned."""
        if self.disk is None:
            return
        loaded: list[tuple[int, object]] = []  # (block, its keys and values): written together, fewer device calls
        for digest in list(self.index.digests_after(match.nodes, tokens, limit)):
            array = self.disk.load(digest)
            if array is None:
                break
            try:
                block = self._take_block()  # the index's reference
            except FerrumError:
                break  # memory is full: what is loaded so far is used, the rest computed (or refused) later
            loaded.append((block, array))
            if len(loaded) == DISK_WRITE_AT_ONCE:
                self._write_loaded(loaded)
            start = len(match.nodes) * self.block_tokens
            parent = match.nodes[-1] if match.nodes else self.index.root
            key = tuple(tokens[start : start + self.block_tokens])
            if match.partial is not None:  # a partial match ended where the disk's blocks go on
                pinned.remove(match.partial.block)
                self._unref(match.partial.block)
                match.partial, match.partial_tokens = None, 0
            for old in self.index.drop_partials_within(parent, key):  # the full block holds what they hold
                self.cached_unused -= self.refs[old] == 1
                self._unref(old)
            node = self.index.add(parent, key, block)
            self.cached_unused += 1  # only the index holds it, until the pin below
            self._ref(block)
            pinned.append(block)
            match.nodes.append(node)
            self.stats.disk_tokens_loaded += self.block_tokens
            match.miss = None
        self._write_loaded(loaded)
        if match.miss == MISS_NO_PREFIX and not match.nodes:
            first = next(self.index.digests_after([], tokens, limit), None)
            if first is not None and self.disk.other_model_has(first):
                match.miss = MISS_OTHER_MODEL  # the prompt was seen, by another model, dtype or backend

    def _write_loaded(self, loaded: list) -> None:
        """Copy blocks read from disk into the buffers (and forget them: `loaded` is emptied)."""
        if loaded:
            self._write_blocks([block for block, _ in loaded], np.concatenate([a for _, a in loaded], axis=3))
            loaded.clear()

    # -- blocks -----------------------------------------------------------------------

    def _take_block(self) -> int:
        """A block for one reference: a free one, else a cached one evicted or the buffers grown."""
        if not self.free:
            over_budget = self.cached_unused > self.cache_blocks
            at_limit = self.max_blocks is not None and self.blocks >= self.max_blocks
            if not ((over_budget or at_limit) and self._evict(EVICT_AT_ONCE)):
                self._grow(self.blocks + 1)
        block = heapq.heappop(self.free)
        self.refs[block] = 1
        return block

    def _make_room(self, wanted: int) -> None:
        """Grow once for `wanted` more blocks where they will be needed (rather than once per
        block taken), when memory and the cache's budget leave growing as `_take_block`'s choice."""
        short = wanted - len(self.free)
        if short <= 0 or self.cached_unused > self.cache_blocks:
            return
        if self.max_blocks is None or self.blocks + short <= self.max_blocks:
            self._grow(self.blocks + short)

    def _ref(self, block: int) -> None:
        self.refs[block] += 1
        if self.refs[block] == 2 and block in self.index.nodes_by_block:
            self.cached_unused -= 1

    def _unref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            heapq.heappush(self.free, block)
        elif self.refs[block] == 1 and block in self.index.nodes_by_block:
            self.cached_unused += 1

    def _evict(self, wanted: int) -> int:
        """Evict up to `wanted` least recently used blocks only the index holds; how many went."""

        def unused(node) -> bool:
            return self.refs[node.block] == 1

        # Least recently used first, by a heap of the evictable leaves: a parent whose last
        # child goes joins it (a match marks a path at once, so a parent is never older).
        heap = [(node.used, id(node), node) for node in self.index.evictable(lambda block: self.refs[block] == 1)]
        heapq.heapify(heap)
        gone = 0
        while gone < wanted and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self.index.remove(node)
            self.cached_unused -= 1
            self._unref(node.block)
            gone += 1
            if parent is not self.index.root and parent.is_leaf and unused(parent):
                heapq.heappush(heap, (parent.used, id(parent), parent))
        self.stats.evicted_blocks += gone
        return gone

    def _trim_cache(self) -> None:
        excess = self.cached_unused - self.cache_blocks
        if excess > 0:
            self._evict(excess)

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
        self.index.renumber(new_id)

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
