"""The keys and values of a model's sliding-window layers, in a pool of their own.

A windowed layer's query at position p reads the keys of positions p - window + 1 .. p only.
Its layers' blocks live in a second `BlockPool` beside the full-attention layers' (each holds
buffers for its own layers only), and a sequence lets go of the blocks wholly behind its
window before each forward (`trim`): it holds at most its window and one block, however long
it grows. Its block table names the scratch block for what it let go.

The prefix cache indexes the full pool's blocks by their token ids; a node of that index also
keeps the windowed layers' block of the same positions when the sequence still held it as it
was remembered (`remember`). A new sequence reuses a cached prefix up to the longest whole
block whose window the nodes keep (`reuse`): a chat's next turn finds the window of the turn
before it (remembered as it ended), and a shared start of two prompts finds it while the first
has not moved a window past it. Fewer reused tokens change no logits. A cut (`truncate`) back
past what the window kept leaves the sequence empty; the caller then reuses or prefills it.
"""

from __future__ import annotations

from typing import Sequence

from ferrum_mac.backends.state.block_pool import SCRATCH, BlockPool, SequenceBlocks
from ferrum_mac.backends.state.prefix_cache import PrefixCache
from ferrum_mac.backends.state.prefix_index import Node


class WindowedKv:
    """The windowed layers' `pool` (sequences by the same cache ids as the full pool's) for a
    `window` of tokens, and the blocks the full pool's prefix cache keeps for them."""

    def __init__(self, pool: BlockPool, window: int, prefix: PrefixCache):
        self.pool, self.window, self.prefix = pool, window, prefix
        self.kept: dict[int, tuple[Node, int]] = {}  # id(node) -> (node, its windowed block)
        prefix.forget = self.forget
        pool.renumbered.append(self._renumber)

    # -- a sequence --------------------------------------------------------------------

    def place(self, cache_id: str, offset: int, end: int) -> SequenceBlocks:
        """`cache_id`'s windowed blocks for a forward of positions `offset .. end - 1`: those
        behind the window of `offset` let go of, those up to `end` its own."""
        seq = self.pool.acquire(cache_id)
        self.pool.release_before(seq, offset - self.window + 1)
        self.pool.reserve(seq, offset, end)
        return seq

    def holds(self, cache_id: str, length: int) -> bool:
        """Whether `cache_id` keeps the window a sequence of `length` tokens goes on from."""
        seq = self.pool.get(cache_id)
        if length == 0:
            return True
        if seq is None:
            return False
        B = self.pool.block_tokens
        first = max(0, length - self.window + 1) // B
        return all(b != SCRATCH for b in seq.blocks[first : self.pool.blocks_for(length)])

    # -- the prefix cache --------------------------------------------------------------

    def remember(self, cache_id: str, tokens: Sequence[int]) -> None:
        """Keep, with each full node of `tokens`, the windowed block `cache_id` still holds there."""
        seq = self.pool.get(cache_id)
        if seq is None or not self.prefix.budget:
            return
        n = min(len(tokens), seq.length)
        nodes = self.prefix.index.match(tokens[:n], n).nodes
        for node, block in zip(nodes, seq.blocks):
            if block != SCRATCH and id(node) not in self.kept:
                self.kept[id(node)] = (node, block)
                self.pool.refs[block] += 1

    def reuse(self, seq: SequenceBlocks, cache_id: str, tokens: Sequence[int], found: int, held: int) -> int:
        """After the full pool's `seq` took `found` tokens of `tokens` from the cache (it held
        `held` before), give `cache_id` the windowed blocks of the longest whole-block prefix
        whose window the cache keeps, cut `seq` to it, and say how long that is (`held` if none)."""
        if found <= held:
            return held
        B = self.pool.block_tokens
        nodes = self.prefix.index.match(tokens, found).nodes
        for blocks in range(min(len(nodes), found // B), held // B, -1):
            first = max(0, blocks * B - self.window + 1) // B
            window = [self.kept.get(id(node)) for node in nodes[first:blocks]]
            if all(kept is not None and kept[0] is node for kept, node in zip(window, nodes[first:blocks])):
                self._adopt(cache_id, first, [block for _, block in window], blocks * B)
                self.prefix.pool.truncate(seq.cache_id, blocks * B)
                return blocks * B
        self.prefix.pool.truncate(seq.cache_id, held)
        return held

    def _adopt(self, cache_id: str, first: int, blocks: list[int], length: int) -> None:
        self.pool.release(cache_id)
        seq = self.pool.acquire(cache_id)
        for block in blocks:
            self.pool._ref(block)
        seq.blocks = [SCRATCH] * first + blocks
        seq.length = length

    def forget(self, node: Node) -> None:
        """The prefix cache evicted `node`: its windowed block goes too."""
        kept = self.kept.pop(id(node), None)
        if kept is not None:
            self.pool._unref(kept[1])

    def clear(self) -> None:
        self.kept.clear()

    def _renumber(self, new_id: dict[int, int]) -> None:
        self.kept = {key: (node, new_id.get(block, block)) for key, (node, block) in self.kept.items()}

    # -- memory ------------------------------------------------------------------------

    def allocation_for(self, lengths: Sequence[int]) -> int:
        """`BlockPool.allocation_for` of sequences that keep only their window (and a block)."""
        most = self.pool.blocks_for(self.window) + 1
        return sum(min(self.pool.blocks_for(n), most) + 1 for n in lengths) * self.pool.block_tokens
