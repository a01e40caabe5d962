"""`DecoderOnlyLLM` invariants on every installed backend (MLX, torch), for every family in
`FAMILY_FACTORIES`.

Each test compares two routes to the same numbers (fp32 both ways), so the only slack
is summation order: results agree to ~1e-6 of the logits' range; we allow 1e-5.
"""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest

import ferrum_mac
from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS
from ferrum_mac.errors import CacheStateError, FerrumError, KvCapacityError
from ferrum_mac.llm import KV_CAPACITY_ENV, DecodeItem, ForwardItem
import helpers
from helpers import BACKENDS, FAMILIES, argmax, device_array, random_tokens, to_np

REL = 1e-5
_ids = itertools.count()


def assert_close(got, want, rel: float = REL, what: str = "logits") -> None:
    helpers.assert_close(got, want, rel, what)


def fresh_id(tag: str = "c") -> str:
    return f"{tag}-{next(_ids)}"


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def model(zoo, family, backend):
    return zoo.ferrum(family, backend)


def backend_module(model, name: str):
    """The module `name` (runtime, kv, ...) of the backend `model` runs on."""
    package = type(model).__module__.rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.{name}")


def reference(model, tokens) -> np.ndarray:
    """Every position's logits of `tokens`, from one forward on a fresh cache (the prefill's
    route: a backend may run a short verify as decode rows, `verify_rows`)."""
    cid = fresh_id("ref")
    with pytest.MonkeyPatch.context() as patch:
        if hasattr(model, "verify_rows"):
            patch.setattr(model, "verify_rows", 0)
        out = to_np(model.forward_verify(cid, tokens))
    model.release(cid)
    return out


def test_prefill_whole_equals_prefix_then_decodes(model):
    tokens = random_tokens(12, seed=1)
    ref = reference(model, tokens)
    whole = fresh_id()
    assert_close(model.prefill(whole, tokens), ref[-1])
    assert model.state.length(whole) == 12

    split = fresh_id()
    assert_close(model.prefill(split, tokens[:5]), ref[4])
    for pos in range(5, 12):
        assert_close(model.decode(split, tokens[pos], pos), ref[pos], REL, f"decode at {pos}")
    assert model.state.length(split) == 12

    chunks = fresh_id()  # prefill continues a cache that already holds tokens
    model.prefill(chunks, tokens[:3])
    model.prefill(chunks, tokens[3:7])
    assert_close(model.prefill(chunks, tokens[7:]), ref[-1])
    for cid in (whole, split, chunks):
        model.release(cid)


def test_backends_share_one_bookkeeping(model):
    """The slot bookkeeping, chunked prefill, rows of a mixed batch and input checks are
    `PooledLLM`'s alone: a backend that wrote its own would drift from the other."""
    from ferrum_mac.backends.state.pooled_llm import PooledLLM

    assert isinstance(model, PooledLLM)
    shared = (
        "prefill",
        "decode",
        "decode_batch",
        "forward_verify",
        "unified_forward",
        "_forward",
        "release",
        "truncate_kv",
    )
    assert not [name for name in shared if name in vars(type(model))]


def test_long_prefill_in_chunks_equals_one_forward(model, monkeypatch):
    tokens = random_tokens(23, seed=2)
    ref = reference(model, tokens)
    for chunk in (4, 11, 22, 23):
        monkeypatch.setattr(model, "prefill_chunk", chunk)
        cid = fresh_id()
        assert_close(model.prefill(cid, tokens), ref[-1], REL, f"chunk {chunk}")
        assert model.state.length(cid) == 23
        assert_close(model.decode(cid, 7, 23), reference(model, tokens + [7])[-1], REL, f"decode after chunk {chunk}")
        model.release(cid)


