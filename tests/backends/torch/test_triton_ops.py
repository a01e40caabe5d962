"""The Triton decode kernels against the torch code they replace: q/k norm + RoPE + KV write,
attention over the pool with a length per row, SwiGLU, RMSNorm, and a whole decode step through
them (the GEMVs' own tests: test_triton_gemv.py).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (numpy underneath), so
shapes stay small. With one they run compiled on it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import DEVICE, gemv_inputs, like_a_gpu, ulps  # noqa: E402  (before triton: sets the interpreter up)

triton = pytest.importorskip("triton")

from ferrum_mac.backends.options import BackendOptions  # noqa: E402
from ferrum_mac.backends.torch import attention, ops, pointwise, steps  # noqa: E402
from ferrum_mac.backends.torch.kernels import triton_gemv, triton_ops, triton_qkv, triton_splits  # noqa: E402
from ferrum_mac.backends.torch.attention import DecodePlan  # noqa: E402
from ferrum_mac.backends.torch.kv import KvManager  # noqa: E402
from ferrum_mac.backends.torch.layers import Rope  # noqa: E402
from ferrum_mac.backends.torch.pointwise import norm_and_rope, torch_swiglu  # noqa: E402
from ferrum_mac.llm import DecodeItem  # noqa: E402
from helpers import random_tokens  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def interpreter_like_a_gpu():
    with like_a_gpu():
        yield


B = KvManager.block_tokens


def random_pool(kv_heads: int, dim: int, blocks: int, dtype: torch.dtype, seed: int) -> KvManager:
    torch.manual_seed(seed)
    pool = KvManager(1, kv_heads, dim, dtype, DEVICE, capacity=blocks * B)
    pool._grow(blocks)
    pool.kv[0].normal_()
    return pool


def block_table(rows: list[list[int]]) -> torch.Tensor:
    """Each row's blocks, scratch (block 0) past them: `(rows, widest)`."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64, device=DEVICE)


# Three rows' blocks, scattered and out of order: positions 5, 0 (a row outside the batch: scratch) and 39
WRITE_TABLE = [[3, 6], [], [5, 2]]


def rope_tables(dim: int, interleaved: bool, positions: torch.Tensor, dtype: torch.dtype):
    config = SimpleNamespace(
        head_dim=dim, rope_dims=dim, rope_theta=10000.0, rope_scaling=None, rope_traditional=interleaved
    )
    rope = Rope(config, DEVICE)
    rope.build(256)
    return rope.tables(positions, dtype)


# heads, kv_heads (groups 1, 2, 4 and 8), head_dim
SHAPES = [(2, 2, 64), (4, 2, 128), (4, 1, 64), (16, 2, 128)]


