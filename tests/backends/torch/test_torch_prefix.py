"""The prefix cache on torch: greedy output with it equals output without it (real weights and
the MoE family), reuse after remember, shared blocks held once and copied before they are
written, attention through block tables that are not consecutive, and the disk tier's host
copies of blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ferrum_mac
from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS as B
from ferrum_mac.backends.torch.attention import positions_rows
from ferrum_mac.llm import DecodeItem
from helpers import assert_close, random_tokens
from prefix_support import REL, reference_logits


# -- copy on write and block tables, on the tiny Llama ------------------------------------------------


@pytest.fixture
def fresh_model(zoo):
    """A tiny Llama of its own: its pool and prefix cache start empty."""
    return ferrum_mac.open_model(zoo.path("llama"), backend="torch", dtype="float32")


def test_a_shared_block_is_copied_before_it_is_written(fresh_model):
    """Sequence b shares a's blocks, cuts its history inside the second and writes other tokens
    there: it writes a copy of its own, and a's keys stay as they were."""
    model = fresh_model
    prompt = random_tokens(3 * B, seed=70)
    model.prefill("a", prompt)
    model.state.remember("a", prompt)
    assert model.state.reuse("b", prompt + [1]).tokens == len(prompt)
    a, b = model.kv.get("a"), model.kv.get("b")
    assert a.blocks == b.blocks

    model.truncate_kv("b", B + 5)
    rewrite = random_tokens(2 * B, seed=71)
    got_b = model.prefill("b", rewrite)

    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert_close(got_b, reference_logits(model, prompt[: B + 5] + rewrite)[-1], REL, "b")
    assert_close(model.decode("a", 4, len(prompt)), reference_logits(model, prompt + [4])[-1], REL, "a")


def test_batched_decode_over_scattered_blocks_equals_each_alone(fresh_model):
    """Sequences that grow together take turns at the free blocks, so their tables interleave
    (and two share a prefix): the batched decode (its rows' tables sent as they change), a
    lone decode and a prefill that continue such a table all give a fresh forward's logits."""
    model = fresh_model
    history = {f"s{i}": random_tokens(B - 2 + i, seed=40 + i) for i in range(3)}
    for cid, prompt in history.items():
        model.prefill(cid, prompt)
    for step in range(2 * B):
        if step == 6:  # s0 holds B + 4 tokens: t shares its first block and copies 3 rows of its second
            model.state.remember("s0", history["s0"])
            history["t"] = history["s0"][: B + 3] + [9]
            found = model.state.reuse("t", history["t"])
            assert found.tokens == B + 3
            model.prefill("t", history["t"][found.tokens :])
        live = list(history)
        tokens = {cid: random_tokens(1, seed=100 * step + i)[0] for i, cid in enumerate(live)}
        out = model.decode_batch([DecodeItem(cid, tokens[cid], len(history[cid])) for cid in live])
        for row, cid in enumerate(live):
            history[cid].append(tokens[cid])
            if step % 9 == 0 or step == 2 * B - 1:
                want = reference_logits(model, history[cid])[-1]
                assert_close(out[row], want, REL, f"{cid} at step {step}")
    tables = {cid: model.kv.get(cid) for cid in history}
    assert any(seq.first_row_if_contiguous(seq.length) is None for seq in tables.values())
    assert tables["t"].blocks[0] == tables["s0"].blocks[0]

    scattered = next(cid for cid, seq in tables.items() if seq.first_row_if_contiguous(seq.length) is None)
    h = history[scattered]
    assert_close(model.decode(scattered, 3, len(h)), reference_logits(model, h + [3])[-1], REL, "lone decode")
    more = random_tokens(B + 5, seed=99)
    want = reference_logits(model, h + [3] + more)[-1]
    assert_close(model.prefill(scattered, more), want, REL, "prefill after scattered blocks")


def test_one_sequence_reads_a_slice_of_the_pool(fresh_model):
    """A lone sequence's blocks follow each other: a prefill writes and reads slices of the
    token axis (views, no gather); scattered blocks are read by an index."""
    model = fresh_model
    model.prefill("a", random_tokens(3 * B + 4, seed=60))
    seq = model.kv.get("a")
    assert isinstance(positions_rows(seq, 0, seq.length), slice)
    assert positions_rows(seq, B + 3, 2 * B + 1) == slice(seq.blocks[1] * B + 3, seq.blocks[2] * B + 1)
    seq.blocks[1], seq.blocks[2] = seq.blocks[2], seq.blocks[1]  # (only the rows are looked at)
    rows = positions_rows(seq, B + 3, 2 * B + 1)
    assert rows.tolist() == [seq.blocks[1] * B + p for p in range(3, B)] + [seq.blocks[2] * B]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_read_to_the_host_write_back_the_same(zoo, dtype):
    """The disk tier's hooks: a host copy of blocks (bfloat16 as its bits) written into other
    blocks holds the same keys and values."""
    model = ferrum_mac.open_model(zoo.path("llama"), backend="torch", dtype=dtype)
    model.prefill("a", random_tokens(2 * B, seed=50))
    kv, seq = model.kv, model.kv.get("a")
    with torch.inference_mode():
        array = kv._read_blocks(seq.blocks)
        c = model.config
        assert array.shape == (c.num_layers, 2, c.num_kv_heads, 2 * B, c.head_dim)
        assert array.dtype == (np.uint16 if dtype == "bfloat16" else np.float32)
        assert np.abs(array.astype(np.float32)).sum() > 0
        copy = [kv._take_block(), kv._take_block()]
        kv._write_blocks(copy, array)
        assert np.array_equal(kv._read_blocks(copy), array)
        assert not np.array_equal(kv._read_blocks(copy[::-1]), array)


def test_shrinking_the_pool_moves_blocks_down_and_keeps_their_keys(fresh_model):
    """A release that leaves most blocks free reallocates smaller buffers, the blocks in use
    renumbered: the survivor's keys move with them (its next token's logits are unchanged)."""
    model = fresh_model
    model.prefill("big", random_tokens(20 * B, seed=80))
    small = random_tokens(B + 3, seed=81)
    model.prefill("small", small)
    before = model.kv.blocks
    model.release("big")
    assert model.kv.blocks < before
    assert_close(model.decode("small", 2, len(small)), reference_logits(model, small + [2])[-1], REL)
