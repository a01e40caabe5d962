"""The KV pool holds what its live sequences use: blocks for the tokens they hold, grown to
them and given back when they end, and it says what it holds (`state.allocated_tokens`,
`state.used_tokens`, `state.tokens_for`), on every installed backend, through the model contract.

The case that made a server hold 7 GB idle: a burst of short sequences, all released, then
one long one. A pool of equal slots gave every slot the long one's room and kept it; a pool
of blocks holds each sequence's own tokens.
"""

from __future__ import annotations

import pytest

import ferrum_mac
from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS as B
from helpers import BACKENDS, assert_close, random_tokens, to_np

REL = 1e-5
GROWTH = 8 * B  # the buffers grow by at least this many tokens at once (GROW_BLOCKS blocks)


@pytest.fixture(params=BACKENDS)
def fresh_model(request, zoo):
    """A model of its own: its pool starts empty, with no idle size from another test's `prepare`."""
    return ferrum_mac.open_model(zoo.path("llama"), backend=request.param, dtype="float32")


def reference_next(model, tokens: list[int]):
    """Logits after `tokens` on a throw-away cache."""
    model.prefill("reference", tokens[:-1])
    logits = to_np(model.decode("reference", tokens[-1], len(tokens) - 1))
    model.release("reference")
    return logits


def blocks_of(tokens: int) -> int:
    return -(-tokens // B)


def assert_holds_about(model, tokens: int) -> None:
    """The buffers hold `tokens` (in whole blocks), and at most half as much again plus one
    growth step: memory follows what is cached."""
    held = model.state.allocated_tokens()
    assert tokens <= held <= tokens + tokens // 2 + GROWTH, (held, tokens)


def test_a_burst_then_one_long_sequence_holds_its_own_blocks(fresh_model):
    model = fresh_model
    short = [f"short-{i}" for i in range(32)]
    for i, cid in enumerate(short):
        model.prefill(cid, random_tokens(10, seed=i))
    assert_holds_about(model, 32 * B)  # a block each
    assert model.state.used_tokens() == 320
    for cid in short:
        model.release(cid)
    assert model.state.allocated_tokens() == 0  # idle: nothing was prepared, so nothing is kept
    assert model.state.used_tokens() == 0

    model.prefill("long", random_tokens(700, seed=99))
    assert_holds_about(model, blocks_of(700) * B)  # the long one's blocks, not 32 sequences' room
    assert model.state.used_tokens() == 700
    model.release("long")
    assert model.state.allocated_tokens() == 0


def test_idle_size_is_what_prepare_asked_for(fresh_model):
    model = fresh_model
    model.prepare("warm", 16)
    model.release("warm")
    idle = model.state.allocated_tokens()
    assert 16 <= idle <= GROWTH
    model.prefill("long", random_tokens(600, seed=1))
    assert_holds_about(model, blocks_of(600) * B)
    model.release("long")
    assert model.state.allocated_tokens() == idle  # back to the idle size


def test_shrinking_moves_live_sequences_down_and_keeps_their_history(fresh_model):
    model = fresh_model
    prompts = {f"s{i}": random_tokens(5 + i, seed=20 + i) for i in range(8)}
    for cid, prompt in prompts.items():
        model.prefill(cid, prompt)
    model.prefill("s8", random_tokens(600, seed=40))
    assert_holds_about(model, (8 + blocks_of(600)) * B)
    for cid in ["s0", "s1", "s2", "s4", "s5", "s7", "s8"]:
        model.release(cid)
    # s3 and s6 are left: the buffers shrink to one growth step, their blocks moved down
    assert model.state.allocated_tokens() <= GROWTH
    for cid in ("s3", "s6"):
        prompt = prompts[cid]
        got = model.decode(cid, 7, len(prompt))
        assert_close(got, reference_next(model, prompt + [7]), REL)
        model.release(cid)


def test_a_small_saving_does_not_reallocate(fresh_model):
    """Releasing one of two short sequences would save one block: not worth a copy (nor the
    reallocation when the next one comes)."""
    model = fresh_model
    model.prefill("a", [5, 6, 7])
    model.prefill("b", [5, 6])
    held = model.state.allocated_tokens()
    model.release("a")
    assert model.state.allocated_tokens() == held
    assert_close(model.decode("b", 9, 2), reference_next(model, [5, 6, 9]), REL)
    model.release("b")
    assert model.state.allocated_tokens() == 0


def test_kv_tokens_for_is_each_sequences_blocks(fresh_model):
    """What admitting sequences costs: each one's blocks and one more for its next tokens;
    what other sequences hold is not counted again."""
    model = fresh_model
    assert model.state.tokens_for([10, 700]) == (blocks_of(10) + 1 + blocks_of(700) + 1) * B
    assert model.state.tokens_for([10, 10, 10]) == 3 * 2 * B
    model.prefill("x", random_tokens(300, seed=3))
    assert model.state.tokens_for([10]) == 2 * B
    model.release("x")


def test_growth_holds_at_most_one_old_layer_beside_the_new_buffers(zoo):
    """Growing reallocates layer by layer: the peak is the new buffers plus about one old
    layer, not the old and the new buffers whole (MLX, which counts its memory on every device)."""
    mx = pytest.importorskip("mlx.core")
    if "mlx" not in BACKENDS:
        pytest.skip("MLX is not installed")
    model = ferrum_mac.open_model(zoo.path("llama"), backend="mlx", dtype="float32")
    c = model.config
    per_token = c.kv_bytes_per_token(4)  # keys and values of every layer, float32
    for i in range(8):
        model.prefill(f"s{i}", random_tokens(8 * B, seed=i))  # each fills its blocks
    if model.kv.free:
        model.prefill("filler", random_tokens(len(model.kv.free) * B, seed=9))  # takes every free block
    mx.eval(model.kv.arrays())
    assert not model.kv.free
    old = model.state.allocated_tokens() * per_token
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model.decode("s0", 5, 8 * B))  # its next block: the buffers grow
    new = model.state.allocated_tokens() * per_token
    assert new > old
    layer = (old + B * per_token) // (2 * c.num_layers)  # one old layer's keys (or values), scratch included
    assert mx.get_peak_memory() - before < new - old + 2 * layer + old // 8  # slack for the step's activations
    for cid in [f"s{i}" for i in range(8)] + ["filler"]:
        model.release(cid)  # (an unknown id is ignored)