# -- q/k norm + RoPE + KV write -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", SHAPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_norm_rope_write_matches_torch(dtype, heads, kv_heads, dim, interleaved, qk_norm):
    rows = 3
    pool, expected = (random_pool(kv_heads, dim, 8, dtype, seed=1) for _ in range(2))
    positions = torch.tensor([5, 0, 39], device=DEVICE)
    plan = DecodePlan(pool, block_table(WRITE_TABLE), positions, dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    weight = (1 + 0.3 * torch.randn(heads + kv_heads, dim, device=DEVICE)).to(dtype) if qk_norm else None
    cos, sin = rope_tables(dim, interleaved, positions, dtype)

    q = triton_ops.norm_rope_write(qkv, heads, weight, cos, sin, 1e-6, interleaved, pool.kv[0], plan.places)

    qk = norm_and_rope(qkv[:, : (heads + kv_heads) * dim].unflatten(-1, (-1, dim)), weight, cos, sin, 1e-6, interleaved)
    k, v = qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].unflatten(-1, (kv_heads, dim))
    expected.kv[0].view(2, -1, dim)[:, plan.places] = torch.stack((k, v)).view(2, -1, dim)  # as DecodePlan.attend
    torch.testing.assert_close(q, qk[:, :heads], rtol=ulps(dtype), atol=ulps(dtype))
    torch.testing.assert_close(pool.kv, expected.kv, rtol=ulps(dtype), atol=ulps(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", SHAPES[:3])
@pytest.mark.parametrize("interleaved, qk_norm, bias", [(False, True, False), (True, False, True)])
@pytest.mark.parametrize("splits", [1, 3])
def test_norm_qkv_rope_write_matches_torch(dtype, heads, kv_heads, dim, interleaved, qk_norm, bias, splits):
    """One kernel for the block's norm, the qkv projection and what norm_rope_write does; split
    over K, the last program of a head finishes it and leaves its counter at zero."""
    rows, hidden = 3, 80  # 80: K in 16-wide chunks, 5 of them
    pool, expected = (random_pool(kv_heads, dim, 8, dtype, seed=3) for _ in range(2))
    positions = torch.tensor([5, 0, 39], device=DEVICE)
    plan = DecodePlan(pool, block_table(WRITE_TABLE), positions, dtype)
    x, norm, weight, b = gemv_inputs(rows, hidden, (heads + 2 * kv_heads) * dim, dtype, bias)
    qk_weight = (1 + 0.3 * torch.randn(heads + kv_heads, dim, device=DEVICE)).to(dtype) if qk_norm else None
    cos, sin = rope_tables(dim, interleaved, positions, dtype)

    q = triton_qkv.norm_qkv_rope_write(
        x,
        norm.weight,
        norm.eps,
        weight,
        b,
        heads,
        qk_weight,
        1e-6,
        cos,
        sin,
        interleaved,
        pool.kv[0],
        plan.places,
        splits=splits,
        block_k=16,
    )

    qkv = F.linear(norm(x), weight, b)
    want_q = triton_ops.norm_rope_write(qkv, heads, qk_weight, cos, sin, 1e-6, interleaved, expected.kv[0], plan.places)
    torch.testing.assert_close(q, want_q, rtol=ulps(dtype), atol=ulps(dtype))
    torch.testing.assert_close(pool.kv, expected.kv, rtol=ulps(dtype), atol=ulps(dtype))
    assert not triton_splits.split_counters(DEVICE).any()


# -- attention over the pool --------------------------------------------------------------------


def attention_by_row(q, kv, table, positions, scale):
    """Each row on its own: exact-length SDPA over its first `position + 1` keys, gathered
    through its blocks."""
    out = []
    for i, pos in enumerate(positions.tolist()):
        rows = [table[i, j // B].item() * B + j % B for j in range(pos + 1)]
        keys, values = kv[0, :, rows], kv[1, :, rows]
        grouped = q[i].unflatten(0, (keys.shape[0], -1)).float()  # (kv_heads, group, dim)
        out.append(F.scaled_dot_product_attention(grouped, keys.float(), values.float(), scale=scale).flatten())
    return torch.stack(out).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", SHAPES)
@pytest.mark.parametrize("splits, merge_tile", [(1, 8192), (4, 8192), (16, 1)])
def test_decode_attention_reads_each_row_up_to_its_position(
    dtype, heads, kv_heads, dim, splits, merge_tile, monkeypatch
):
    """Each row reads its keys through its own scattered, out-of-order blocks, and nothing past
    its position (NaN there, and in the scratch block its table ends with, would spread).
    Split, the last program of each (row, kv head) to finish merges the splits that hold keys
    (the 150-key row: 3 of 4, merged in one round; or a few of 16, one a round with a
    `merge_tile` that small) and leaves its arrival counter at zero for the next launch."""
    monkeypatch.setattr(triton_ops, "MERGE_TILE", merge_tile)
    pool = random_pool(kv_heads, dim, 16, dtype, seed=2)
    # one key; three 64-key blocks, the last partial; one past a 64-key block
    positions = torch.tensor([0, 149, 64], device=DEVICE)
    table = block_table([[7], [12, 2, 9, 4, 11], [13, 1, 8]])
    kv = pool.kv[0]
    kv[:, :, :B] = float("nan")  # scratch
    for i, pos in enumerate(positions.tolist()):
        last = table[i, pos // B].item()
        kv[:, :, last * B + pos % B + 1 : (last + 1) * B] = float("nan")
    q = torch.randn(len(positions), heads, dim, device=DEVICE).to(dtype)

    out = triton_ops.decode_attention(q, kv, table, positions, dim**-0.5, B, splits=splits)

    torch.testing.assert_close(
        out, attention_by_row(q, kv, table, positions, dim**-0.5), rtol=ulps(dtype), atol=ulps(dtype)
    )
    assert not triton_splits.split_counters(DEVICE).any()


def test_torch_decode_plan_reads_through_scattered_blocks():
    """The torch decode path (`DecodePlan.attend`) writes each row's key at its table's place
    and attends as `attention_by_row` does."""
    heads, kv_heads, dim, dtype = 4, 2, 64, torch.float32
    pool = random_pool(kv_heads, dim, 16, dtype, seed=4)
    positions = torch.tensor([0, 70, 33], device=DEVICE)
    table = block_table([[7, 3], [12, 2, 9], [13, 1]])
    plan = DecodePlan(pool, table, positions, dtype)
    q = torch.randn(3, heads, dim, device=DEVICE)
    k, v = torch.randn(3, kv_heads, dim, device=DEVICE), torch.randn(3, kv_heads, dim, device=DEVICE)

    out = plan.attend(0, q, k, v, dim**-0.5)

    for i, pos in enumerate(positions.tolist()):
        row = table[i, pos // B].item() * B + pos % B
        torch.testing.assert_close(pool.kv[0][0, :, row], k[i])
        torch.testing.assert_close(pool.kv[0][1, :, row], v[i])
    torch.testing.assert_close(out, attention_by_row(q, pool.kv[0], table, positions, dim**-0.5), rtol=1e-5, atol=1e-5)


def test_default_splits_fill_the_gpu_in_powers_of_two():
    assert triton_ops.default_splits(16, 4096, torch.device("cpu")) == 1  # 8 "SMs" on the CPU
    assert triton_ops.default_splits(3, 4096, torch.device("cpu")) == 4
    assert triton_ops.default_splits(1, 4096, torch.device("cpu")) == 16
    assert triton_ops.default_splits(1, 100, torch.device("cpu")) == 2  # no more than the key blocks


# -- SwiGLU -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, weighted", [((3,), False), ((5,), True), ((2, 4), True)])
def test_swiglu_matches_torch(dtype, lead, weighted):
    torch.manual_seed(3)
    gate_up = (2 * torch.randn(*lead, 2 * 1100, device=DEVICE)).to(dtype)  # two blocks and a partial one
    weights = torch.rand(*lead, 1, device=DEVICE).to(dtype) if weighted else None
    torch.testing.assert_close(
        triton_ops.swiglu(gate_up, weights), torch_swiglu(gate_up, weights), rtol=ulps(dtype), atol=ulps(dtype)
    )


def test_swiglu_keeps_torch_for_weights_it_cannot_take():
    gate_up = torch.randn(3, 8)
    assert pointwise.one_per_row(None, gate_up) and pointwise.one_per_row(torch.rand(3, 1), gate_up)
    assert not pointwise.one_per_row(torch.rand(3, 4), gate_up)  # one per element
    assert not pointwise.one_per_row(torch.rand(3, 1, dtype=torch.float64), gate_up)


# -- RMSNorm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 1100), (2, 3, 96)])  # a power of two; a masked tail; leading dims
def test_rms_norm_matches_torch(dtype, shape):
    torch.manual_seed(6)
    x = (3 * torch.randn(*shape, device=DEVICE)).to(dtype)
    weight = (1 + 0.3 * torch.randn(shape[-1], device=DEVICE)).to(dtype)
    got = triton_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, shape[-1:], weight, 1e-6), rtol=ulps(dtype), atol=ulps(dtype))


# -- GEMVs for a few rows -----------------------------------------------------------------------


# rows, K, N: a 16-column block, K in chunks with a partial last one, a 64-column block
def test_gemv_runs_for_a_few_rows_and_the_kernels_named():
    triton_ops_ = ops.TritonOps(gemv=frozenset({"norm_matmul", "norm_swiglu"}))
    few, many = torch.zeros(ops.GEMV_MAX_ROWS, 8), torch.zeros(ops.GEMV_MAX_ROWS + 1, 8)
    assert triton_ops_.gemv("norm_matmul", few) and triton_ops_.gemv("norm_swiglu", few)
    assert not triton_ops_.gemv("norm_matmul", many)
    assert not triton_ops_.gemv("matmul_residual", few)


def test_triton_ops_only_in_a_cuda_decode_step(monkeypatch):
    """Eager steps (prefill, verify, mixed batches) run torch's ops; a decode step Triton's,
    on CUDA where triton imports, unless FERRUM_TORCH_TRITON=0."""
    monkeypatch.setattr(ops, "triton_imports", lambda: True)
    assert isinstance(ops.decode_ops(torch.device("cuda")), ops.TritonOps)
    assert ops.decode_ops(torch.device("cpu")) is ops.TORCH_OPS
    assert attention.Plan.ops is ops.TORCH_OPS
    monkeypatch.setattr(ops, "triton_imports", lambda: False)
    assert ops.decode_ops(torch.device("cuda")) is ops.TORCH_OPS
    monkeypatch.setattr(ops, "triton_imports", lambda: True)
    assert ops.decode_ops(torch.device("cuda"), BackendOptions(torch_triton=False)) is ops.TORCH_OPS
    named = ops.decode_ops(torch.device("cuda"), BackendOptions(torch_gemv=frozenset({"norm_matmul"})))
    assert named.gemvs == {"norm_matmul"}


# -- a whole decode step ------------------------------------------------------------------------


KERNELS = {  # a GEMV's name in ops.GEMV (or rms_norm) -> its module and function
    "norm_matmul": (triton_gemv, "norm_matmul"),
    "norm_swiglu": (triton_gemv, "norm_swiglu"),
    "matmul_residual": (triton_gemv, "matmul_residual"),
    "norm_qkv_rope": (triton_qkv, "norm_qkv_rope_write"),
    "rms_norm": (triton_ops, "rms_norm"),
}


# (phi3: a partial rope, its unturned pairs at angle zero; smollm3: a layer without RoPE)
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "smollm3"])
@pytest.mark.parametrize("qkv", ["norm_matmul", "norm_qkv_rope"])
def test_decode_batch_through_triton_matches_torch(zoo, monkeypatch, family, qkv):
    """Two sequences at different positions, two steps: the logits with every decode-step
    kernel on Triton (`TritonOps` forced on the CPU under the interpreter, every GEMV on,
    the qkv projection by `qkv`) equal torch's."""
    from helpers import decode_batch_steps, random_tokens

    model = zoo.ferrum(family, "torch")
    prompts = {"a": random_tokens(7, seed=4), "b": random_tokens(19, seed=5)}

    def decode_twice(tag: str) -> list[torch.Tensor]:
        return decode_batch_steps(model, prompts, tag)

    gemvs = frozenset({qkv, "norm_swiglu", "matmul_residual"})
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TORCH_OPS)
    expected = decode_twice("torch")
    model.reset()  # drops the decode steps (and on a GPU their CUDA graphs): the next run makes its own
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TritonOps(gemv=gemvs))
    calls = {name: 0 for name in gemvs | {"rms_norm"}}
    for name in calls:
        module, function = KERNELS[name]
        monkeypatch.setattr(module, function, counted(getattr(module, function), name, calls))
    got = decode_twice("triton")
    model.reset()
    for got, want in zip(got, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert all(calls.values()), calls  # a decode step's two rows went through every GEMV and the norm


def test_one_rows_qkv_takes_the_row_gemv_then_norm_rope_write(zoo, monkeypatch):
    """A single stream's decode step: its qkv projection through the row GEMV, then q/k norm,
    RoPE and KV write in their own kernel (not `triton_qkv`'s one); its logits equal torch's."""
    from helpers import decode_batch_steps

    model = zoo.ferrum("qwen3", "torch")
    prompts = {"a": random_tokens(7, seed=4)}
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TORCH_OPS)
    expected = decode_batch_steps(model, prompts, "torch")
    model.reset()
    gemvs = frozenset({"norm_qkv_rope", "norm_swiglu", "matmul_residual"})
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TritonOps(gemv=gemvs))
    calls = {"row": 0, "fused": 0, "rope": 0}
    monkeypatch.setattr(triton_gemv, "_row_gemv", counted(triton_gemv._row_gemv, "row", calls))
    monkeypatch.setattr(triton_qkv, "norm_qkv_rope_write", counted(triton_qkv.norm_qkv_rope_write, "fused", calls))
    monkeypatch.setattr(triton_ops, "norm_rope_write", counted(triton_ops.norm_rope_write, "rope", calls))
    got = decode_batch_steps(model, prompts, "triton")
    model.reset()
    for got, want in zip(got, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    layers = len(model.model.layers)
    assert calls["fused"] == 0 and calls["rope"] == 2 * layers and calls["row"] == 2 * 4 * layers, calls


def test_decode_batch_through_triton_over_shared_blocks_matches_torch(zoo, monkeypatch):
    """Two sequences sharing a prefix's first block (the second copied its partial block) and
    growing side by side past a block's end, so their tables interleave: Triton's decode step
    equals torch's."""
    model = zoo.ferrum("qwen3", "torch")
    prompt = random_tokens(2 * B - 3, seed=8)  # (both cross the second block's end within 8 steps)
    steps_taken = 8

    def decode_shared(tag: str) -> list[torch.Tensor]:
        model.reset()
        model.prefill(f"{tag}-a", prompt)
        model.state.remember(f"{tag}-a", prompt)
        other = prompt[: 2 * B - 6] + [4]
        found = model.state.reuse(f"{tag}-b", other).tokens
        model.prefill(f"{tag}-b", other[found:])
        lengths = {"a": len(prompt), "b": len(other)}
        logits = []
        for step in range(steps_taken):
            items = [DecodeItem(f"{tag}-{n}", 3 + step, lengths[n] + step) for n in lengths]
            out = model.decode_batch(items)
            if step in (0, steps_taken - 1):
                logits.append(out.clone())
        a, b = model.kv.get(f"{tag}-a"), model.kv.get(f"{tag}-b")
        assert found == 2 * B - 6 and a.blocks[0] == b.blocks[0] and b.first_row_if_contiguous(b.length) is None
        assert len(a.blocks) == len(b.blocks) == 3 and abs(a.blocks[2] - b.blocks[2]) == 1  # interleaved
        model.reset()
        return logits

    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TORCH_OPS)
    expected = decode_shared("torch")
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TritonOps())
    for got, want in zip(decode_shared("triton"), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def counted(fn, name: str, calls: dict):
    def call(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return call


def test_gemma3_decode_batch_through_triton_matches_torch(tmp_path, monkeypatch):
    """Gemma 3's global layers through the Triton decode step (its q/k norms, its score scale),
    its windowed ones by torch's ops over their own pool: the logits equal torch's."""
    import ferrum_mac
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from helpers import decode_batch_steps

    config = Gemma3TextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=16,
        sliding_window_pattern=2,
        query_pre_attn_scalar=24,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    model = ferrum_mac.open_model(tmp_path, backend="torch", dtype="float32")
    prompts = {"a": random_tokens(7, seed=4), "b": random_tokens(40, seed=5)}
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TORCH_OPS)
    expected = decode_batch_steps(model, prompts, "torch")
    model.reset()
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TritonOps())
    calls = {"attention": 0}
    monkeypatch.setattr(triton_ops, "decode_attention", counted(triton_ops.decode_attention, "attention", calls))
    got = decode_batch_steps(model, prompts, "triton")
    model.reset()
    for got, want in zip(got, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert calls["attention"] == 2  # the global layer's, one a step


def test_gpt_oss_decode_batch_through_triton_matches_torch(tmp_path, monkeypatch):
    """gpt-oss's layers all have sinks, which Triton's decode attention does not take: they
    attend by torch's ops inside the Triton step (its norms, projections with biases, head),
    and the MoE runs torch's routes; the logits equal torch's."""
    import ferrum_mac
    from transformers import AutoModelForCausalLM

    from helpers import FAMILY_FACTORIES, decode_batch_steps

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(FAMILY_FACTORIES["gpt_oss"](), dtype=torch.float32)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    reference.save_pretrained(tmp_path)
    model = ferrum_mac.open_model(tmp_path, backend="torch", dtype="float32")
    prompts = {"a": random_tokens(7, seed=4), "b": random_tokens(40, seed=5)}
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TORCH_OPS)
    expected = decode_batch_steps(model, prompts, "torch")
    model.reset()
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TritonOps())
    calls = {"attention": 0}
    monkeypatch.setattr(triton_ops, "decode_attention", counted(triton_ops.decode_attention, "attention", calls))
    got = decode_batch_steps(model, prompts, "triton")
    model.reset()
    for got, want in zip(got, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert calls["attention"] == 0  # (every layer's sinks keep it from Triton's attention)