def test_cache_growth_keeps_history(model):
    """Decoding across block boundaries and the KV buffers' growth, and preparing a larger
    cache, keep every key."""
    n = 8 * BLOCK_TOKENS  # past the buffers' first size (GROW_BLOCKS blocks, scratch included)
    tokens = random_tokens(n + 6, seed=3)
    ref = reference(model, tokens)
    cid = fresh_id()
    model.prefill(cid, tokens[: n - 3])
    for pos in range(n - 3, len(tokens)):
        assert_close(model.decode(cid, tokens[pos], pos), ref[pos], REL, f"decode at {pos}")
    model.release(cid)

    grown = fresh_id()
    model.prefill(grown, tokens[:40])
    model.prepare(grown, 3 * n)  # grows the buffers under the live cache
    assert model.state.length(grown) == 40
    assert_close(model.decode(grown, tokens[40], 40), ref[40])
    model.release(grown)


def test_decode_batch_equals_sequential_decodes(model):
    lengths = [3, 9, 1, 14]
    prompts = [random_tokens(n, seed=10 + i) for i, n in enumerate(lengths)]
    batched = [fresh_id("b") for _ in prompts]
    single = [fresh_id("s") for _ in prompts]
    for b, s, p in zip(batched, single, prompts):
        model.prefill(b, p)
        model.prefill(s, p)
    nexts = [random_tokens(3, seed=20 + i) for i in range(len(prompts))]
    for step in range(3):
        order = [3, 0, 2, 1] if step % 2 else [0, 1, 2, 3]  # item order is the caller's
        items = [DecodeItem(batched[i], nexts[i][step], lengths[i] + step) for i in order]
        out = model.decode_batch(items)
        assert out.shape == (len(items), model.config.vocab_size)
        for row, i in enumerate(order):
            want = model.decode(single[i], nexts[i][step], lengths[i] + step)
            assert_close(out[row], want, REL, f"step {step}, sequence {i}")
    for b, n in zip(batched, lengths):
        assert model.state.length(b) == n + 3
        model.release(b)
    for s in single:
        model.release(s)


def test_decode_batch_with_one_new_sequence(model):
    """A sequence with no cache yet joins a batch at position 0."""
    old, new = fresh_id(), fresh_id()
    prompt = random_tokens(6, seed=4)
    model.prefill(old, prompt)
    out = model.decode_batch([DecodeItem(old, 5, 6), DecodeItem(new, 9, 0)])
    assert_close(out[0], reference(model, prompt + [5])[-1])
    assert_close(out[1], reference(model, [9])[-1])
    model.release(old)
    model.release(new)


def test_forward_verify_equals_decode_loop(model):
    prompt, draft = random_tokens(7, seed=5), random_tokens(5, seed=6)
    verify, loop = fresh_id(), fresh_id()
    model.prefill(verify, prompt)
    last = model.prefill(loop, prompt)
    rows = model.forward_verify(verify, draft)
    assert rows.shape == (5, model.config.vocab_size)
    assert model.state.length(verify) == 12
    for i, tok in enumerate(draft):
        assert_close(rows[i], model.decode(loop, tok, 7 + i), REL, f"draft position {i}")
    # and the cache it leaves decodes on like the loop's
    assert_close(model.decode(verify, 3, 12), model.decode(loop, 3, 12))
    assert last.shape == (model.config.vocab_size,)
    model.release(verify)
    model.release(loop)


def test_verify_batch_equals_each_alone(model):
    """Two verifies and a decode step in one call give each one's own logits, and leave each
    cache as its own call would."""
    prompts = [random_tokens(9, seed=11), random_tokens(40, seed=12), random_tokens(3, seed=13)]
    guesses = [random_tokens(4, seed=14), random_tokens(6, seed=15), [7]]
    batched, alone = [fresh_id() for _ in prompts], [fresh_id() for _ in prompts]
    for b, a, prompt in zip(batched, alone, prompts):
        model.prefill(b, prompt)
        model.prefill(a, prompt)
    items = [ForwardItem(b, g, len(p)) for b, g, p in zip(batched, guesses, prompts)]
    rows = model.verify_batch(items)
    for cid, prompt, guess, got in zip(alone, prompts, guesses, rows):
        assert got.shape == (len(guess), model.config.vocab_size)
        assert_close(got, reference(model, prompt + guess)[len(prompt) :])
        assert model.state.length(batched[alone.index(cid)]) == len(prompt) + len(guess)
    for b, a, p, g in zip(batched, alone, prompts, guesses):
        model.forward_verify(a, g)
        assert_close(model.decode(b, 5, len(p) + len(g)), model.decode(a, 5, len(p) + len(g)))
        model.release(b)
        model.release(a)


