"""The prefix cache on both backends: greedy output with it equals output without it (real
weights and every family), reuse after remember, and shared blocks held once. Each backend's
own file tests what only it has (attention through block tables, host copies, shrinking)."""

from __future__ import annotations

import pytest

import ferrum_mac
from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS as B
from ferrum_mac.llm import MISS_NO_PREFIX, DecodeItem
from helpers import ASSETS, BACKENDS, assert_close, assert_same_tokens, random_tokens
from prefix_support import REL, greedy, reference_logits

SLOW_REAL = [pytest.mark.real_model, pytest.mark.slow]
FAMILIES = {  # the tiny checkpoints each backend's tests use
    "mlx": ["qwen3_moe"],
    "torch": ["llama", "qwen3", "qwen3_moe"],
}


# -- greedy equality on real weights and every family ---------------------------------


@pytest.fixture(
    params=[
        pytest.param((backend, name), marks=SLOW_REAL if name == "smollm2" else [], id=f"{backend}-{name}")
        for backend in BACKENDS
        for name in ["stories260K", "smollm2", *FAMILIES[backend]]
    ]
)
def real_model(request, zoo):
    """stories260K and SmolLM2 (real weights), and the tiny checkpoints of each backend's tests."""
    backend, name = request.param
    if name == "stories260K":
        folder = ASSETS / "stories260K"
        if not (folder / "model.safetensors").is_file():
            pytest.skip("stories260K is not in the shared assets")
        return ferrum_mac.open_model(folder, backend=backend)
    if name == "smollm2":
        return ferrum_mac.open_model(request.getfixturevalue("smollm2_gguf"), backend=backend, dtype="float32")
    return ferrum_mac.open_model(zoo.path(name), backend=backend, dtype="float32")


def test_greedy_output_with_the_prefix_cache_equals_without(real_model):
    """A conversation's turns, a regenerate, an edit inside a block and a new conversation
    with the same system prompt: each reuses what was cached and answers as a cold run does."""
    model, n = real_model, 8
    vocab = min(model.config.vocab_size, 4000)
    system = random_tokens(3 * B + 5, seed=1, vocab=vocab)
    turn1 = system + random_tokens(20, seed=2, vocab=vocab)
    answer1, found = greedy(model, "turn1", turn1, n, reuse=True)
    assert found == 0
    turn2 = turn1 + answer1 + random_tokens(30, seed=3, vocab=vocab)
    edited = turn1[: 3 * B + 12] + random_tokens(40, seed=4, vocab=vocab)  # differs inside a block
    other = system + random_tokens(25, seed=5, vocab=vocab)
    for name, prompt, at_least in (
        ("turn2", turn2, len(turn1) + n - 1),
        ("regenerate", turn1, len(turn1) - 1),
        ("edited", edited, 3 * B + 12),
        ("other", other, len(system)),
    ):
        cached, found = greedy(model, name, prompt, n, reuse=True)
        cold, _ = greedy(model, f"{name}-cold", prompt, n, reuse=False)
        assert found >= at_least, name
        assert_same_tokens(cached, cold)
    stats = model.state.prefix_stats()
    assert stats.hits == 4 and stats.reused_tokens > 4 * len(system)


# -- reuse and sharing, on the tiny Llama ------------------------------------------------


@pytest.fixture(params=BACKENDS)
def fresh_model(request, zoo):
    """A tiny Llama of its own: its pool and prefix cache start empty."""
    return ferrum_mac.open_model(zoo.path("llama"), backend=request.param, dtype="float32")


def test_reuse_after_remember_reuses_all_but_the_last_token(fresh_model):
    model = fresh_model
    prompt = random_tokens(2 * B + 7, seed=10)
    model.prefill("a", prompt)
    model.state.remember("a", prompt)
    model.release("a")

    found = model.state.reuse("b", prompt)
    assert (found.tokens, found.cached, found.miss) == (len(prompt) - 1, len(prompt) - 1, None)
    assert model.state.length("b") == len(prompt) - 1
    ref = reference_logits(model, prompt + [5])
    assert_close(model.prefill("b", prompt[-1:]), ref[-2], REL)
    assert_close(model.decode("b", 5, len(prompt)), ref[-1], REL)

    fresh = model.state.reuse("c", random_tokens(50, seed=11))
    assert (fresh.tokens, fresh.cached, fresh.miss) == (0, 0, MISS_NO_PREFIX)


def test_sequences_sharing_a_prefix_hold_its_full_blocks_once(fresh_model):
    """Eight requests in flight on one 6-block system prompt: the prefix's blocks are held
    once, so the buffers hold fewer tokens than the sequences have cached together."""
    model = fresh_model
    system = random_tokens(6 * B, seed=20)
    prompts = [system + [100 + i] + random_tokens(9, seed=30 + i) for i in range(8)]  # each its own from 192 on
    for i, prompt in enumerate(prompts):
        found = model.state.reuse(f"s{i}", prompt)
        assert found.tokens == (0 if i == 0 else len(system))
        model.prefill(f"s{i}", prompt[found.tokens :])
        model.state.remember(f"s{i}", prompt)
    used = model.state.used_tokens()
    assert used == 8 * (len(system) + 10)
    held_blocks = 6 + 8  # the shared prefix, then one block of its own each
    assert model.state.allocated_tokens() <= (held_blocks + 8) * B  # (the buffers grow by 8 blocks at least)
    assert model.state.allocated_tokens() < used // 3
    out = model.decode_batch([DecodeItem(f"s{i}", 7, len(p)) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert_close(out[i], reference_logits(model, prompt + [7])[-1], REL, f"s{i}")
    for i in range(8):
        model.release(f"s{i}")
