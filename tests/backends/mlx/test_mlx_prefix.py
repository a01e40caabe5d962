"""The prefix cache on MLX: greedy output with it equals output without it (real weights and
the MoE family), reuse after remember, shared blocks held once, and attention through block
tables that are not consecutive (scattered writes, gathered reads, batched decode)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import ferrum_mac
from ferrum_mac.backends.block_pool import BLOCK_TOKENS as B
from ferrum_mac.llm import MISS_NO_PREFIX, DecodeItem
from helpers import ASSETS, argmax, assert_close, assert_same_tokens, random_tokens, to_np

REL = 1e-5


def greedy(model, cache_id: str, prompt: list[int], n: int, reuse: bool) -> tuple[list[int], int]:
    """`n` greedy tokens after `prompt`, starting from the prefix cache when `reuse`; the
    sequence is remembered and released after. Returns (tokens, tokens reused)."""
    found = model.kv_reuse(cache_id, prompt).tokens if reuse else 0
    logits = model.prefill(cache_id, prompt[found:])
    out, pos = [], len(prompt)
    for step in range(n):
        out.append(int(argmax(logits)))
        if step + 1 < n:
            logits = model.decode(cache_id, out[-1], pos)
            pos += 1
    if reuse:
        model.kv_remember(cache_id, prompt + out)
    model.release(cache_id)
    return out, found


def reference_logits(model, tokens: list[int]) -> np.ndarray:
    """Every position's logits of `tokens` from one forward on a fresh cache (nothing reused)."""
    out = to_np(model.forward_verify("reference", tokens))
    model.release("reference")
    return out


# -- greedy equality on real weights and every family ---------------------------------


@pytest.fixture(
    params=["stories260K", pytest.param("smollm2", marks=[pytest.mark.real_model, pytest.mark.slow]), "qwen3_moe"]
)
def real_model(request, zoo):
    if request.param == "stories260K":
        folder = ASSETS / "stories260K"
        if not (folder / "model.safetensors").is_file():
            pytest.skip("stories260K is not in the shared assets")
        return ferrum_mac.open_model(folder, backend="mlx")
    if request.param == "smollm2":
        return ferrum_mac.open_model(request.getfixturevalue("smollm2_gguf"), backend="mlx", dtype="float32")
    return ferrum_mac.open_model(zoo.path("qwen3_moe"), backend="mlx", dtype="float32")


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
    stats = model.kv_prefix_stats()
    assert stats.hits == 4 and stats.reused_tokens > 4 * len(system)


# -- reuse and sharing, on the tiny Llama ------------------------------------------------


@pytest.fixture
def fresh_model(zoo):
    """A tiny Llama of its own: its pool and prefix cache start empty."""
    return ferrum_mac.open_model(zoo.path("llama"), backend="mlx", dtype="float32")


def test_reuse_after_remember_reuses_all_but_the_last_token(fresh_model):
    model = fresh_model
    prompt = random_tokens(2 * B + 7, seed=10)
    model.prefill("a", prompt)
    model.kv_remember("a", prompt)
    model.release("a")

    found = model.kv_reuse("b", prompt)
    assert (found.tokens, found.cached, found.miss) == (len(prompt) - 1, len(prompt) - 1, None)
    assert model.kv_len("b") == len(prompt) - 1
    ref = reference_logits(model, prompt + [5])
    assert_close(model.prefill("b", prompt[-1:]), ref[-2], REL)
    assert_close(model.decode("b", 5, len(prompt)), ref[-1], REL)

    fresh = model.kv_reuse("c", random_tokens(50, seed=11))
    assert (fresh.tokens, fresh.cached, fresh.miss) == (0, 0, MISS_NO_PREFIX)


def test_sequences_sharing_a_prefix_hold_its_full_blocks_once(fresh_model):
    """Eight requests in flight on one 6-block system prompt: the prefix's blocks are held
    once, so the buffers hold fewer tokens than the sequences have cached together."""
    model = fresh_model
    system = random_tokens(6 * B, seed=20)
    prompts = [system + [100 + i] + random_tokens(9, seed=30 + i) for i in range(8)]  # each its own from 192 on
    for i, prompt in enumerate(prompts):
        found = model.kv_reuse(f"s{i}", prompt)
        assert found.tokens == (0 if i == 0 else len(system))
        model.prefill(f"s{i}", prompt[found.tokens :])
        model.kv_remember(f"s{i}", prompt)
    used = model.kv_used_tokens()
    assert used == 8 * (len(system) + 10)
    held_blocks = 6 + 8  # the shared prefix, then one block of its own each
    assert model.kv_allocated_tokens() <= (held_blocks + 8) * B  # (the buffers grow by 8 blocks at least)
    assert model.kv_allocated_tokens() < used // 3
    for i, prompt in enumerate(prompts):
        assert_close(model.decode(f"s{i}", 7, len(prompt)), reference_logits(model, prompt + [7])[-1], REL, f"s{i}")
    for i in range(8):
        model.release(f"s{i}")