def test_truncate_then_redecode_reproduces_logits(model):
    prompt = random_tokens(10, seed=7)
    cid = fresh_id()
    model.prefill(cid, prompt)
    first = to_np(model.decode(cid, 11, 10))
    second = to_np(model.decode(cid, 12, 11))
    model.truncate_kv(cid, 10)
    assert model.state.length(cid) == 10
    assert_close(model.decode(cid, 11, 10), first)
    assert_close(model.decode(cid, 12, 11), second)
    # a different continuation after truncating into the prompt (speculative rejection)
    model.truncate_kv(cid, 4)
    assert model.state.length(cid) == 4
    assert_close(model.decode(cid, 13, 4), reference(model, prompt[:4] + [13])[-1])
    model.truncate_kv(cid, 100)  # never grows
    assert model.state.length(cid) == 5
    with pytest.raises(CacheStateError):
        model.truncate_kv(cid, -1)
    model.truncate_kv(cid, 0)
    assert model.state.length(cid) == 0
    assert_close(model.prefill(cid, prompt), reference(model, prompt)[-1])
    model.release(cid)


def test_kv_capacity_overflow_changes_nothing(zoo, family, backend):
    from ferrum_mac.backends import open_path

    prompt = random_tokens(17, seed=8)
    ref = reference(zoo.ferrum(family, backend), prompt)  # an uncapped model's logits
    model = open_path(zoo.path(family), backend=backend, dtype="float32", kv_capacity=16)
    assert model.kv_capacity() == 16

    with pytest.raises(KvCapacityError) as err:
        model.prefill("a", prompt)  # 17 > 16
    assert (err.value.needed, err.value.capacity) == (17, 16) and model.state.length("a") == 0

    model.prefill("a", prompt[:10])
    for call in (
        lambda: model.prefill("a", prompt[10:17]),
        lambda: model.forward_verify("a", prompt[10:17]),
        lambda: model.unified_forward([ForwardItem("a", prompt[10:17], 10)]),
    ):
        with pytest.raises(KvCapacityError):
            call()
        assert model.state.length("a") == 10
    assert_close(model.decode("a", prompt[10], 10), ref[10])
    model.prefill("a", prompt[11:16])
    assert model.state.length("a") == 16

    model.prefill("b", prompt[:3])
    with pytest.raises(KvCapacityError):  # one item over capacity fails the whole batch
        model.decode_batch([DecodeItem("b", prompt[3], 3), DecodeItem("a", 5, 16)])
    with pytest.raises(KvCapacityError):
        model.decode("a", 5, 16)
    assert (model.state.length("a"), model.state.length("b")) == (16, 3)
    assert_close(model.decode("b", prompt[3], 3), ref[3])
    model.truncate_kv("a", 15)
    assert_close(model.decode("a", prompt[15], 15), ref[15])


def test_kv_capacity_env_is_validated(zoo, backend, monkeypatch):
    monkeypatch.setenv(KV_CAPACITY_ENV, "lots")
    with pytest.raises(FerrumError) as err:
        ferrum_mac.open_model(zoo.path("llama"), backend=backend, dtype="float32")
    assert KV_CAPACITY_ENV in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setenv(KV_CAPACITY_ENV, "100000000")  # clamped to the model's maximum
    assert ferrum_mac.open_model(zoo.path("llama"), backend=backend, dtype="float32").kv_capacity() == 1024


