"""The prefix cache on MLX: greedy output with it equals output without it (real weights and
the MoE family), reuse after remember, shared blocks held once, and attention through block
tables that are not consecutive (scattered writes, gathered reads, batched decode)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import ferrum_mac
from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS as B
from ferrum_mac.backends.mlx.cpu.ops import CpuOps
from ferrum_mac.backends.mlx.cuda.ops import CudaOps
from ferrum_mac.backends.mlx.ops import Ops
from ferrum_mac.backends.options import BackendOptions
from ferrum_mac.llm import DecodeItem
from helpers import assert_close, open_mlx, random_tokens
from prefix_support import REL, reference_logits


@pytest.fixture
def fresh_model(zoo):
    """A tiny Llama of its own: its pool and prefix cache start empty."""
    return ferrum_mac.open_model(zoo.path("llama"), backend="mlx", dtype="float32")


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


class KernelOnTheCpu(CudaOps):
    """CUDA's routes, the decode-attention kernel taking the tiny model's heads (the heads
    kernel off: it has no stand-in here)."""

    def __init__(self):
        super().__init__(BackendOptions(cuda_heads=False))

    def decode_kernel_takes(self, attn) -> bool:
        return True


def cuda_on_the_cpu(monkeypatch) -> CudaOps:
    """CUDA's routes with the decode-attention kernel computed by MLX ops on the CPU."""
    from ferrum_mac.backends.mlx.cuda import attention as cuda_attention

    monkeypatch.setattr(cuda_attention, "decode_attention", kernel_on_the_cpu)
    kernel_on_the_cpu.calls = 0
    return KernelOnTheCpu()


@pytest.fixture(params=["gather", "kernel"])
def attention_route(request, monkeypatch):
    """How decode rows attend: keys gathered under a mask (Metal, CPU), or the CUDA kernel's
    route through block tables (here with the kernel computed by MLX ops on the CPU)."""
    kernel_on_the_cpu.calls = 0
    ops = cuda_on_the_cpu(monkeypatch) if request.param == "kernel" else Ops()
    return request.param, ops


def test_batched_decode_over_scattered_blocks_equals_each_alone(zoo, attention_route):
    """Sequences that grow together take turns at the free blocks, so their tables interleave
    (and two share a prefix): the batched write and read, a lone decode and a prefill that
    continue such a table all give the logits of a fresh forward."""
    attention_route, ops = attention_route
    model = open_mlx(zoo.path("llama"), ops)
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


def test_a_lone_sequence_on_cuda_reads_its_keys_in_place(zoo, monkeypatch):
    """On CUDA a lone sequence's one-token step hands MLX's attention its keys as a slice of
    the pool, up to the table kernel's length. MLX 0.32 would read such a slice from its
    buffer's row 0 were the buffer's token axis a multiple of 256 (`kv.SPARE_ROWS`), so no
    buffer's is; scattered rows take the table kernel from `cuda.ops.GATHER_KEYS` keys."""
    ops = cuda_on_the_cpu(monkeypatch)
    ops.table_kernel_keys = 300
    model = open_mlx(zoo.path("llama"), ops)
    history = random_tokens(290, seed=62)
    model.prefill("a", history)
    for step in range(12):  # 291 .. 302 keys: in place, then through the table from 300
        token = random_tokens(1, seed=200 + step)[0]
        got = model.decode("a", token, len(history))
        history.append(token)
        if step in (0, 8, 11):
            assert_close(got, reference_logits(model, history)[-1], REL, f"step {step}")
        assert (kernel_on_the_cpu.calls > 0) == (len(history) >= 300), len(history)
    for tokens in (256 - 2 * B, 512, 2048):
        model.prepare(f"grow{tokens}", tokens)
        assert model.kv.keys[0].shape[2] % 256 != 0, model.kv.keys[0].shape


def test_padded_attention_of_cuda_equals_the_causal_one(zoo, monkeypatch):
    """On CUDA a segment of several tokens attends at padded lengths under a mask (so MLX
    builds few cuDNN graphs): the logits of a fresh prompt, of a chunk after consecutive
    blocks, of one after scattered blocks and of a verify equal the causal attention's,
    whether the padded keys are a longer slice of the pool or gathered past its end."""
    routes = []

    class Recording(CudaOps):
        def attend_padded(self, attn, q, k, v, seg):
            routes.append(type(seg.padded_read_rows).__name__)
            return super().attend_padded(attn, q, k, v, seg)

    def run(padded: bool) -> list[np.ndarray]:
        ops = Recording(BackendOptions(cuda_attention=False, cuda_heads=False)) if padded else Ops()
        model = open_mlx(zoo.path("llama"), ops)
        model.prefill("long", random_tokens(300, seed=70))  # the pool grows past 256 rows
        model.release("long")
        out = [model.prefill("a", random_tokens(37, seed=71))]
        out.append(model.prefill("b", random_tokens(5, seed=72)))
        out.append(model.prefill("a", random_tokens(2 * B + 3, seed=73)))  # after b's block: scattered
        out.append(model.forward_verify("b", random_tokens(4, seed=74)))
        model.prefill("c", random_tokens(B, seed=75))
        out.append(model.prefill("c", random_tokens(9, seed=76)))  # the pool's last blocks
        return [np.array(x) for x in out]

    plain, padded = run(False), run(True)
    for i, (want, got) in enumerate(zip(plain, padded)):
        assert_close(got, want, 1e-5, f"call {i}")
    assert {"slice", "array"} <= set(routes), routes


def test_numpy_attention_equals_mlxs_causal_attention():
    """The CPU's attention by numpy: GQA, a chunk after cached keys and a whole prompt, the
    queries in blocks or all at once."""
    from ferrum_mac.backends.mlx.cpu.attention import numpy_causal_attention

    rng = np.random.default_rng(5)
    for n, total in ((5, 37), (20, 20)):
        q = mx.array(rng.standard_normal((1, 8, n, 16)).astype(np.float32))
        keys, values = (mx.array(rng.standard_normal((1, 2, total, 16)).astype(np.float32)) for _ in range(2))
        want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask="causal")
        for block_scores in (8 * total, 1 << 20):  # (one query a block; all of them)
            got = numpy_causal_attention(q, keys, values, 0.25, block_scores)
            assert_close(np.array(got), np.array(want), 1e-5, f"n={n} total={total}")


def test_a_models_logits_by_numpy_attention_equal_mlxs(zoo, monkeypatch):
    """Every several-token segment by numpy (a fresh prompt, a chunk after consecutive blocks,
    one after scattered blocks, a verify): the logits of MLX's own attention."""
    from ferrum_mac.backends.mlx.cpu import attention as cpu_attention

    calls = []
    monkeypatch.setattr(cpu_attention, "numpy_causal_attention", counted(cpu_attention.numpy_causal_attention, calls))

    def run(by_numpy: bool) -> list[np.ndarray]:
        ops = CpuOps(BackendOptions(numpy_attention=by_numpy))
        ops.numpy_min_scores = 0
        model = open_mlx(zoo.path("llama"), ops)
        out = [model.prefill("a", random_tokens(37, seed=81))]
        out.append(model.prefill("b", random_tokens(5, seed=82)))
        out.append(model.prefill("a", random_tokens(2 * B + 3, seed=83)))  # after b's block: scattered
        out.append(model.forward_verify("b", random_tokens(4, seed=84)))
        return [np.array(x) for x in out]

    plain, by_numpy = run(False), run(True)
    assert calls
    for i, (want, got) in enumerate(zip(plain, by_numpy)):
        assert_close(got, want, 1e-5, f"call {i}")


def counted(function, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return wrapper