def kernel_on_the_cpu(q, keys, values, tables, positions, scale, longest=None, block_tokens=B):
    """What `cuda_attention.decode_attention` computes, in MLX ops: each row attends the keys
    its block table names, up to its position."""
    kernel_on_the_cpu.calls += 1
    out = []
    for b, (table, p) in enumerate(zip(tables.tolist(), positions.tolist())):
        rows = mx.array([table[t // block_tokens] * block_tokens + t % block_tokens for t in range(p + 1)])
        k, v = keys[:, :, rows], values[:, :, rows]
        out.append(mx.fast.scaled_dot_product_attention(q[b : b + 1, :, None, :], k, v, scale=scale)[0, :, 0])
    return mx.stack(out)


@pytest.fixture(params=["gather", "kernel"])
def attention_route(request, monkeypatch):
    """How decode rows attend: keys gathered under a mask (Metal, CPU), or the CUDA kernel's
    route through block tables (here with the kernel computed by MLX ops on the CPU)."""
    from ferrum_mac.backends.mlx import cuda_attention

    monkeypatch.setattr(cuda_attention, "decode_attention", kernel_on_the_cpu)
    kernel_on_the_cpu.calls = 0
    return request.param


def test_batched_decode_over_scattered_blocks_equals_each_alone(zoo, attention_route):
    """Sequences that grow together take turns at the free blocks, so their tables interleave
    (and two share a prefix): the batched write and read, a lone decode and a prefill that
    continue such a table all give the logits of a fresh forward."""
    model = ferrum_mac.open_model(zoo.path("llama"), backend="mlx", dtype="float32")
    for block in model.model.layers:
        block.attn.by_length = attention_route == "kernel"
    history = {f"s{i}": random_tokens(B - 2 + i, seed=40 + i) for i in range(3)}
    for cid, prompt in history.items():
        model.prefill(cid, prompt)
    for step in range(2 * B):
        if step == 6:  # s0 holds B + 4 tokens: t shares its first block and copies 3 rows of its second
            model.kv_remember("s0", history["s0"])
            history["t"] = history["s0"][: B + 3] + [9]
            found = model.kv_reuse("t", history["t"])
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
    assert (kernel_on_the_cpu.calls > 0) == (attention_route == "kernel")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_read_to_the_host_write_back_the_same(zoo, dtype):
    """The disk tier's hooks: a host copy of blocks (bfloat16 as its bits) written into other
    blocks holds the same keys and values."""
    model = ferrum_mac.open_model(zoo.path("llama"), backend="mlx", dtype=dtype)
    model.prefill("a", random_tokens(2 * B, seed=50))
    kv, seq = model.kv, model.kv.get("a")
    array = kv._read_blocks(seq.blocks)
    c = model.config
    assert array.shape == (c.num_layers, 2, c.num_kv_heads, 2 * B, c.head_dim)
    assert array.dtype == (np.uint16 if dtype == "bfloat16" else np.float32)
    assert np.abs(array.astype(np.float32)).sum() > 0
    copy = [kv._take_block(), kv._take_block()]
    kv._write_blocks(copy, array)
    assert np.array_equal(kv._read_blocks(copy), array)
    assert not np.array_equal(kv._read_blocks(copy[::-1]), array)


def test_a_single_sequence_decode_reads_a_slice_of_the_pool(fresh_model):
    """One sequence's blocks are consecutive: its decode writes and reads slices of the
    token axis (no gather), as the dense cache did."""
    model = fresh_model
    model.prefill("a", random_tokens(3 * B + 4, seed=60))
    seq = model.kv.get("a")
    write, read = seq.rows(seq.length, seq.length + 1), seq.rows(0, seq.length + 1)
    assert isinstance(write, slice) and isinstance(read, slice)
    mx.eval(model.decode("a", 3, seq.length))