def test_kv_capacity_parameter_is_clamped_and_checked(zoo, backend, monkeypatch):
    from ferrum_mac.backends import open_path

    monkeypatch.delenv(KV_CAPACITY_ENV, raising=False)
    path = zoo.path("llama")
    assert open_path(path, backend=backend, dtype="float32", kv_capacity=16).kv_capacity() == 16
    assert open_path(path, backend=backend, dtype="float32", kv_capacity=100_000_000).kv_capacity() == 1024
    assert open_path(path, backend=backend, dtype="float32").kv_capacity() == 1024
    for bad in (0, -5):
        with pytest.raises(FerrumError) as err:
            open_path(path, backend=backend, dtype="float32", kv_capacity=bad)
        assert "positive" in str(err.value) and "\n" not in str(err.value)


def test_release_then_reuse_starts_clean(model):
    long, short = random_tokens(30, seed=9), random_tokens(6, seed=10)
    cid = fresh_id()
    model.prefill(cid, long)
    model.release(cid)
    assert model.state.length(cid) == 0
    model.release(cid)  # idempotent
    model.release("never-seen")
    assert_close(model.prefill(cid, short), reference(model, short)[-1])
    assert model.state.length(cid) == 6
    # a released cache goes to the pool; whoever takes it next sees none of its keys
    model.release(cid)
    other = fresh_id()
    assert_close(model.prefill(other, short[:2]), reference(model, short[:2])[-1])
    assert_close(model.decode(other, short[2], 2), reference(model, short[:3])[-1])
    model.release(other)


def test_reset_drops_every_cache(zoo, family, backend):
    model = ferrum_mac.open_model(zoo.path(family), backend=backend, dtype="float32")
    model.prefill("a", [5, 6, 7])
    model.prefill("b", [8])
    model.reset()
    assert model.state.length("a") == model.state.length("b") == 0
    assert_close(model.prefill("a", [9, 10]), reference(model, [9, 10])[-1])


def test_unified_forward_equals_split_path(model):
    a_prompt, b_prompt = random_tokens(5, seed=11), random_tokens(8, seed=12)
    c_prompt, d_prompt = random_tokens(9, seed=13), random_tokens(4, seed=14)
    u = {k: fresh_id("u" + k) for k in "abcd"}
    s = {k: fresh_id("s" + k) for k in "abcd"}
    for ids in (u, s):
        model.prefill(ids["a"], a_prompt)
        model.prefill(ids["b"], b_prompt)

    out = model.unified_forward(
        [
            ForwardItem(u["a"], [21], 5),  # decode
            ForwardItem(u["c"], c_prompt[:4], 0, is_final=False),  # first chunk of a new prompt
            ForwardItem(u["b"], [22], 8),  # decode
            ForwardItem(u["d"], d_prompt, 0),  # a whole short prompt
        ]
    )
    assert out[1] is None and all(o is not None for o in (out[0], out[2], out[3]))
    assert [model.state.length(u[k]) for k in "abcd"] == [6, 9, 4, 4]
    assert_close(out[0], model.decode(s["a"], 21, 5))
    assert_close(out[2], model.decode(s["b"], 22, 8))
    assert_close(out[3], model.prefill(s["d"], d_prompt))

    out = model.unified_forward(
        [
            ForwardItem(u["c"], c_prompt[4:7], 4, is_final=False),  # middle chunk
            ForwardItem(u["d"], [23], 4),
        ]
    )
    assert out[0] is None
    assert_close(out[1], model.decode(s["d"], 23, 4))
    out = model.unified_forward([ForwardItem(u["c"], c_prompt[7:], 7), ForwardItem(u["a"], [24], 6)])
    assert_close(out[0], model.prefill(s["c"], c_prompt))
    assert_close(out[1], model.decode(s["a"], 24, 6))
    assert model.unified_forward([ForwardItem(u["b"], [25, 26], 9, is_final=False)]) == [None]
    assert model.state.length(u["b"]) == 11
    e_prompt = random_tokens(6, seed=15)
    u["e"], s["e"] = fresh_id("ue"), fresh_id("se")
    out = model.unified_forward(  # decode rows first, as the scheduler orders them
        [ForwardItem(u["a"], [27], 7), ForwardItem(u["d"], [28], 5), ForwardItem(u["e"], e_prompt, 0)]
    )
    assert_close(out[0], model.decode(s["a"], 27, 7))
    assert_close(out[1], model.decode(s["d"], 28, 5))
    assert_close(out[2], model.prefill(s["e"], e_prompt))
    for ids in (u, s):
        for cid in ids.values():
            model.release(cid)


