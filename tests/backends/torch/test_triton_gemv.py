"""The Triton GEMVs for a decode step's few rows (`triton_gemv`) against torch: RMSNorm + matmul,
RMSNorm + gate_up + SwiGLU, matmul + residual, by the tl.dot GEMV (K whole and split) and by
the row GEMV; a verify's rows summed as each alone; which kernel and tile a call takes.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (numpy underneath), so
shapes stay small. With one they run compiled on it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import DEVICE, gemv_inputs, like_a_gpu, ulps  # noqa: E402  (before triton: sets the interpreter up)

from ferrum_mac.backends.torch import ops  # noqa: E402
from ferrum_mac.backends.torch.kernels import triton_gemv, triton_splits  # noqa: E402
from ferrum_mac.backends.torch.pointwise import torch_swiglu  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def interpreter_like_a_gpu():
    with like_a_gpu():
        yield


GEMV_SHAPES = [(1, 96, 40), (3, 1100, 70), (4, 64, 16), (2, 200, 600)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", GEMV_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_norm_matmul_matches_torch(dtype, rows, k, n, bias):
    x, norm, weight, b = gemv_inputs(rows, k, n, dtype, bias)
    got = triton_gemv.norm_matmul(x, norm.weight, norm.eps, weight, b)
    torch.testing.assert_close(got, F.linear(norm(x), weight, b), rtol=ulps(dtype), atol=ulps(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", GEMV_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_norm_swiglu_matches_torch(dtype, rows, k, n, bias):
    x, norm, gate_up, b = gemv_inputs(rows, k, 2 * n, dtype, bias)
    got = triton_gemv.norm_swiglu(x, norm.weight, norm.eps, gate_up, b)
    torch.testing.assert_close(got, torch_swiglu(F.linear(norm(x), gate_up, b)), rtol=ulps(dtype), atol=ulps(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", GEMV_SHAPES)
def test_matmul_residual_matches_addmm(dtype, rows, k, n):
    x, _, weight, _ = gemv_inputs(rows, k, n, dtype, bias=False)
    residual = torch.randn(rows, n, device=DEVICE).to(dtype)
    got = triton_gemv.matmul_residual(x, weight, residual)
    torch.testing.assert_close(got, torch.addmm(residual, x, weight.t()), rtol=ulps(dtype), atol=ulps(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2, 3])  # 5 chunks of K: unsplit; 3 + 2 chunks; 2 + 2 + 1
def test_gemvs_split_over_k_match_torch(dtype, splits):
    """Each split's sums are added up by the last program to finish, which leaves the arrival
    counters at zero for the next launch (a CUDA graph replays it with no memset)."""
    k = 4 * triton_gemv.GEMV_TILE_BYTES // (16 * dtype.itemsize) + 100
    assert_gemvs_match_torch(3, 70, k, dtype, splits=splits)  # (16-column blocks)
    assert not triton_splits.split_counters(DEVICE).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n, block_k", [(8, 128), (16, 64)])
def test_row_gemvs_match_torch(dtype, block_n, block_k):
    """The one-row GEMV (here over a verify's rows): K in several chunks, the last one short,
    weight rows in blocks the last of which is short."""
    tile = triton_gemv.RowTile(block_n, block_k, warps=2)
    assert_gemvs_match_torch(3, 36, 4 * 64 + 20, dtype, tile=tile)


def test_the_row_gemv_sums_alike_whether_it_loads_its_first_chunk_early():
    """Early (before the PDL wait, on a GPU that launches it early) or in the loop over K."""
    x, norm, weight, bias = gemv_inputs(3, 4 * 64 + 20, 2 * 36, torch.bfloat16, bias=True)
    tile = triton_gemv.RowTile(8, 64, warps=2)
    outs = [torch.empty(3, 36, device=DEVICE, dtype=x.dtype) for _ in range(2)]
    for out, early in zip(outs, (False, True)):
        triton_gemv._row_gemv(x, weight, bias, norm.weight, norm.eps, True, None, out, tile, early=early)
    assert torch.equal(*outs)


def assert_gemvs_match_torch(rows: int, n: int, k: int, dtype: torch.dtype, **options) -> None:
    """norm_swiglu, norm_matmul and matmul_residual with `options` (a split, a tile) on `rows`
    rows of K `k` and 2n columns (n for SwiGLU) equal torch's, within a couple of ulps."""
    x, norm, weight, bias = gemv_inputs(rows, k, 2 * n, dtype, bias=True)
    residual = torch.randn(rows, 2 * n, device=DEVICE).to(dtype)
    tolerance = dict(rtol=ulps(dtype), atol=ulps(dtype))
    got = triton_gemv.norm_swiglu(x, norm.weight, norm.eps, weight, bias, **options)
    torch.testing.assert_close(got, torch_swiglu(F.linear(norm(x), weight, bias)), **tolerance)
    got = triton_gemv.norm_matmul(x, norm.weight, norm.eps, weight, bias, **options)
    torch.testing.assert_close(got, F.linear(norm(x), weight, bias), **tolerance)
    got = triton_gemv.matmul_residual(x, weight, residual, **options)
    torch.testing.assert_close(got, torch.addmm(residual, x, weight.t()), **tolerance)


def test_a_verifys_rows_sum_as_each_alone():
    x, norm, weight, bias = gemv_inputs(16, 200, 2 * 16, torch.bfloat16, bias=True)
    residual = torch.randn(16, 32, device=DEVICE).to(torch.bfloat16)
    tile = triton_gemv.RowTile(8, 128)  # (a one-row call's own would be the same, on a GPU)
    for rows, i in ((16, 15), (5, 0)):
        one = slice(i, i + 1)
        assert torch.equal(
            triton_gemv.norm_swiglu(x[:rows], norm.weight, norm.eps, weight, bias, tile=tile, rows_alike=True)[i],
            triton_gemv.norm_swiglu(x[one], norm.weight, norm.eps, weight, bias, tile=tile)[0],
        )
        assert torch.equal(
            triton_gemv.matmul_residual(x[:rows], weight, residual[:rows], tile=tile, rows_alike=True)[i],
            triton_gemv.matmul_residual(x[one], weight, residual[one], tile=tile)[0],
        )


def test_a_verify_steps_ops_sum_each_row_as_its_decode_step():
    """TritonOps of a verify (every row through the GEMVs, `rowwise`) against a decode step's
    TritonOps on each row alone: equal to the bit, through norm_matmul, norm_swiglu and the
    residual matmul over dense linears."""
    from ferrum_mac.backends.torch.layers import Linear

    # (float32, K of several chunks: sums in another order would show)
    x, norm, weight, bias = gemv_inputs(3, 1500, 2 * 16, torch.float32, bias=True)
    residual = torch.randn(3, 32, device=DEVICE)
    gemvs = frozenset({"norm_matmul", "norm_swiglu", "matmul_residual"})
    verify, decode = ops.TritonOps(gemvs, gemv_max_rows=16, rowwise=True), ops.TritonOps(gemvs)
    calls = [
        lambda o, i: o.norm_matmul(x[i], norm, Linear(weight, bias)),
        lambda o, i: o.norm_swiglu(x[i], norm, Linear(weight, bias)),
        lambda o, i: o.matmul_plus(x[i, :32].contiguous(), Linear(weight[:, :32].contiguous()), residual[i]),
    ]
    for call in calls:
        whole = call(verify, slice(0, 3))
        alone = torch.cat([call(decode, slice(i, i + 1)) for i in range(3)])
        assert torch.equal(whole, alone)


def test_the_row_gemv_takes_one_row_or_a_verifys_of_a_small_weight():
    small = torch.empty(64, 64)
    one, few = torch.empty(1, 64), torch.empty(3, 64)
    assert triton_gemv.takes_rows(one, small, False) and triton_gemv.takes_rows(few, small, True)
    assert not triton_gemv.takes_rows(few, small, False)
    large = torch.empty(1, 64).expand(triton_gemv.ROW_GEMV_MAX_BYTES // 256 + 1, 64)  # (no memory)
    assert not triton_gemv.takes_rows(one, large, False)
    cpu = torch.device("cpu")  # 8 "SMs": at least 16 programs where the rows allow
    assert triton_gemv.row_tile(4096, 4096, cpu) == triton_gemv.RowTile(16, 1024)
    assert triton_gemv.row_tile(64, 300, cpu) == triton_gemv.RowTile(4, 512)
    assert triton_gemv.row_tile(10, 3000, cpu) == triton_gemv.RowTile(1, 1024)


def test_gemv_tiles_are_wide_and_deep_where_the_columns_fill_the_machine():
    cpu = torch.device("cpu")  # 8 "SMs" (4 blocks fill them), 228 KiB of shared memory each
    # 32 KB of weight a step, a warp per 16 columns; stages: as many as shared memory holds (at most 4)
    assert triton_gemv.gemv_tile(4096, 12288, cpu, 2) == triton_gemv.GemvTile(128, 128, warps=8, stages=4)
    assert triton_gemv.gemv_tile(4096, 12288, cpu, 2, weights=2).stages == 3  # gate's and up's tiles
    assert triton_gemv.gemv_tile(48, 4096, cpu, 2) == triton_gemv.GemvTile(16, 1024, warps=4, stages=3)  # (and x's 16)
    assert triton_gemv.fills_the_machine(4, cpu) and not triton_gemv.fills_the_machine(3, cpu)


def test_gemv_tiles_shorten_their_chunks_to_keep_two_stages_where_shared_memory_is_small(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(triton_gemv, "shared_memory", lambda device: 100 << 10)  # a consumer GPU's
    tile = triton_gemv.gemv_tile(4096, 12288, cpu, 2, weights=2)
    assert (tile.block_n, tile.block_k, tile.stages) == (128, 64, 2)  # (2 x 128 + 16) x 64 x 2 bytes a stage


def test_a_verifys_rows_sum_as_each_alone_through_the_dot_gemv(monkeypatch):
    """A large weight's rows (here: any weight's) take the tl.dot GEMV, which runs each row of
    x through the same instructions however many share the launch."""
    monkeypatch.setattr(triton_gemv, "ROW_GEMV_MAX_BYTES", 0)
    x, norm, weight, bias = gemv_inputs(5, 300, 2 * 40, torch.bfloat16, bias=True)
    residual = torch.randn(5, 80, device=DEVICE).to(torch.bfloat16)
    for i in (0, 4):
        one = slice(i, i + 1)
        assert torch.equal(
            triton_gemv.norm_swiglu(x, norm.weight, norm.eps, weight, bias, rows_alike=True)[i],
            triton_gemv.norm_swiglu(x[one], norm.weight, norm.eps, weight, bias)[0],
        )
        assert torch.equal(
            triton_gemv.matmul_residual(x, weight, residual, rows_alike=True)[i],
            triton_gemv.matmul_residual(x[one], weight, residual[one])[0],
        )


def test_gemv_splits_k_only_where_the_columns_leave_sms_idle():
    cpu = torch.device("cpu")  # 8 "SMs": up to 16 column blocks split
    assert triton_gemv.gemv_splits(16, 4096, 256, cpu) == (1, 4096)
    assert triton_gemv.gemv_splits(4, 4096, 256, cpu) == (4, 1024)
    assert triton_gemv.gemv_splits(5, 4096, 256, cpu) == (4, 1024)  # 4 splits, 16 chunks: 4 each
    assert triton_gemv.gemv_splits(1, 1100, 256, cpu) == (5, 256)  # no more splits than K has chunks
    assert triton_gemv.gemv_splits(5, 1280, 256, cpu, wanted=3) == (3, 512)  # 2 + 2 + 1 chunks
    assert triton_gemv.gemv_splits(1, 4096, 256, cpu, wanted=0) == (1, 4096)
