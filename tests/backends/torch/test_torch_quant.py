"""Packed 4-bit and 8-bit weights on the torch backend (`quant`, and its Triton kernels:
`triton_quant`, `triton_fma_gemv`, `triton_dequant`).

- Packing changes no value: MLX affine arrays and a real GGUF file's Q4_1 and Q8_0 tensors
  dequantize, packed, to exactly what `mx.dequantize` gives.
- The Triton kernels (under Triton's interpreter without a GPU) equal the matmul of the
  dequantized weight within the activations' rounding, with every fusion they offer.
- Whole models: an MLX 4-bit checkpoint of stories260K (with per-layer overrides) and the
  bundled SmolLM2 Q4_1 GGUF give, packed, the same logits and greedy tokens as the same
  checkpoint dequantized at load; `quant="4bit"` gives those of the weights it quantized.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import DEVICE, INTERPRET, like_a_gpu  # noqa: E402  (before triton: sets the interpreter up)

from ferrum_mac.backends.torch import quant  # noqa: E402
from ferrum_mac.backends.torch.layers import Linear, RmsNorm  # noqa: E402
from ferrum_mac.backends.torch.quant import Packed, QuantLinear  # noqa: E402
from ferrum_mac.backends.torch.runtime import TorchLLM  # noqa: E402
from ferrum_mac.backends.torch.weights import load_onto  # noqa: E402
from ferrum_mac.errors import FerrumError  # noqa: E402
from ferrum_mac.weights import Checkpoint  # noqa: E402
from helpers import ASSETS, ferrum_greedy  # noqa: E402

CPU = torch.device("cpu")
PROMPT = [1, 403, 261, 350, 4]
STEPS = 32


def mlx_core():
    return pytest.importorskip("mlx.core")


# -- packing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_mlx_affine_arrays_pack_without_changing_a_value(bits, group):
    mx = mlx_core()
    w = mx.random.normal((48, 256), key=mx.random.key(bits * group))
    words, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    packed = quant.from_mlx(words, scales, biases, bits, group)
    want = torch.from_numpy(np.array(mx.dequantize(words, scales, biases, group_size=group, bits=bits)))
    assert packed.shape == (48, 256)
    assert torch.equal(packed.dequantize(), want)
    assert torch.equal(quant.pack_codes(packed.codes(), bits), packed.words)


def test_stacked_experts_read_without_mlx_dequantize_as_mlx_does():
    """MoE experts stacked `(experts, out, in)` (mlx-lm's switch_mlp, GGUF's *_exps), read as
    torch tensors: dequantized at load expert by expert, as `mx.dequantize` does all at once."""
    mx = mlx_core()
    from ferrum_mac.backends.torch.weights import TensorSource
    from ferrum_mac.weights import ModelConfig

    w = mx.random.normal((3, 40, 128), key=mx.random.key(3))
    words, scales, biases = mx.quantize(w, group_size=64, bits=4)
    module = "layers.0.mlp.switch_mlp.up_proj"
    tensors = {
        f"{module}.{part}": torch.from_numpy(np.array(t))
        for part, t in zip(("weight", "scales", "biases"), (words, scales, biases))
    }
    config = ModelConfig("qwen3_moe", 64, 128, 40, 1, 2, 2, 64, quantization={"group_size": 64, "bits": 4})
    got = TensorSource(tensors, config, torch.float32, CPU, "test").take(f"{module}.weight", (3, 40, 128))
    want = np.array(mx.dequantize(words, scales, biases, group_size=64, bits=4))
    assert torch.equal(got, torch.from_numpy(want))


def test_gguf_files_read_without_mlx_bit_for_bit_and_pack_without_changing_a_value(smollm2_gguf):
    """`load_onto` reads GGUF files without MLX, into MLX's own layout, bit for bit; packed,
    their Q4_1 and Q8_0 weights dequantize to exactly what `mx.dequantize` gives."""
    mx = mlx_core()
    from ferrum_mac.weights import load_checkpoint

    by_mlx = load_checkpoint(smollm2_gguf)
    by_torch = load_onto(smollm2_gguf, CPU)
    assert by_torch.format == "gguf" and by_torch.quantized_weights
    assert set(by_torch.tensors) == set(by_mlx.tensors)
    for name, array in by_mlx.tensors.items():
        want = torch.from_numpy(np.array(array))
        got = by_torch.tensors[name]
        assert torch.equal(got.view(want.dtype) if name.endswith(".weight") else got, want), name
    for module in ("layers.0.mlp.down_proj", "layers.0.self_attn.k_proj", "embed_tokens"):  # Q4_1, Q4_1, Q8_0
        spec = by_mlx.config.quant_for(module)
        words, scales, biases = (by_mlx.tensors[f"{module}.{part}"] for part in ("weight", "scales", "biases"))
        packed = quant.from_mlx(
            *(by_torch.tensors[f"{module}.{part}"] for part in ("weight", "scales", "biases")),
            spec["bits"],
            spec["group_size"],
        )
        wide = (scales.astype(mx.float32), biases.astype(mx.float32))
        want = np.array(mx.dequantize(words, *wide, group_size=spec["group_size"], bits=spec["bits"]))
        assert torch.equal(packed.dequantize(), torch.from_numpy(want)), module


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_takes_the_nearest_code_under_the_stored_scales(bits):
    torch.manual_seed(bits)
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    packed = quant.quantize(w, bits, 64)
    scales, biases = (t.float().repeat_interleave(64, dim=1) for t in (packed.scales, packed.biases))
    nearest = torch.round((w.float() - biases) / scales).clamp(0, (1 << bits) - 1)
    assert torch.equal(packed.codes(), nearest.int())
    error = (packed.dequantize() - w.float()).abs()
    assert error.mean() < scales.mean() / 3  # (the bf16 bias can move the range by half an ulp)


def test_an_unknown_quantization_is_a_one_line_error():
    with pytest.raises(FerrumError, match="unknown quantization '3bit'; choose one of: 4bit, 8bit"):
        quant.checked_quant("3bit")


# -- the kernels --------------------------------------------------------------------------------

from ferrum_mac.backends.torch import ops  # noqa: E402
from ferrum_mac.backends.torch.kernels import (  # noqa: E402
    switches,
    triton_dequant,
    triton_dp4a_gemv,
    triton_fma_gemv,
    triton_quant,
    triton_splits,
)

kernels = pytest.mark.skipif(triton_quant.triton is None, reason="needs triton")


@pytest.fixture
def gpu_like():
    with like_a_gpu():
        yield


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


def packed_random(n: int, k: int, bits: int, group: int, dtype: torch.dtype, seed: int) -> Packed:
    torch.manual_seed(seed)
    return quant.quantize(torch.randn(n, k, dtype=dtype), bits, group).to(DEVICE)


def assert_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tolerance(dtype) * scale


CASES = [(4, 32, torch.bfloat16), (8, 64, torch.float32), (4, 128, torch.float16)]


@pytest.mark.interpreter
@kernels
@pytest.mark.parametrize("bits,group,dtype", CASES)
def test_dot_gemv_equals_the_dequantized_matmul(gpu_like, bits, group, dtype):
    """The tl.dot GEMV, which takes more rows than the FMA one."""
    unpack = "words" if group == 128 else "gather"  # (each way of unpacking a tile, in turn)
    n, k, rows = 80, 256, triton_fma_gemv.FMA_MAX_ROWS + 2
    w = packed_random(n, k, bits, group, dtype, seed=bits + group)
    dense = w.dequantize(dtype)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    bias, residual = (torch.randn(*shape, dtype=dtype, device=DEVICE) for shape in ((n,), (rows, n)))
    want = F.linear(x.float(), dense.float(), bias.float()) + residual.float()
    for splits in (1, 2):  # split K: the last program adds the parts up
        assert_near(triton_quant.gemv(x, w, bias, residual=residual, splits=splits, unpack=unpack), want, dtype)


@pytest.mark.interpreter
@kernels
def test_dot_gemv_fuses_the_norm_and_swiglu(gpu_like):
    dtype, k, width = torch.bfloat16, 128, 48
    gate_up = packed_random(2 * width, k, 4, 64, dtype, seed=1)
    x = torch.randn(2, k, dtype=dtype, device=DEVICE)
    norm = RmsNorm(torch.rand(k, dtype=dtype, device=DEVICE) + 0.5, 1e-5)
    y = F.linear(norm(x), gate_up.dequantize(dtype))
    want = F.silu(y[:, :width]) * y[:, width:]
    for unpack in ("gather", "words"):
        got = triton_quant.gemv(
            x, gate_up, norm_weight=norm.weight, eps=norm.eps, swiglu=True, splits=2, unpack=unpack, fma=False
        )
        assert_near(got, want, dtype)


# a tile small enough that these shapes take more than one step of K (the last one partial),
# and from 2 rows on more than one block of columns (the last one partial); per_sm=0: no
# smaller blocks or splits for the SMs' sake (the interpreter runs a program at a time)
SMALL_FMA_TILE = triton_fma_gemv.FmaTile(columns=128, row_bytes=64, per_sm=0)


@pytest.mark.interpreter
@kernels
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 64)])
def test_fma_gemv_equals_the_dequantized_matmul_with_its_fusions(gpu_like, bits, group):
    """The FMA GEMV (a decode step's 1 to 4 rows): + bias + residual, and RMSNorm + the fused
    gate_up + SwiGLU, against the dequantized weight's matmul; K whole and split."""
    dtype, k, width = torch.bfloat16, 192, 40
    w = packed_random(2 * width, k, bits, group, dtype, seed=bits + group)
    y_all = w.dequantize(dtype).float()
    norm = RmsNorm(torch.rand(k, dtype=dtype, device=DEVICE) + 0.5, 1e-5)
    bias = torch.randn(2 * width, dtype=dtype, device=DEVICE)
    for rows, splits in ((1, 2), (2, 1), (4, None)) + (((3, 2),) if group == 32 else ()):
        x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
        residual = torch.randn(rows, 2 * width, dtype=dtype, device=DEVICE)
        want = F.linear(x.float(), y_all, bias.float()) + residual.float()
        got = triton_quant.gemv(x, w, bias, residual=residual, splits=splits, tile=SMALL_FMA_TILE, dp4a=False)
        assert_near(got, want, dtype)
        y = F.linear(norm(x).float(), y_all)
        want = F.silu(y[:, :width]) * y[:, width:]
        got = triton_quant.gemv(
            x, w, norm_weight=norm.weight, eps=norm.eps, swiglu=True, splits=splits, tile=SMALL_FMA_TILE, dp4a=False
        )
        assert_near(got, want, dtype)


@pytest.mark.interpreter
@kernels
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_fma_gemv_trading_columns_for_longer_rows_equals_the_dequantized_matmul(gpu_like, bits, group):
    """A tile whose columns halve for the SMs' sake (the interpreter's 8) while its rows grow
    to the whole of K: one step a program, its last words past K masked."""
    tile = triton_fma_gemv.FmaTile(columns=64, row_bytes=64, per_sm=4, longer_rows=True)
    dtype, k, width = torch.bfloat16, 192, 40
    assert tile.blocks(2 * width, k, 1, False, bits, group, 8) == (8, 256)
    assert tile.blocks(4 * width, k, 1, False, bits, group, 8) == (16, 256)  # (a whole row's program an SM)
    w = packed_random(2 * width, k, bits, group, dtype, seed=bits + group)
    y_all = w.dequantize(dtype).float()
    norm = RmsNorm(torch.rand(k, dtype=dtype, device=DEVICE) + 0.5, 1e-5)
    for rows in (1, 2):
        x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
        residual = torch.randn(rows, 2 * width, dtype=dtype, device=DEVICE)
        want = F.linear(x.float(), y_all) + residual.float()
        assert_near(triton_quant.gemv(x, w, residual=residual, tile=tile, dp4a=False), want, dtype)
        y = F.linear(norm(x).float(), y_all)
        want = F.silu(y[:, :width]) * y[:, width:]
        got = triton_quant.gemv(x, w, norm_weight=norm.weight, eps=norm.eps, swiglu=True, tile=tile, dp4a=False)
        assert_near(got, want, dtype)


@pytest.mark.interpreter
@kernels
def test_fma_gemv_in_float32_is_exact_to_float32(gpu_like):
    """In float32 nothing rounds to bf16 along the way: what the FMA GEMV's unpacking and
    per-group scaling leave is float32's summation error alone."""
    dtype, k, n = torch.float32, 256, 24
    w = packed_random(n, k, 4, 64, dtype, seed=9)
    x = torch.randn(2, k, dtype=dtype, device=DEVICE)
    want = F.linear(x.double(), w.dequantize(torch.float64))
    assert_near(triton_quant.gemv(x, w, tile=SMALL_FMA_TILE), want, dtype)


@pytest.mark.interpreter
@kernels
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64)])
def test_dp4a_gemv_computes_x_as_16_bit_blocks_exactly_as_specified(gpu_like, bits, group):
    """The dp4a GEMV (one row, x as 16-bit integers per 32 values) equals its float64
    specification (`triton_dp4a_gemv.reference`) to float32's summation error, K whole and
    split; x's rounding moves the product a small fraction of the weight's own rounding,
    where int8 x would move it by as much as 8 bits' own."""
    dtype, k, n = torch.float32, 256, 40
    w = packed_random(n, k, bits, group, dtype, seed=bits + group)
    x = torch.randn(1, k, dtype=dtype, device=DEVICE)
    x[0, 37] = 9.0  # (an outlier: its block's other values round coarser)
    x[0, 64:96] = 0.0
    x[0, 65] = 1e-36  # (a block of zeros and one tiny value: its step would overflow float32)
    want = triton_dp4a_gemv.reference(x, w)
    assert want.isfinite().all()
    for splits in (1, 2):
        got = triton_quant.gemv(x, w, splits=splits, tile=SMALL_FMA_TILE, dp4a=True)
        assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    dense = F.linear(x.double(), w.dequantize(torch.float64))
    weight_error = (dense - F.linear(x.double(), w_dense(n, k, bits + group))).abs().max().item()
    x_error = (got.double() - dense).abs().max().item()
    int8_error = (triton_dp4a_gemv.reference(x, w, levels=127.0) - dense).abs().max().item()
    assert x_error < weight_error / 50 and x_error < int8_error / 30