def test_prepare_changes_no_logits(model):
    prompt = random_tokens(9, seed=15)
    ref = reference(model, prompt + [4])
    cid = fresh_id()
    model.prepare(cid, 64)
    assert model.state.length(cid) == 0
    assert_close(model.prefill(cid, prompt), ref[8])
    assert_close(model.decode(cid, 4, 9), ref[9])
    model.prepare(cid, 600)  # on a live sequence: grows, keeps its tokens
    assert model.state.length(cid) == 10
    assert_close(model.decode(cid, 4, 10), reference(model, prompt + [4, 4])[-1])
    model.release(cid)


def test_decode_with_wrong_pos_raises_and_changes_nothing(model):
    prompt = random_tokens(5, seed=16)
    cid = fresh_id()
    model.prefill(cid, prompt)
    for pos in (3, 6, 0):
        with pytest.raises(CacheStateError) as err:
            model.decode(cid, 8, pos)
        assert "\n" not in str(err.value)
        assert model.state.length(cid) == 5
    other = fresh_id()
    model.prefill(other, prompt[:2])
    with pytest.raises(CacheStateError):  # one bad item fails the batch before any change
        model.decode_batch([DecodeItem(other, 1, 2), DecodeItem(cid, 8, 4)])
    with pytest.raises(CacheStateError):  # the same sequence twice in one batch
        model.decode_batch([DecodeItem(other, 1, 2), DecodeItem(other, 1, 2)])
    with pytest.raises(CacheStateError):
        model.unified_forward([ForwardItem(other, [1], 2), ForwardItem(cid, [8], 9)])
    with pytest.raises(CacheStateError):
        model.decode(fresh_id(), 8, 3)  # an unknown sequence starts at 0
    assert (model.state.length(cid), model.state.length(other)) == (5, 2)
    assert_close(model.decode(cid, 8, 5), reference(model, prompt + [8])[-1])
    assert_close(model.decode(other, 1, 2), reference(model, prompt[:2] + [1])[-1])
    with pytest.raises(FerrumError):
        model.prefill(cid, [])
    model.release(cid)
    model.release(other)


def test_decode_accepts_a_lazy_token(model):
    prompt = random_tokens(6, seed=17)
    lazy_id, int_id = fresh_id(), fresh_id()
    logits = model.prefill(lazy_id, prompt)
    token = argmax(logits)  # not evaluated: decode must queue behind it
    nxt = model.decode(lazy_id, token, 6)
    model.prefill(int_id, prompt)
    want = model.decode(int_id, int(argmax(logits)), 6)
    assert_close(nxt, want)
    # a chain of lazy steps, read only at the end (the overlapped generation loop)
    tokens = []
    for pos in range(7, 10):
        token = argmax(nxt)
        tokens.append(token)
        nxt = model.decode(lazy_id, token, pos)
    helpers.evaluate(nxt)
    ids = [int(t) for t in tokens]
    for pos, tok in zip(range(7, 10), ids):
        want = model.decode(int_id, tok, pos)
    assert_close(nxt, want)
    # lazy tokens in a batch, as 0-d and 1-element arrays
    out = model.decode_batch(
        [DecodeItem(lazy_id, device_array(nxt, 3), 10), DecodeItem(int_id, device_array(nxt, [3]), 10)]
    )
    assert_close(out[0], out[1])
    # and host-side ids of numpy's integer types (what np.argmax returns)
    assert_close(model.decode(lazy_id, np.int64(4), 11), model.decode(int_id, 4, 11))
    model.release(lazy_id)
    model.release(int_id)


def test_logits_stay_on_device(model, backend):
    cid = fresh_id()
    assert helpers.is_backend_array(model.prefill(cid, [4, 5]), backend)
    assert helpers.is_backend_array(model.decode(cid, 6, 2), backend)
    model.release(cid)
