"""The prefix cache over a `BlockPool`: released sequences' blocks, found again by a prompt's prefix.

The pool counts one reference for every sequence holding a block, and one for the prefix index
(`prefix_index`) holding it. A released sequence's blocks stay cached for as long as the index
holds them, which is until memory is needed or the blocks no sequence uses pass the cache's
budget: then the least recently used go first (`evict`).

`reuse(cache_id, tokens)` gives a new sequence the longest cached prefix of a prompt (the disk
tier's blocks too, when there is one: `prefix_disk`), `remember(cache_id, tokens)` indexes what a
sequence holds. What the disk tier should write is handed to it when a sequence is released
(`offer_to_disk`), so reading the blocks back to the host never delays a first token.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ferrum_mac.backends.state.prefix_index import Match, Node, PrefixIndex
from ferrum_mac.errors import FerrumError
from ferrum_mac.llm import MISS_NO_PREFIX, MISS_OTHER_MODEL, PrefixReuse, PrefixStats

if TYPE_CHECKING:  # each holds the other
    from ferrum_mac.backends.state.block_pool import BlockPool, SequenceBlocks

DISK_WRITE_AT_ONCE = 16  # blocks read from disk copied to the device in one call (bounds the host copy)


class PrefixCache:
    """The prefix index over `pool`'s blocks, with its budget, its disk tier and its counters."""

    def __init__(self, pool: BlockPool, budget: int, disk=None):
        """`budget`: most blocks kept that no sequence uses (0 turns the cache off); `disk`:
        the disk tier (`prefix_disk.PrefixDisk`) or None."""
        self.pool, self.budget, self.disk = pool, budget, disk
        self.index = PrefixIndex(pool.block_tokens)
        self.unused = 0  # indexed blocks only the index references: what may be evicted
        # Prefixes to offer the disk tier, when a sequence is released: its host copies are
        # read then, off the path of a request's first token.
        self.disk_offers: list[tuple[list, bool]] = []
        self.stats = PrefixStats()
        self.forget: Callable[[Node], None] | None = None  # told of each node evicted (`windowed`)

    @property
    def over_budget(self) -> bool:
        return self.unused > self.budget

    def reuse(self, cache_id: str, tokens: Sequence[int]) -> PrefixReuse:
        """`StateManager.reuse`."""
        pool = self.pool
        seq = pool.acquire(cache_id)
        held, limit = seq.length, len(tokens) - 1
        self.stats.lookups += 1
        if not self.budget or limit <= held:
            self.stats.missed_tokens += max(0, len(tokens) - held)
            return PrefixReuse(held, 0, None)
        match = self.index.match(tokens, limit)
        pinned = self._pin(match)  # nothing taken below may evict what was found
        pool._make_room(pool.blocks_for(len(tokens)) - len(match.nodes))  # loaded or computed: one growth
        self._load_from_disk(match, tokens, limit, pinned)
        found = match.tokens(pool.block_tokens)
        if match.miss:
            self.stats.misses[match.miss] = self.stats.misses.get(match.miss, 0) + 1
        if found <= held:
            for block in pinned:
                pool._unref(block)
            self.stats.missed_tokens += len(tokens) - held
            return PrefixReuse(held, 0, match.miss)
        self._adopt(seq, match)
        for block in pinned:
            pool._unref(block)
        self.stats.hits += 1
        self.stats.reused_tokens += found - held
        self.stats.missed_tokens += len(tokens) - found
        if self.disk is not None:
            self.disk_offers.append((match.nodes, True))
        return PrefixReuse(found, found - held, match.miss)

    def remember(self, cache_id: str, tokens: Sequence[int]) -> None:
        """`StateManager.remember`."""
        pool = self.pool
        seq = pool.get(cache_id)
        if seq is None or not self.budget:
            return
        n = min(len(tokens), seq.length)
        added, dropped = self.index.insert(tokens[:n], seq.blocks[: pool.blocks_for(n)])
        for block in added:  # (the sequence holds each too: not evictable while it runs)
            pool.refs[block] += 1
        for block in dropped:  # a partial node a longer one replaced: no longer indexed
            self.unused -= pool.refs[block] == 1
            pool._unref(block)
        if self.disk is not None:
            self.disk_offers.append((self.index.match(tokens[:n], n).nodes, False))
        self.trim()

    def read_stats(self) -> PrefixStats:
        """The counters, with what the index and the disk tier hold now."""
        self.stats.cached_tokens = self.index.tokens
        if self.disk is not None:
            self.disk.count(self.stats)
        return self.stats

    # -- what the pool calls -----------------------------------------------------------

    def block_held(self, block: int) -> None:
        """`block` has a second reference: if the index holds it, a sequence does too (not evictable)."""
        if block in self.index.nodes_by_block:
            self.unused -= 1

    def block_let_go(self, block: int) -> None:
        """`block` is down to one reference: if the index holds it, only the index does (evictable)."""
        if block in self.index.nodes_by_block:
            self.unused += 1

    def evict(self, wanted: int) -> int:
        """Evict up to `wanted` least recently used blocks only the index holds; how many went."""
        refs = self.pool.refs

        # Least recently used first, by a heap of the evictable leaves: a parent whose last
        # child goes joins it (a match marks a path at once, so a parent is never older).
        heap = [(node.used, id(node), node) for node in self.index.evictable(lambda block: refs[block] == 1)]
        heapq.heapify(heap)
        gone = 0
        while gone < wanted and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self.index.remove(node)
            if self.forget is not None:
                self.forget(node)
            self.unused -= 1
            self.pool._unref(node.block)
            gone += 1
            if parent is not self.index.root and parent.is_leaf and refs[parent.block] == 1:
                heapq.heappush(heap, (parent.used, id(parent), parent))
        self.stats.evicted_blocks += gone
        return gone

    def trim(self) -> None:
        """Evict what passes the budget."""
        excess = self.unused - self.budget
        if excess > 0:
            self.evict(excess)

    def offer_to_disk(self) -> None:
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
                self.disk.offer(self.pool, alive, reused=reused)

    def clear(self) -> None:
        """Forget every block (the pool dropped its buffers)."""
        self.index.clear()
        self.unused = 0

    # -- reuse's steps -----------------------------------------------------------------

    def _pin(self, match: Match) -> list[int]:
        """Hold one more reference on every block of `match` while it is being adopted."""
        pinned = match.blocks + ([match.partial.block] if match.partial is not None else [])
        for block in pinned:
            self.pool._ref(block)
        return pinned

    def _adopt(self, seq: SequenceBlocks, match: Match) -> None:
        """Make `seq` hold `match` (pinned): its full blocks shared, its partial block copied."""
        pool = self.pool
        for block in match.blocks:
            pool._ref(block)
        for block in seq.blocks:
            pool._unref(block)
        seq.blocks = match.blocks
        if match.partial is not None:
            fresh = pool._take_block()
            pool._copy_block(match.partial.block, fresh, match.partial_tokens)
            seq.blocks.append(fresh)
        seq.length = match.tokens(pool.block_tokens)

    def _load_from_disk(self, match: Match, tokens: Sequence[int], limit: int, pinned: list[int]) -> None:
        """Extend `match` with full blocks the disk tier holds, read into new blocks, indexed and pinned."""
        if self.disk is None:
            return
        pool, B = self.pool, self.pool.block_tokens
        loaded: list[tuple[int, object]] = []  # (block, its keys and values): written together, fewer device calls
        arrays = self.disk.load_run(list(self.index.digests_after(match.nodes, tokens, limit)))
        for array in arrays:
            try:
                block = pool._take_block()  # the index's reference
            except FerrumError:
                break  # memory is full: what is loaded so far is used, the rest computed (or refused) later
            loaded.append((block, array))
            if len(loaded) == DISK_WRITE_AT_ONCE:
                self._write_loaded(loaded)
            start = len(match.nodes) * B
            parent = match.nodes[-1] if match.nodes else self.index.root
            key = tuple(tokens[start : start + B])
            if match.partial is not None:  # a partial match ended where the disk's blocks go on
                pinned.remove(match.partial.block)
                pool._unref(match.partial.block)
                match.partial, match.partial_tokens = None, 0
            for old in self.index.drop_partials_within(parent, key):  # the full block holds what they hold
                self.unused -= pool.refs[old] == 1
                pool._unref(old)
            node = self.index.add(parent, key, block)
            self.unused += 1  # only the index holds it, until the pin below
            pool._ref(block)
            pinned.append(block)
            match.nodes.append(node)
            self.stats.disk_tokens_loaded += B
            match.miss = None
        arrays.close()  # (the blocks read ahead of a stop are dropped now)
        self._write_loaded(loaded)
        if match.miss == MISS_NO_PREFIX and not match.nodes:
            first = next(self.index.digests_after([], tokens, limit), None)
            if first is not None and self.disk.other_model_has(first):
                match.miss = MISS_OTHER_MODEL  # the prompt was seen, by another model, dtype or backend

    def _write_loaded(self, loaded: list) -> None:
        """Copy blocks read from disk into the buffers (and forget them: `loaded` is emptied)."""
        if loaded:
            self.pool._write_blocks([block for block, _ in loaded], np.concatenate([a for _, a in loaded], axis=3))
            loaded.clear()