def w_dense(n: int, k: int, seed: int) -> torch.Tensor:
    """The dense weight `packed_random` quantized, in float64."""
    torch.manual_seed(seed)
    return torch.randn(n, k).double().to(DEVICE)


@pytest.mark.interpreter
@kernels
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_dp4a_gemv_fuses_what_the_fma_gemv_fuses(gpu_like, bits, group):
    """RMSNorm + the fused gate_up + SwiGLU, and bias + residual, in bfloat16: near the
    dequantized weight's matmul, and where nothing is fused, its specification's."""
    dtype, k, width = torch.bfloat16, 192, 40
    w = packed_random(2 * width, k, bits, group, dtype, seed=bits + group)
    y_all = w.dequantize(dtype).float()
    norm = RmsNorm(torch.rand(k, dtype=dtype, device=DEVICE) + 0.5, 1e-5)
    bias = torch.randn(2 * width, dtype=dtype, device=DEVICE)
    x = torch.randn(1, k, dtype=dtype, device=DEVICE)
    residual = torch.randn(1, 2 * width, dtype=dtype, device=DEVICE)
    for splits in (1, 2):
        got = triton_quant.gemv(x, w, bias, residual=residual, splits=splits, tile=SMALL_FMA_TILE, dp4a=True)
        assert_near(got, F.linear(x.float(), y_all, bias.float()) + residual.float(), dtype)
        y = F.linear(norm(x).float(), y_all)
        got = triton_quant.gemv(
            x, w, norm_weight=norm.weight, eps=norm.eps, swiglu=True, splits=splits, tile=SMALL_FMA_TILE, dp4a=True
        )
        assert_near(got, F.silu(y[:, :width]) * y[:, width:], dtype)
    plain = triton_quant.gemv(x, w, tile=SMALL_FMA_TILE, dp4a=True)
    assert_near(plain, triton_dp4a_gemv.reference(x, w), dtype)


