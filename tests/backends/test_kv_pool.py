"""The KV pool holds what its live sequences use: it grows to them, gives memory back when they
end, and says what it holds (`kv_allocated_tokens`, `kv_used_tokens`, `kv_tokens_for`), on
every installed backend, through the model contract.

The case that made a server hold 7 GB idle: a burst of short sequences, all released, then
one long one. The pool used to give every slot the long one's room and keep it.
"""

from __future__ import annotations

import pytest

import ferrum_mac
from helpers import BACKENDS, assert_close, random_tokens, to_np

GROW_STEP = 256  # the pool's token room grows in these steps
REL = 1e-5


@pytest.fixture(params=BACKENDS)
def fresh_model(request, zoo):
    """A model of its own: its pool starts empty, with no idle shape from another test's `prepare`."""
    return ferrum_mac.open_model(zoo.path("llama"), backend=request.param, dtype="float32")


def reference_next(model, tokens: list[int]):
    """Logits after `tokens` on a throw-away cache."""
    model.prefill("reference", tokens[:-1])
    logits = to_np(model.decode("reference", tokens[-1], len(tokens) - 1))
    model.release("reference")
    return logits


def test_a_burst_then_one_long_sequence_holds_one_slot(fresh_model):
    model = fresh_model
    short = [f"short-{i}" for i in range(32)]
    for i, cid in enumerate(short):
        model.prefill(cid, random_tokens(10, seed=i))
    assert model.kv_allocated_tokens() == 32 * GROW_STEP
    assert model.kv_used_tokens() == 320
    for cid in short:
        model.release(cid)
    assert model.kv_allocated_tokens() == 0  # idle: nothing was prepared, so nothing is kept
    assert model.kv_used_tokens() == 0

    model.prefill("long", random_tokens(700, seed=99))
    assert model.kv_allocated_tokens() == 1 * 768  # one slot of the long one's room, not 32
    assert model.kv_used_tokens() == 700
    model.release("long")
    assert model.kv_allocated_tokens() == 0


def test_idle_size_is_what_prepare_asked_for(fresh_model):
    model = fresh_model
    model.prepare("warm", 16)
    model.release("warm")
    assert model.kv_allocated_tokens() == GROW_STEP
    model.prefill("long", random_tokens(600, seed=1))
    assert model.kv_allocated_tokens() == 768
    model.release("long")
    assert model.kv_allocated_tokens() == GROW_STEP  # back to the idle size


def test_shrinking_moves_live_sequences_down_and_keeps_their_history(fresh_model):
    model = fresh_model
    prompts = {f"s{i}": random_tokens(5 + i, seed=20 + i) for i in range(8)}
    for cid, prompt in prompts.items():
        model.prefill(cid, prompt)
    model.prefill("s8", random_tokens(300, seed=40))  # a ninth: 16 slots of 512
    assert model.kv_allocated_tokens() == 16 * 512
    for cid in ["s0", "s1", "s2", "s4", "s5", "s7", "s8"]:
        model.release(cid)
    # s3 and s6 are left: two slots of the grow step, their keys moved to slots 0 and 1
    assert model.kv_allocated_tokens() == 2 * GROW_STEP
    for cid in ("s3", "s6"):
        prompt = prompts[cid]
        got = model.decode(cid, 7, len(prompt))
        assert_close(got, reference_next(model, prompt + [7]), REL)
        model.release(cid)


def test_a_small_saving_does_not_reallocate(fresh_model):
    """Releasing one of two short sequences would save one slot: not worth a copy (nor the
    reallocation when the next one comes)."""
    model = fresh_model
    model.prefill("a", [5, 6, 7])
    model.prefill("b", [5, 6])
    assert model.kv_allocated_tokens() == 2 * GROW_STEP
    model.release("a")
    assert model.kv_allocated_tokens() == 2 * GROW_STEP
    assert_close(model.decode("b", 9, 2), reference_next(model, [5, 6, 9]), REL)
    model.release("b")
    assert model.kv_allocated_tokens() == 0


def test_kv_tokens_for_is_the_pools_shape(fresh_model):
    """What admitting sequences costs: every slot as long as the longest, slots a power of two."""
    model = fresh_model
    assert model.kv_tokens_for([10, 700]) == 2 * 768
    assert model.kv_tokens_for([10, 10, 10]) == 4 * GROW_STEP
    model.prefill("x", random_tokens(300, seed=3))
    assert model.kv_tokens_for([10]) == 512  # never less than the pool holds now
    model.release("x")


def test_growth_holds_at_most_one_old_layer_beside_the_new_pool(zoo):
    """Growing reallocates layer by layer: the peak is the new pool plus about one old layer,
    not the old and the new pool whole (MLX, which counts its memory on every device)."""
    mx = pytest.importorskip("mlx.core")
    if "mlx" not in BACKENDS:
        pytest.skip("MLX is not installed")
    model = ferrum_mac.open_model(zoo.path("llama"), backend="mlx", dtype="float32")
    c = model.config
    per_token = c.kv_bytes_per_token(4)  # keys and values of every layer, float32
    for i in range(8):
        model.prefill(f"s{i}", random_tokens(GROW_STEP, seed=i))  # 8 full slots of 256
    mx.eval(model.kv.arrays())
    old = model.kv_allocated_tokens() * per_token
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model.decode("s0", 5, GROW_STEP))  # one past 256: every slot grows to 512
    new = model.kv_allocated_tokens() * per_token
    assert new == 2 * old
    layer = old // (2 * c.num_layers)  # one layer's keys (or values)
    assert mx.get_peak_memory() - before < new - old + 2 * layer + old // 8  # slack for the step's activations
    for i in range(8):
        model.release(f"s{i}")
