"""The prefix index: which KV blocks hold which token ids, as a radix tree over blocks.

A node is one block of a cached sequence: its token ids (`key`, at most `block_tokens` of
them; fewer for the partly filled last block of a sequence, a *partial* node, which has no
children) and the pool block holding their keys and values. A node's parent holds the
block before it, so the path from the root spells a prefix from position 0, and two
sequences that start alike share the nodes of their common full blocks.

`match(tokens)` walks the tree one block at a time (a dict lookup per block: time
proportional to the prompt), then looks among the last node's children for the longest
common start with what is left (a partial match, which the pool copies into a block of the
new sequence's own: copy on write). Each node holds one reference on its block (the pool
counts them); nodes whose block nothing else references are evictable, least recently
used first and leaves first (a parent outlives its children).

Each full node carries `digest`, a hash of every token id from position 0 to its end:
the name of its block on disk (`prefix_disk`) and in the record of evicted blocks that lets
a miss say why it missed.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from ferrum_mac.llm import MISS_CHANGED, MISS_EVICTED, MISS_NO_PREFIX

EVICTED_REMEMBERED = 1 << 16  # digests of evicted blocks kept to explain misses


def chain_digest(parent: str, key: Sequence[int]) -> str:
    """The digest of a block whose tokens are `key`, after the blocks `parent` digests."""
    data = parent.encode() + b"|" + b",".join(str(int(t)).encode() for t in key)
    return hashlib.sha256(data).hexdigest()[:32]


ROOT_DIGEST = chain_digest("", ())


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    block: int
    parent: "Node | None"
    digest: str = ""
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)  # full blocks, by their ids
    partials: dict[tuple[int, ...], "Node"] = field(default_factory=dict)  # partly filled last blocks
    used: int = 0  # the index's clock when it was last matched or inserted

    @property
    def is_leaf(self) -> bool:
        return not self.children and not self.partials


@dataclass
class Match:
    """What `match` found: `nodes` (full blocks, in order), then optionally `partial`, a node
    whose first `partial_tokens` ids continue the prompt; `miss` says why the walk stopped
    short of a cached continuation (None when it ran to the end of a cached sequence or of
    the prompt), and `next_digests` names the prompt's full blocks after the walk's end (for
    the disk tier)."""

    nodes: list[Node]
    partial: Node | None = None
    partial_tokens: int = 0
    miss: str | None = None

    @property
    def blocks(self) -> list[int]:
        return [node.block for node in self.nodes]

    def tokens(self, block_tokens: int) -> int:
        return len(self.nodes) * block_tokens + self.partial_tokens


class PrefixIndex:
    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self.root = Node((), -1, None, ROOT_DIGEST)
        self.nodes_by_block: dict[int, Node] = {}
        self.clock = itertools.count(1)
        self.evicted: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.nodes_by_block)

    @property
    def tokens(self) -> int:
        """Tokens the indexed blocks hold."""
        return sum(len(node.key) for node in self.nodes_by_block.values())

    # -- lookups ----------------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int) -> Match:
        """The longest indexed prefix of `tokens[:limit]`, marked as just used."""
        B, node, found = self.block_tokens, self.root, []
        now = next(self.clock)
        while (len(found) + 1) * B <= limit:
            start = len(found) * B
            child = node.children.get(tuple(tokens[start : start + B]))
            if child is None:
                break
            child.used = now
            found.append(child)
            node = child
        start = len(found) * B
        rest = tokens[start:limit]
        partial, partial_tokens = self._longest_start(node, rest)
        if partial is not None:
            partial.used = now
        result = Match(found, partial, partial_tokens)
        ended = partial is not None and partial_tokens == len(partial.key)  # a cached sequence's last block
        result.miss = self._why_stopped(node, tokens, start, limit, partial_tokens, ended)
        return result

    def _longest_start(self, node: Node, rest: Sequence[int]) -> tuple[Node | None, int]:
        best, best_n = None, 0
        for child in itertools.chain(node.children.values(), node.partials.values()):
            n = common_start(child.key, rest)
            if n > best_n:
                best, best_n = child, n
        return best, best_n

    def _why_stopped(
        self, node: Node, tokens: Sequence[int], start: int, limit: int, partial_tokens: int, ended: bool = False
    ) -> str | None:
        if start + partial_tokens >= limit:
            return None  # the whole prompt (but the token left to compute) was found
        if self.next_digest(node, tokens, start) in self.evicted:
            return MISS_EVICTED
        if ended:
            return None  # the prompt goes on past the end of a cached sequence (an agent's next step)
        if node is self.root:
            return MISS_NO_PREFIX
        if not node.is_leaf:
            return MISS_CHANGED  # cached sequences go on from here, each differently from this prompt
        return None  # a cached sequence ended here and the prompt goes on: nothing more was ever cached

    def next_digest(self, node: Node, tokens: Sequence[int], start: int) -> str | None:
        key = tokens[start : start + self.block_tokens]
        return chain_digest(node.digest, key) if len(key) == self.block_tokens else None

    def digests_after(self, nodes: list[Node], tokens: Sequence[int], limit: int) -> Iterator[str]:
        """The digests of the full blocks of `tokens[:limit]` after `nodes` (a match's), in order."""
        digest = nodes[-1].digest if nodes else ROOT_DIGEST
        B = self.block_tokens
        for start in range(len(nodes) * B, limit - B + 1, B):
            digest = chain_digest(digest, tokens[start : start + B])
            yield digest

    # -- changes ----------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Index a sequence holding `tokens` in `blocks` (one per `block_tokens` ids, the last
        maybe partly filled). Blocks whose ids are indexed already keep their node; returns
        the blocks the index newly references (the pool counts a reference for each) and
        the blocks it stopped referencing (a partial node replaced by a longer one)."""
        B, node, now = self.block_tokens, self.root, next(self.clock)
        added, dropped = [], []
        for i, block in enumerate(blocks):
            key = tuple(tokens[i * B : (i + 1) * B])
            if not key:
                break
            if len(key) == B:
                child = node.children.get(key)
                if child is None:
                    dropped += self.drop_partials_within(node, key)
                    child = self.add(node, key, block)
                    added.append(block)
            else:
                if any(common_start(other.key, key) == len(key) for other in node.children.values()):
                    break  # a full block starting with these ids is cached already
                longer = [p for p in node.partials.values() if common_start(p.key, key) == len(key)]
                if longer:
                    child = longer[0]
                else:
                    dropped += self.drop_partials_within(node, key)
                    child = self.add(node, key, block)
                    added.append(block)
            child.used = now
            node = child
        return added, dropped

    def add(self, parent: Node, key: tuple[int, ...], block: int) -> Node:
        """A new node under `parent`: `block` holds `key` (full, or a partial last block)."""
        full = len(key) == self.block_tokens
        node = Node(key, block, parent, chain_digest(parent.digest, key) if full else "", used=next(self.clock))
        (parent.children if full else parent.partials)[key] = node
        self.nodes_by_block[block] = node
        self.evicted.pop(node.digest, None)
        return node

    def drop_partials_within(self, parent: Node, key: tuple[int, ...]) -> list[int]:
        """Remove `parent`'s partial nodes that `key` continues (it holds all they hold)."""
        gone = [p for p in parent.partials.values() if common_start(p.key, key) == len(p.key)]
        for p in gone:
            del parent.partials[p.key]
            del self.nodes_by_block[p.block]
        return [p.block for p in gone]

    def evictable(self, unreferenced) -> list[Node]:
        """Leaves whose block only the index references (`unreferenced(block)`)."""
        return [n for n in self.nodes_by_block.values() if n.is_leaf and unreferenced(n.block)]

    def remove(self, node: Node) -> None:
        """Drop a leaf (its block is the caller's to free)."""
        parent = node.parent
        where = parent.children if len(node.key) == self.block_tokens else parent.partials
        if where.get(node.key) is node:
            del where[node.key]
        self.nodes_by_block.pop(node.block, None)
        if node.digest:
            self.evicted[node.digest] = None
            while len(self.evicted) > EVICTED_REMEMBERED:
                self.evicted.popitem(last=False)

    def renumber(self, new_id: dict[int, int]) -> None:
        """The pool moved blocks: `new_id[old]` for each moved one."""
        moved = {new_id.get(b, b): node for b, node in self.nodes_by_block.items()}
        for block, node in moved.items():
            node.block = block
        self.nodes_by_block = moved

    def clear(self) -> None:
        self.root = Node((), -1, None, ROOT_DIGEST)
        self.nodes_by_block.clear()


def common_start(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