@pytest.mark.interpreter
@kernels
@pytest.mark.parametrize("shape", sorted(triton_dp4a_gemv.DP4A_SHAPE_TILES))
def test_dp4a_gemv_at_each_shapes_tile_computes_as_specified(gpu_like, shape):
    """The tiles large weights take (1,024-byte rows need K of 2,048 at 4 bits)."""
    tile = dataclasses.replace(triton_dp4a_gemv.DP4A_TILE, **triton_dp4a_gemv.DP4A_SHAPE_TILES[shape])
    w = packed_random(64, 2048, 4, 64, torch.float32, seed=3)
    x = torch.randn(1, 2048, device=DEVICE)
    assert_near(triton_quant.gemv(x, w, tile=tile, dp4a=True), triton_dp4a_gemv.reference(x, w), torch.float32)


def test_large_weights_take_their_shapes_dp4a_tile_and_small_ones_the_default():
    def weight(n: int, k: int, bits: int) -> Packed:  # (never read: only its shape and size count)
        return Packed(torch.empty(n, k * bits // 32, dtype=torch.int32), torch.empty(0), torch.empty(0), bits, 64)

    def change(n: int, k: int, swiglu: bool = False, bits: int = 4) -> dict:
        tile = triton_dp4a_gemv.dp4a_tile(weight(n, k, bits), swiglu)
        default = triton_dp4a_gemv.DP4A_TILE
        return {f: getattr(tile, f) for f in default.__dataclass_fields__ if getattr(tile, f) != getattr(default, f)}

    shapes = triton_dp4a_gemv.DP4A_SHAPE_TILES
    assert change(4096, 4096) == shapes["square"]  # Qwen3-8B's o_proj (8 MiB packed)
    assert change(4096, 12288) == shapes["narrowing"]  # its down
    assert change(2 * 12288, 4096, swiglu=True) == shapes["swiglu"]  # its gate_up
    assert change(32768, 1024) == {}  # widening, as a head
    assert change(1024, 3072) == change(2 * 3072, 1024, swiglu=True) == {}  # Qwen3-0.6B's: small
    assert change(4096, 12288, bits=8) == {}  # 8-bit: not swept


@pytest.mark.interpreter
@kernels
def test_one_row_takes_the_dp4a_gemv_and_more_rows_the_fma_one(gpu_like, monkeypatch):
    calls = []
    monkeypatch.setattr(switches, "dp4a", True)  # (FERRUM_TORCH_DP4A)
    monkeypatch.setattr(triton_quant, "dp4a_gemv", lambda *a, **kw: calls.append("dp4a"))
    monkeypatch.setattr(triton_quant, "fma_gemv", lambda *a, **kw: calls.append("fma"))
    w = packed_random(16, 64, 4, 32, torch.float32, seed=1)
    for rows in (1, 2):
        triton_quant.gemv(torch.randn(rows, 64, device=DEVICE), w)
    monkeypatch.setattr(switches, "dp4a", False)
    triton_quant.gemv(torch.randn(1, 64, device=DEVICE), w)
    assert calls == ["dp4a", "fma", "fma"]  # (the last: with DP4A off)


@pytest.mark.interpreter
@kernels
@pytest.mark.parametrize("bits,group,dtype", CASES[:2])
def test_prefill_matmul_equals_the_dequantized_matmul(gpu_like, bits, group, dtype):
    w = packed_random(72, 192, bits, group, dtype, seed=7)
    x = torch.randn(21, 192, dtype=dtype, device=DEVICE)
    bias = torch.randn(72, dtype=dtype, device=DEVICE)
    for unpack in ("gather", "words"):
        assert_near(triton_quant.matmul(x, w, bias, unpack=unpack), F.linear(x, w.dequantize(dtype), bias), dtype)


@pytest.mark.interpreter
@kernels
@pytest.mark.parametrize(
    "bits,group,dtype", [(4, 32, torch.bfloat16), (4, 64, torch.float16), (8, 128, torch.bfloat16)]
)
def test_the_dequantize_kernel_gives_packed_dequantizes_bits(gpu_like, bits, group, dtype):
    """Prefill's dense weight: rows and K past a whole tile (the last ones partial)."""
    w = packed_random(40, 384, bits, group, dtype, seed=11)
    for mantissa in (False, True):  # (q made a float by a conversion, or in a float's mantissa)
        out = torch.full((40, 384), float("nan"), dtype=dtype, device=DEVICE)
        assert torch.equal(triton_dequant.dequantize(w, out, mantissa=mantissa), w.dequantize(dtype))


@pytest.mark.interpreter
@kernels
def test_dense_matmul_in_row_slices_equals_the_dequantized_matmul(gpu_like):
    """cuBLAS over the weight dequantized into a scratch buffer: whole, or (a small buffer) a
    slice of rows at a time, with the bias and the residual."""
    dtype, n, k = torch.bfloat16, 72, 128
    w = packed_random(n, k, 4, 64, dtype, seed=12)
    x = torch.randn(5, k, dtype=dtype, device=DEVICE)
    bias, residual = torch.randn(n, dtype=dtype, device=DEVICE), torch.randn(5, n, dtype=dtype, device=DEVICE)
    dense = w.dequantize(dtype)
    for values in (n * k, 30 * k):  # whole; three slices, the last partial
        scratch = torch.empty(values, dtype=dtype, device=DEVICE)
        assert_near(quant.dense_matmul(x, w, scratch, bias), F.linear(x, dense, bias), dtype)
        assert_near(quant.dense_matmul(x, w, scratch, residual=residual), residual + F.linear(x, dense), dtype)


@pytest.mark.interpreter
@kernels
def test_a_packed_linear_takes_the_gemv_the_matmul_or_cublas_by_rows(gpu_like, monkeypatch):
    """QuantLinear as on CUDA: each route equals the dequantized weight's matmul."""
    monkeypatch.setattr(quant, "runs_triton", lambda x: True)
    dtype, n, k = torch.float32, 48, 64
    linear = QuantLinear(packed_random(n, k, 4, 32, dtype, seed=13), None, dtype)
    dense = linear.weight.dequantize(dtype)
    for rows in (2, quant.GEMV_MAX_ROWS + 1, quant.DENSE_MIN_ROWS):
        x, residual = torch.randn(rows, k, dtype=dtype, device=DEVICE), torch.randn(rows, n, dtype=dtype, device=DEVICE)
        assert_near(linear(x), F.linear(x, dense), dtype)
        assert_near(linear.plus(x, residual), residual + F.linear(x, dense), dtype)


@pytest.mark.interpreter
@kernels
def test_a_decode_steps_ops_route_packed_linears_to_the_kernels(gpu_like):
    """TritonOps' fused ops over packed linears equal torch's ops over the same linears."""
    dtype, k = torch.float32, 128
    norm = RmsNorm(torch.rand(k, dtype=dtype, device=DEVICE) + 0.5, 1e-5)
    x, residual = torch.randn(2, k, dtype=dtype, device=DEVICE), torch.randn(2, k, dtype=dtype, device=DEVICE)
    qkv = QuantLinear(packed_random(96, k, 4, 32, dtype, 2), torch.randn(96, dtype=dtype, device=DEVICE), dtype)
    gate_up = QuantLinear(packed_random(128, k, 8, 64, dtype, 3), None, dtype)
    down = QuantLinear(packed_random(k, 64, 4, 64, dtype, 4), None, dtype)
    triton_ops, torch_ops = ops.TritonOps(), ops.Ops()
    pairs = [
        (lambda o: o.norm_matmul(x, norm, qkv)),
        (lambda o: o.norm_swiglu(x, norm, gate_up)),
        (lambda o: o.matmul_plus(x[:, :64].contiguous(), down, residual)),
        (lambda o: o.head(qkv, x)),
    ]
    for op in pairs:
        assert_near(op(triton_ops), op(torch_ops), dtype)
    # a verify step's ops take the rows one at a time: each row exactly as its decode step
    by_row = ops.TritonOps(rowwise=True)
    for op in pairs:
        whole = op(by_row)
        alone = [op(_RowsOf(by_row, i)) for i in range(2)]
        assert torch.equal(whole, torch.cat(alone))


class _RowsOf:
    """`ops` on row `i` of the test's inputs only (each call's tensors cut to that row)."""

    def __init__(self, ops, i):
        self.ops, self.i = ops, i

    def __getattr__(self, name):
        method = getattr(self.ops, name)
        cut = lambda t: t[self.i : self.i + 1] if isinstance(t, torch.Tensor) else t  # noqa: E731
        return lambda *args: method(*(cut(a) for a in args))


# experts repeated across tokens, and among a token's top k (the 4th: no router chooses so,
# but the FMA route takes it)
EXPERT_IDS = [[0, 3, 5, 7], [3, 1, 0, 6], [2, 4, 5, 1], [7, 7, 0, 2]]
# a small tile, so that K splits in two at these shapes (the interpreter's SMs give no split)
EXPERT_FMA_TILE = triton_fma_gemv.FmaTile(columns=64, row_bytes=32, per_sm=0)


def gathered_experts(x, ids, weights, gate_up, down, residual):
    """The pairs' activations and residual + their sum per token, as torch's gathered route."""
    from ferrum_mac.backends.torch.pointwise import torch_swiglu

    (tokens, k), chosen = ids.shape, ids.reshape(-1).long()
    rows = x.repeat_interleave(k, dim=0)[:, :, None]
    a = torch_swiglu(torch.bmm(gate_up.chosen(chosen), rows)[..., 0], weights.reshape(-1, 1))
    return a, residual + torch.bmm(down.chosen(chosen), a[:, :, None])[..., 0].view(tokens, k, -1).sum(dim=1)


@pytest.mark.interpreter
@kernels
@pytest.mark.parametrize("bits,group,dtype", [(4, 32, torch.bfloat16), (8, 64, torch.float32)])
def test_packed_experts_kernels_equal_torchs_route_over_them(gpu_like, bits, group, dtype):
    """gate_up + SwiGLU and down + sum over k + residual over packed experts, against the
    gathered route over the same experts dequantized, for 1 to 4 tokens: the FMA GEMV a pair at
    a time (K whole and split) and the tl.dot kernels."""
    experts, hidden, inter, k = 8, 128, 64 if group == 64 else 32, 4
    gate_up = quant.ExpertStack(packed_random(experts * 2 * inter, hidden, bits, group, dtype, 5), experts, dtype)
    down = quant.ExpertStack(packed_random(experts * hidden, inter, bits, group, dtype, 6), experts, dtype)
    for tokens, splits in ((1, 2), (3, None), (4, 2)):
        x, residual = (torch.randn(tokens, hidden, dtype=dtype, device=DEVICE) for _ in range(2))
        ids = torch.tensor(EXPERT_IDS[:tokens], dtype=torch.int32, device=DEVICE)
        weights = torch.softmax(torch.randn(tokens, k, device=DEVICE), dim=-1).to(dtype)
        a, want = gathered_experts(x, ids, weights, gate_up, down, residual)
        fma = triton_fma_gemv.fma_expert_gemv
        got_a = fma(x, ids, gate_up.packed, experts, pair_weights=weights, splits=splits, tile=EXPERT_FMA_TILE)
        assert_near(got_a, a, dtype)
        assert_near(
            fma(a, ids, down.packed, experts, residual=residual, splits=splits, tile=EXPERT_FMA_TILE), want, dtype
        )
        if tokens == 3:  # (the entry point: the FMA route, each token as if alone; and the tl.dot one)
            got = triton_quant.experts_plus(x, ids, weights, gate_up, down, residual)
            assert_near(got, want, dtype)
            one = slice(1, 2)
            alone = triton_quant.experts_plus(x[one], ids[one], weights[one], gate_up, down, residual[one])
            assert torch.equal(got[one], alone)
            assert_near(triton_quant.expert_gate_up_swiglu(x, ids, weights, gate_up), a, dtype)
            assert_near(triton_quant.experts_plus(x, ids, weights, gate_up, down, residual, fma=False), want, dtype)
    assert not triton_splits.split_counters(DEVICE).any()  # (every split's last program reset its counter)


@pytest.mark.interpreter
@kernels
def test_packed_experts_made_dense_on_cuda_are_the_dequantizers_bits(gpu_like, monkeypatch):
    """A prompt's routes take every expert dense (grouped) or the chosen ones (gathered): by
    the Triton dequantizer where it runs, the same bits as `Packed.dequantize`."""
    monkeypatch.setattr(quant, "runs_triton", lambda x: True)
    stack = quant.ExpertStack(packed_random(4 * 32, 128, 4, 64, torch.bfloat16, 7), 4, torch.bfloat16)
    dense = stack.packed.dequantize(torch.bfloat16).view(4, 32, 128)
    assert torch.equal(stack.dense(), dense)
    ids = torch.tensor([2, 0, 2], device=DEVICE)
    assert torch.equal(stack.chosen(ids), dense[ids])


# -- whole models -------------------------------------------------------------------------------

# MLX-style overrides: layer 1's v_proj in 8 bits (its fused qkv mixes bits: dequantized at
# load), layer 3's gate and up in 8 bits of group 64 (fused, still packed).
OVERRIDES = {
    "model.layers.1.self_attn.v_proj": {"group_size": 64, "bits": 8},
    "model.layers.3.mlp.gate_proj": {"group_size": 64, "bits": 8},
    "model.layers.3.mlp.up_proj": {"group_size": 64, "bits": 8},
}


@pytest.fixture(scope="module")
def stories_4bit(tmp_path_factory):
    """stories260K as an MLX affine 4-bit checkpoint (group 32) with per-layer overrides;
    down_proj (172 columns) stays dense, as MLX's converters leave it."""
    mx = mlx_core()
    source = ASSETS / "stories260K"
    if not source.is_dir():
        pytest.skip("stories260K not found in the shared assets")
    folder = tmp_path_factory.mktemp("stories-4bit")
    tensors = {}
    for name, w in mx.load(str(source / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        spec = OVERRIDES.get(module, {"group_size": 32, "bits": 4})
        if name.endswith("_proj.weight") and w.shape[1] % spec["group_size"] == 0:
            q, s, b = mx.quantize(w, **spec)
            tensors.update({name: q, f"{module}.scales": s, f"{module}.biases": b})
        else:
            tensors[name] = w
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "mlx"})
    config = json.loads((source / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, **OVERRIDES}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def greedy_and_logits(llm) -> tuple[list[int], torch.Tensor]:
    logits = llm.prefill("probe", PROMPT).clone()
    llm.release("probe")
    tokens = ferrum_greedy(llm, "greedy", PROMPT, STEPS)
    llm.release("greedy")
    return tokens, logits


def test_an_mlx_4bit_checkpoint_packed_equals_it_dequantized(stories_4bit):
    packed = TorchLLM(load_onto(stories_4bit, CPU), device="cpu", packed=True)
    layers = packed.model.layers
    assert isinstance(layers[0].attn.qkv, QuantLinear) and layers[0].attn.qkv.weight.bits == 4
    assert isinstance(layers[1].attn.qkv, Linear)  # 4- and 8-bit parts: dequantized
    assert isinstance(layers[3].mlp.gate_up, QuantLinear) and layers[3].mlp.gate_up.weight.bits == 8
    assert isinstance(layers[0].mlp.down, Linear)
    dense = TorchLLM(load_onto(stories_4bit, CPU), device="cpu", packed=False)
    assert isinstance(dense.model.layers[0].attn.qkv, Linear)
    got, want = greedy_and_logits(packed), greedy_and_logits(dense)
    assert torch.equal(got[1], want[1])
    assert got[0] == want[0]


def test_quantizing_at_load_runs_the_weights_it_quantized():
    source = ASSETS / "stories260K"
    if not source.is_dir():
        pytest.skip("stories260K not found in the shared assets")
    quantized = TorchLLM(load_onto(source, CPU), device="cpu", quant="4bit")
    assert isinstance(quantized.model.layers[0].attn.qkv, QuantLinear)
    assert quantized.model.layers[0].attn.qkv.weight.group_size == quant.ON_THE_FLY_GROUP
    assert isinstance(quantized.model.head, QuantLinear)  # the tied head: a packed copy of the embedding
    reference = load_onto(source, CPU)
    for name, w in reference.tensors.items():
        if name.endswith("_proj.weight") and w.shape[1] % quant.ON_THE_FLY_GROUP == 0:
            reference.tensors[name] = quant.quantize(w, 4).dequantize(w.dtype)
    embed = reference.tensors["embed_tokens.weight"]
    reference.tensors["lm_head.weight"] = quant.quantize(embed, 4).dequantize(embed.dtype)
    reference.config.tie_word_embeddings = False
    got, want = greedy_and_logits(quantized), greedy_and_logits(TorchLLM(reference, device="cpu"))
    assert torch.equal(got[1], want[1])
    assert got[0] == want[0]


def test_open_model_quantizes_on_torch_and_refuses_elsewhere():
    import ferrum_mac

    source = ASSETS / "stories260K"
    if not source.is_dir():
        pytest.skip("stories260K not found in the shared assets")
    llm = ferrum_mac.open_model(source, backend="torch", device="cpu", quant="8bit")
    assert llm.model.layers[0].attn.qkv.weight.bits == 8
    with pytest.raises(FerrumError, match="unknown quantization '2bit'"):
        ferrum_mac.open_model(source, backend="torch", device="cpu", quant="2bit")
    with pytest.raises(FerrumError, match="quantizing at load .* runs on the torch backend"):
        ferrum_mac.open_model(source, backend="mlx", quant="4bit")


@pytest.fixture(scope="module")
def quantized_moe(zoo) -> Checkpoint:
    """A tiny random Qwen3-MoE whose experts are stacked and quantized as mlx-lm stores them
    (`switch_mlp`, 4-bit, group 32); the rest dense."""
    mx = mlx_core()
    from ferrum_mac.weights import config_from_dict
    from ferrum_mac.weights.moe import moe_config
    from ferrum_mac.weights.safetensors import canonical_name

    hf = zoo.hf("qwen3_moe")  # (the session's tiny model of the family)
    raw = {**hf.config.to_dict(), "quantization": {"group_size": 32, "bits": 4}}
    config = config_from_dict(raw)
    tensors = {}
    for name, t in hf.state_dict().items():
        name = canonical_name(name)
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = t.detach().clone()
            continue
        prefix = name.rsplit(".experts.", 1)[0] + ".switch_mlp"
        inter = moe_config(config).intermediate_size
        parts = {"down_proj": t} if name.endswith("down_proj") else {"gate_proj": t[:, :inter], "up_proj": t[:, inter:]}
        for part, w in parts.items():
            q, scales, biases = mx.quantize(mx.array(w.detach().numpy()), group_size=32, bits=4)
            for suffix, array in (("weight", q), ("scales", scales), ("biases", biases)):
                tensors[f"{prefix}.{part}.{suffix}"] = torch.from_numpy(np.array(array))
    return Checkpoint(config, tensors, ASSETS / "random-qwen3-moe-4bit", "mlx-quantized")


def test_packed_moe_experts_equal_them_dequantized(quantized_moe):
    """Gathered (only the chosen experts dequantized: decode, short prompts) and grouped (all);
    the dense model's short prompts take the grouped route, so they agree to float32's rounding."""
    models = {}
    for packed in (True, False):
        c = quantized_moe
        copy = Checkpoint(c.config, dict(c.tensors), c.path, c.format)
        models[packed] = TorchLLM(copy, dtype="float32", device="cpu", kv_capacity=64, packed=packed)
    experts = models[True].model.layers[0].mlp.experts
    assert isinstance(experts.gate_up, quant.ExpertStack) and experts.route(8) == "gathered"
    assert isinstance(models[False].model.layers[0].mlp.experts.gate_up, torch.Tensor)
    short, long = [1, 40, 26, 35, 4], [1 + (7 * i) % 300 for i in range(24)]  # long: 96 pairs, all experts dequantized
    for prompt in (short, long):
        got, want = (m.prefill("p", prompt) for m in (models[True], models[False]))
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        for m in models.values():
            m.release("p")
    assert ferrum_greedy(models[True], "g", short, 8) == ferrum_greedy(models[False], "g", short, 8)


@pytest.mark.interpreter
@kernels
def test_a_decode_steps_moe_block_over_packed_experts_equals_torchs(quantized_moe, gpu_like):
    """`TritonOps.sparse_moe` (router kernel, then the packed-expert kernels) on a real layer."""
    c = quantized_moe
    llm = TorchLLM(Checkpoint(c.config, dict(c.tensors), c.path, c.format), dtype="float32", device="cpu", packed=True)
    moe = llm.model.layers[0].mlp
    torch.manual_seed(0)
    x, residual = (torch.randn(2, c.config.hidden_size) for _ in range(2))
    assert_near(ops.TritonOps().sparse_moe(moe, x, residual), ops.Ops().sparse_moe(moe, x, residual), torch.float32)


class _MoeOnTriton(ops.TritonOps):
    """Torch's ops but for the MoE blocks: Triton's there (on the CPU, under the interpreter)."""

    triton = False  # attention stays torch's
    rms_norm, swiglu, attention = ops.Ops.rms_norm, ops.Ops.swiglu, ops.Ops.attention

    def __init__(self):
        super().__init__(gemv=frozenset())


@pytest.mark.interpreter
@kernels
def test_a_packed_moes_greedy_decode_on_the_fma_experts_gives_torchs_tokens(quantized_moe, gpu_like, monkeypatch):
    """The tiny Qwen3-MoE, 4-bit experts: greedy decode with its MoE blocks on Triton (the FMA
    GEMV a token-expert pair at a time) gives the torch route's tokens, and nearly its logits."""
    from ferrum_mac.backends.torch import steps

    c = quantized_moe
    llm = TorchLLM(Checkpoint(c.config, dict(c.tensors), c.path, c.format), dtype="float32", device="cpu", packed=True)
    prompt, runs = [1, 40, 26, 35, 4], []
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: ops.TORCH_OPS)
    want = ferrum_greedy(llm, "torch", prompt, 6), llm.decode("torch", 3, len(prompt) + 5)
    llm.reset()  # drops the decode steps: the next run makes its own
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: _MoeOnTriton())
    fma = triton_fma_gemv.fma_expert_gemv
    wide = triton_fma_gemv.FmaTile(columns=256, per_sm=0)  # (fewer programs: the interpreter runs one at a time)
    monkeypatch.setattr(
        triton_quant, "fma_expert_gemv", lambda *args, **kw: runs.append(1) or fma(*args, **kw, tile=wide)
    )
    got = ferrum_greedy(llm, "triton", prompt, 6), llm.decode("triton", 3, len(prompt) + 5)
    assert runs, "the experts ran on the FMA GEMV"
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_the_smollm2_gguf_packed_equals_it_dequantized(smollm2_gguf):
    """Its first 2 of 30 layers: on this CPU every matmul of the packed path dequantizes its
    weight, which is too slow for the suite over a whole model."""
    checkpoint = load_onto(smollm2_gguf, CPU)
    checkpoint.config.num_layers = 2
    models = {}
    for packed in (True, False):
        copy = Checkpoint(checkpoint.config, dict(checkpoint.tensors), checkpoint.path, checkpoint.format)
        models[packed] = TorchLLM(copy, dtype="float32", device="cpu", kv_capacity=64, packed=packed)
    assert isinstance(models[True].model.layers[0].mlp.gate_up, QuantLinear)
    got, want = greedy_and_logits(models[True]), greedy_and_logits(models[False])
    assert torch.equal(got[1], want[1])
    assert got[0] == want[0]


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs a CUDA GPU")
def test_the_smollm2_gguf_on_cuda_packed_gives_the_dequantized_models_tokens(smollm2_gguf):
    """The Triton kernels through whole decode steps (CUDA graphs) and prefill."""
    packed = TorchLLM(load_onto(smollm2_gguf, DEVICE), device="cuda", kv_capacity=256)
    assert isinstance(packed.model.layers[0].mlp.gate_up, QuantLinear)
    tokens = greedy_and_logits(packed)[0]
    dense = TorchLLM(load_onto(smollm2_gguf, DEVICE), device="cuda", kv_capacity=256, packed=False)
    assert tokens == greedy_and_logits(dense)[0]
