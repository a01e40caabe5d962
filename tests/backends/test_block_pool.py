"""The shared KV block bookkeeping (`block_pool`, `prefix_cache`, `prefix_index`) on a host-array
pool that records which token id each row holds, so every read checks what attention would see."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS as B
from ferrum_mac.backends.state.block_pool import BlockPool
from ferrum_mac.llm import MISS_CHANGED, MISS_EVICTED, MISS_NO_PREFIX


class RowPool(BlockPool):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = np.zeros(0, dtype=np.int64)
        self.resizes = 0

    def _resize(self, blocks, keep):
        new = np.full(blocks * B, -1, dtype=np.int64)
        for i, old in enumerate(keep):
            new[i * B : (i + 1) * B] = self.rows[old * B : (old + 1) * B]
        self.rows, self.resizes = new, self.resizes + 1

    def _copy_block(self, src, dst, tokens):
        self.rows[dst * B : dst * B + tokens] = self.rows[src * B : src * B + tokens]

    def _drop(self):
        self.rows = np.zeros(0, dtype=np.int64)

    def write(self, cid, tokens):
        seq = self.acquire(cid)
        start = seq.length
        self.reserve(seq, start, start + len(tokens))
        self.rows[seq.places(start, start + len(tokens))] = tokens
        seq.length += len(tokens)

    def read(self, cid):
        seq = self.caches[cid]
        return [int(t) for t in self.rows[seq.places(0, seq.length)]]

    def start(self, cid, prompt):
        """A request: reuse what is cached, compute the rest, remember it."""
        found = self.prefix.reuse(cid, prompt)
        assert self.read(cid) == list(prompt[: found.tokens])
        self.write(cid, prompt[found.tokens :])
        self.prefix.remember(cid, prompt)
        return found


def check_counts(pool: BlockPool) -> None:
    refs = [0] * pool.blocks
    if refs:
        refs[0] = 1  # scratch
    for seq in pool.caches.values():
        for b in seq.blocks:
            refs[b] += 1
    for b in pool.prefix.index.nodes_by_block:
        refs[b] += 1
    assert refs == pool.refs
    assert sorted(pool.free) == [b for b in range(pool.blocks) if refs[b] == 0]
    assert pool.prefix.unused == sum(1 for b in pool.prefix.index.nodes_by_block if refs[b] == 1)


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_a_repeated_prompt_reuses_all_but_its_last_token():
    pool = RowPool(4096, cache_blocks=100)
    prompt = ids(100, 1)
    assert pool.start("a", prompt).tokens == 0
    pool.release("a")
    found = pool.start("b", prompt)
    assert (found.tokens, found.cached, found.miss) == (99, 99, None)
    check_counts(pool)


def test_sequences_share_full_blocks_and_copy_a_partial_one():
    pool = RowPool(4096, cache_blocks=100)
    system = ids(3 * B + 5, 2)
    pool.start("a", system + ids(10, 3))
    found = pool.start("b", system + ids(10, 4))
    assert found.tokens == len(system)
    a, b = pool.caches["a"], pool.caches["b"]
    assert a.blocks[:3] == b.blocks[:3]  # shared by reference
    assert a.blocks[3] != b.blocks[3]  # the partly filled fourth: copied, then written
    check_counts(pool)


def test_a_shared_block_is_copied_before_it_is_written():
    pool = RowPool(4096, cache_blocks=100)
    prompt = ids(2 * B, 5)
    pool.start("a", prompt)
    pool.start("b", prompt + [7])
    pool.truncate("a", B + 3)  # rewrite a's history inside a block b shares
    pool.write("a", [1, 2, 3])
    assert pool.read("b") == prompt + [7]
    assert pool.read("a") == prompt[: B + 3] + [1, 2, 3]
    check_counts(pool)


def test_miss_reasons():
    pool = RowPool(4096, cache_blocks=4)
    first = ids(4 * B, 6)
    pool.start("a", first)
    pool.release("a")
    assert pool.prefix.reuse("b", ids(50, 7)).miss == MISS_NO_PREFIX
    changed = first[:B] + ids(3 * B, 8)
    found = pool.prefix.reuse("c", changed)
    assert (found.tokens, found.miss) == (B, MISS_CHANGED)
    pool.start("d", ids(6 * B, 9))
    pool.release("d")  # over the cache budget of 4 blocks: the oldest go
    pool.release("c")
    pool.release("b")
    assert pool.prefix.reuse("e", first).miss == MISS_EVICTED
    stats = pool.prefix.read_stats()
    assert stats.evicted_blocks > 0 and stats.misses[MISS_EVICTED] == 1


def test_a_prompt_going_on_past_a_cached_sequence_is_no_miss():
    pool = RowPool(4096, cache_blocks=100)
    first = ids(2 * B + 5, 8)  # ends inside a block: the index holds its last block partly filled
    pool.start("a", first)
    pool.release("a")
    found = pool.start("b", first + ids(40, 9))  # an agent's next step: all of it, and more
    assert (found.tokens, found.miss) == (len(first), None)


def test_memory_follows_the_blocks_held():
    pool = RowPool(1 << 16, cache_blocks=0)
    for i in range(16):
        pool.start(f"s{i}", ids(300, i))
    big = pool.allocated_tokens
    assert big >= 16 * 300
    for i in range(16):
        pool.release(f"s{i}")
    assert pool.allocated_tokens == 0
    check_counts(pool)


def test_a_full_pool_evicts_cached_blocks_before_it_fails():
    pool = RowPool(4096, max_blocks=16, cache_blocks=100)
    for i in range(10):
        pool.start(f"s{i}", ids(4 * B, 10 + i))
        pool.release(f"s{i}")
        check_counts(pool)
    assert pool.blocks <= 16


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_keeps_every_sequence_and_count_exact(seed):
    rng = random.Random(seed)
    pool = RowPool(4096, max_blocks=200, cache_blocks=60)
    system = ids(100, seed)
    live = {}
    for step in range(600):
        op = rng.random()
        if op < 0.4 or not live:
            prompt = system[: rng.randrange(0, 100)] + ids(rng.randrange(1, 80), rng.random())
            if rng.random() < 0.3 and live:
                other = live[rng.choice(list(live))]
                prompt = other[: rng.randrange(1, len(other) + 1)] + prompt[:5]
            pool.start(f"s{step}", prompt)
            live[f"s{step}"] = prompt
        elif op < 0.7:
            cid = rng.choice(list(live))
            extra = ids(rng.randrange(1, 40), rng.random())
            pool.write(cid, extra)
            live[cid] += extra
        elif op < 0.8:
            cid = rng.choice(list(live))
            n = rng.randrange(0, len(live[cid]))
            pool.truncate(cid, n)
            live[cid] = live[cid][:n] + [3, 4, 5]
            pool.write(cid, [3, 4, 5])
        if op >= 0.8 or len(live) > 6:
            cid = rng.choice(list(live))
            pool.prefix.remember(cid, live[cid])
            pool.release(cid)
            del live[cid]
        check_counts(pool)
        for cid, tokens in live.items():
            assert pool.read(cid) == tokens
    assert pool.prefix.read_stats().hits > 0


def test_eviction_takes_the_oldest_blocks_not_a_conversation_just_remembered():
    """An agent's next step finds its whole previous turn, even when older prompts must be
    evicted to stay within the budget (evicting a few leaves must not take recent ones)."""
    pool = RowPool(1 << 16, cache_blocks=30)
    for i in range(2):
        pool.start(f"old{i}", ids(40 * B, 100 + i))
        pool.release(f"old{i}")
    prompt = ids(300, 1)
    for step in range(3):
        found = pool.start(f"s{step}", prompt)
        if step:
            assert found.tokens == len(prompt) - 300 - 1  # all the previous turn held (its last token never fed)
        answer = ids(16, 50 + step)
        pool.write(f"s{step}", answer[:15])
        pool.prefix.remember(f"s{step}", prompt + answer[:15])
        pool.release(f"s{step}")
        check_counts(pool)
        prompt = prompt + answer + ids(300, 200 + step)
