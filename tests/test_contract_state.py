"""The state manager (`DecoderOnlyLLM.state`): what a sequence holds goes through it, the
model keeps the seed's methods and a few more, and a layer kind no manager keeps is refused."""

from __future__ import annotations

import inspect

import pytest

import ferrum_mac
from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS as B
from ferrum_mac.backends.state.block_pool import BlockPool
from ferrum_mac.backends.state.manager import PooledState
from ferrum_mac.backends.state.recurrent import RecurrentStates
from ferrum_mac.errors import CacheStateError, UnsupportedModelError
from ferrum_mac.llm import DecoderOnlyLLM, LlmRuntimeConfig
from ferrum_mac.sequence_state import (
    FULL_ATTENTION,
    MISS_OFF,
    CountingState,
    FullAttention,
    PrefixReuse,
    Recurrent,
    SharedKV,
    SlidingWindow,
    every_layer_full,
)
from helpers import BACKENDS, random_tokens

SEED_METHODS = {
    "config",
    "prefill",
    "decode",
    "release",
    "prepare",
    "kv_capacity",
    "decode_batch",
    "forward_verify",
    "unified_forward",
    "truncate_kv",
    "reset",
}
MOST_ADDED = 4


def public_methods(cls: type) -> set[str]:
    """The public methods and properties `cls` declares or inherits (data attributes aside)."""
    return {
        name
        for name, value in inspect.getmembers(cls)
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }


def test_the_model_keeps_the_seeds_methods_and_at_most_four_more():
    methods = public_methods(DecoderOnlyLLM)
    assert SEED_METHODS <= methods
    added = methods - SEED_METHODS
    assert "state" in added and len(added) <= MOST_ADDED, sorted(added)


class Counted(DecoderOnlyLLM):
    """A model without a pool: it keeps its own cache and advances the default manager."""

    config = LlmRuntimeConfig(8, 2, 1, 8, 16, 32, layer_kinds=every_layer_full(2))

    def prefill(self, cache_id, tokens):
        self.state.advance(cache_id, len(tokens))

    def decode(self, cache_id, token, pos):
        self.state.advance(cache_id, 1)


def test_a_model_without_a_pool_counts_lengths_and_reuses_nothing():
    model = Counted()
    assert isinstance(model.state, CountingState) and model.state is model.state
    model.prefill("a", [1, 2, 3, 4])
    model.decode("a", 5, 4)
    assert model.state.length("a") == 5 and model.state.used_tokens() == 5
    assert model.state.reuse("a", [1, 2, 3, 4, 5, 6, 7]) == PrefixReuse(5, 0, MISS_OFF)
    assert model.state.prefix_stats() is None and model.state.free_tokens() is None
    model.truncate_kv("a", 2)
    assert model.state.length("a") == 2
    with pytest.raises(CacheStateError):
        model.truncate_kv("a", -1)
    model.release("a")
    model.release("a")  # idempotent
    assert model.state.length("a") == 0


@pytest.mark.parametrize("kind", [SlidingWindow(4096), SharedKV(0), Recurrent()], ids=str)
def test_a_layer_kind_the_manager_does_not_hold_is_refused(kind):
    config = LlmRuntimeConfig(8, 3, 1, 8, 16, 32, layer_kinds=(FULL_ATTENTION, FULL_ATTENTION, kind))
    makers = [lambda: CountingState(config.layer_kinds)]
    if not isinstance(kind, SlidingWindow):  # the pooled manager keeps windows
        makers.append(lambda: PooledState(BlockPool(32), config))
    for make in makers:
        with pytest.raises(UnsupportedModelError, match=f"layer 2 of this model keeps {kind}") as err:
            make()
        assert FullAttention.name in str(err.value)


def test_the_pooled_manager_keeps_sliding_windows():
    kinds = (SlidingWindow(16), FULL_ATTENTION)
    assert PooledState(BlockPool(32), LlmRuntimeConfig(8, 2, 1, 8, 16, 32, layer_kinds=kinds)).kinds == kinds


def test_the_pooled_manager_keeps_recurrent_states_in_their_store():
    kinds = (Recurrent(), FULL_ATTENTION)
    config = LlmRuntimeConfig(8, 2, 1, 8, 16, 32, layer_kinds=kinds)
    state = PooledState(BlockPool(32), config, recurrent=RecurrentStates())
    assert state.kinds == kinds and not state.cuts_back
    assert PooledState(BlockPool(32), LlmRuntimeConfig(8, 2, 1, 8, 16, 32)).cuts_back


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_layer_of_todays_families_is_full_attention(zoo, backend):
    model = zoo.ferrum("qwen3", backend)
    assert model.config.layer_kinds == (FULL_ATTENTION,) * model.config.num_layers
    assert model.state.kinds == model.config.layer_kinds


@pytest.fixture(params=BACKENDS)
def fresh_model(request, zoo):
    """A tiny Llama of its own: its pool and prefix cache start empty."""
    return ferrum_mac.open_model(zoo.path("llama"), backend=request.param, dtype="float32")


def test_reuse_remember_truncate_and_release_go_through_the_manager(fresh_model):
    model, state = fresh_model, fresh_model.state
    prompt = random_tokens(2 * B + 7, seed=20)
    model.prefill("a", prompt)
    state.remember("a", prompt)
    assert state.length("a") == len(prompt) == state.used_tokens()
    assert state.allocated_tokens() >= state.tokens_for([len(prompt)]) - B

    found = state.reuse("b", prompt)
    assert (found.tokens, found.cached) == (len(prompt) - 1, len(prompt) - 1)
    assert state.prefix_stats().hits == 1

    model.truncate_kv("b", B)  # the model's truncate is the manager's
    assert state.length("b") == B
    state.truncate("b", 3)
    assert state.length("b") == 3
    model.release("a")
    state.release("b")
    assert state.length("a") == state.length("b") == state.used_tokens() == 0
    assert state.prefix_stats().cached_tokens >= 2 * B  # released, the remembered blocks stay cached
