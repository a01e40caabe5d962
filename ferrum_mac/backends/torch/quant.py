"""Weights that stay 4-bit or 8-bit on the torch backend: `Packed` (one layout for every
quantized source) and `QuantLinear`, the linear layer over it.

The layout is MLX's affine one, which every source maps onto without touching the values:
`words` int32 `(out, in * bits / 32)`, each word holding 32 / bits consecutive values along
`in`, lowest bits first; `scales` and `biases` `(out, in / group_size)` in the file's float
dtype, a weight being `scale * q + bias` of its group. MLX affine checkpoints are this
layout already; GGUF's quantized types arrive in it from the GGUF reader
(`weights.ggml_blocks`: Q4_0 as bias = -8 * scale, Q8_0 as bias = -128 * scale after an offset
of the int8s, ...), those of 5 bits widened to 8 (`Packed.widened`); a
dense checkpoint is quantized into it at load (`quantize`). A Triton kernel reads it as it
is (`triton_quant`): words along K are what a program loads in one go, and the scales of
a group of 32-128 values cost a few percent of the bytes.

On CUDA (where triton imports) `QuantLinear` runs the Triton kernels: a GEMV for a few rows,
a tiled matmul that dequantizes its tile of the weight for more, and for a prompt's many rows
the whole weight dequantized by one kernel into a scratch buffer kept per device and dtype,
then cuBLAS's matmul (`dense_matmul`: tensor-core tiles no Triton matmul over packed tiles
matches, for the price of writing the dense weight once). Elsewhere (the CPU) it
dequantizes the weight for each matmul: the reference the kernels are tested against, and
a way to run any torch path here.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ferrum_mac.errors import FerrumError, UnsupportedModelError

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# quantizing a dense checkpoint at load (`open_model(..., quant=)`): name -> bits
ON_THE_FLY = {"4bit": 4, "8bit": 8}
ON_THE_FLY_GROUP = 64
# At most this many rows take the Triton GEMV (a weight read once for all of them); more
# take the tiled matmul, and from DENSE_MIN_ROWS on the weight dequantized into a scratch
# buffer and cuBLAS's matmul (`dense_matmul`: its dequantizing costs the same for any rows,
# so it pays where the rows are many).
GEMV_MAX_ROWS = 8
DENSE_MIN_ROWS = 64
# A scratch buffer's values: the largest packed linear's made (`reserve_scratch`), within
# these bounds (a larger weight is dequantized and multiplied a slice of its rows at a time).
SCRATCH_VALUES = (1 << 22, 1 << 27)


@dataclass
class Packed:
    """A quantized `(out, in)` weight in the layout above."""

    words: torch.Tensor  # int32 (out, in * bits // 32)
    scales: torch.Tensor  # (out, in // group_size)
    biases: torch.Tensor  # (out, in // group_size)
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0], self.words.shape[1] * 32 // self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.biases))

    def to(self, device: torch.device) -> Packed:
        return Packed(
            *(t.to(device).contiguous() for t in (self.words, self.scales, self.biases)), self.bits, self.group_size
        )

    def codes(self) -> torch.Tensor:
        """The unsigned values q `(out, in)`: uint8 for 4 and 8 bits (a word's bytes in order,
        as the words are little-endian), int32 otherwise (3, 5, 6 bits: a bit stream, eight
        values to `bits` bytes)."""
        out = self.words.shape[0]
        if self.bits in (4, 8):
            octets = self.words.view(torch.uint8)
            return octets if self.bits == 8 else torch.stack((octets & 15, octets >> 4), dim=-1).view(out, -1)
        device, mask = self.words.device, (1 << self.bits) - 1
        if 32 % self.bits == 0:
            shifts = torch.arange(0, 32, self.bits, device=device, dtype=torch.int32)
            return ((self.words[:, :, None] >> shifts) & mask).view(out, -1)
        octets = self.words.view(torch.uint8).view(out, -1, self.bits).to(torch.int64)
        eights = (octets << torch.arange(0, 8 * self.bits, 8, device=device)).sum(dim=-1)  # (disjoint bits)
        shifts = torch.arange(0, 8 * self.bits, self.bits, device=device)
        return ((eights[:, :, None] >> shifts) & mask).view(out, -1).to(torch.int32)

    def with_scales(self, dtype: torch.dtype) -> Packed:
        return Packed(self.words, self.scales.to(dtype), self.biases.to(dtype), self.bits, self.group_size)

    def widened(self) -> Packed:
        """The same values in 8-bit words (the kernels' widest), for 2-, 3-, 5- and 6-bit ones."""
        return Packed(pack_codes(self.codes(), 8), self.scales, self.biases, 8, self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight `(out, in)`: scale * q + bias in float32 (exact for 16-bit scales
        and these q), rounded once to `dtype`."""
        out, k = self.shape
        q = self.codes().view(out, k // self.group_size, self.group_size).float()
        dense = q.mul_(self.scales.float()[:, :, None]).add_(self.biases.float()[:, :, None])  # (q * scale: exact)
        return dense.view(out, k).to(dtype)


def bytes_per_weight(bits: int, group_size: int, scale_bytes: int) -> float:
    """Bytes a packed weight takes per value: its bits, and its group's scale and bias."""
    return bits / 8 + 2 * scale_bytes / group_size


def kernels_take(bits: int, group_size: int) -> bool:
    return bits in BITS and group_size in GROUP_SIZES


def reads_without_mlx(quantization: dict) -> bool:
    """Whether a checkpoint's `quantization` (config.json's) is all in bits whose words hold
    whole values (`Packed.dequantize` reads those; MLX's 3-, 5- and 6-bit words do not)."""
    specs = [quantization, *(v for v in quantization.values() if isinstance(v, dict))]
    return all(spec.get("bits", quantization.get("bits")) in (2, 4, 8) for spec in specs)


def checked_quant(name: str | None) -> str | None:
    """An on-the-fly quantization's name (None: none), refused with a one-line error unless known."""
    if name is not None and name not in ON_THE_FLY:
        raise FerrumError(f"unknown quantization {name!r}; choose one of: {', '.join(ON_THE_FLY)}")
    return name


def from_mlx(weight, scales, biases, bits: int, group_size: int) -> Packed:
    """MLX affine arrays (uint32 words, scales, biases: `mx.array`s or torch tensors) as a
    CPU `Packed`, without changing a bit."""
    from ferrum_mac.backends.torch.weights import to_torch

    words = weight if isinstance(weight, torch.Tensor) else torch.from_numpy(np.array(weight, copy=True))
    return Packed(words.view(torch.int32), to_torch(scales), to_torch(biases), bits, group_size)


def read_gguf(shards) -> dict:
    """A GGUF model's canonical tensors as CPU torch tensors in the layout MLX would give them
    (`weights.gguf_tensors`): the torch backend's reader (`weights.load_onto`), which needs no MLX."""
    from ferrum_mac.weights.gguf import architecture, canonical_name
    from ferrum_mac.weights.gguf_tensors import read_tensors

    arch = architecture(shards[0][1])
    return read_tensors(shards, lambda name: canonical_name(name, arch), _torch_tensor)


def _torch_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(array).view(torch.bfloat16)
    return torch.from_numpy(array.view(np.int32) if dtype == "uint32" else array)


def quantize(weight: torch.Tensor, bits: int, group_size: int = ON_THE_FLY_GROUP) -> Packed:
    """A dense `(out, in)` weight quantized affinely per group of `group_size` along `in`:
    the group's min is the bias and (max - min) / (2^bits - 1) the scale, both rounded to the
    weight's dtype first, so that q is the nearest code under the stored scale and bias."""
    out, k = weight.shape
    if k % group_size:
        raise UnsupportedModelError(f"cannot quantize a weight of {k} columns in groups of {group_size}")
    groups = weight.float().view(out, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    levels = (1 << bits) - 1
    scales = ((high - low) / levels).clamp_min(1e-8).to(weight.dtype)
    biases = low.to(weight.dtype)
    q = torch.round((groups - biases.float()[..., None]) / scales.float()[..., None]).clamp_(0, levels).to(torch.int32)
    return Packed(pack_codes(q.view(out, k), bits), scales, biases, bits, group_size)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes `(out, in)` -> int32 words `(out, in * bits // 32)`, lowest bits first."""
    per_word = 32 // bits
    out, k = q.shape
    shifts = torch.arange(0, 32, bits, device=q.device, dtype=torch.int64)
    words = (q.view(out, k // per_word, per_word).to(torch.int64) << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the same 32 bits, signed


def concatenated(parts: list[Packed]) -> Packed | None:
    """Packed weights that read the same input, stacked along `out` (as `layers.fuse` stacks
    dense ones); None when their bits, groups or scale dtypes differ (per-layer overrides)."""
    return per_expert_concatenated(parts, 1)


def per_expert_concatenated(parts: list[Packed], experts: int) -> Packed | None:
    """Stacked experts' packed weights side by side per expert (as `layers.fuse` puts dense
    ones side by side): expert e's rows of each part in turn; None where they do not share
    bits, groups and scale dtypes."""
    first = parts[0]
    if any((p.bits, p.group_size, p.scales.dtype) != (first.bits, first.group_size, first.scales.dtype) for p in parts):
        return None

    def side_by_side(tensors: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.cat([t.view(experts, -1, t.shape[-1]) for t in tensors], dim=1)
        return stacked.reshape(-1, stacked.shape[-1])

    return Packed(
        side_by_side([p.words for p in parts]),
        side_by_side([p.scales for p in parts]),
        side_by_side([p.biases for p in parts]),
        first.bits,
        first.group_size,
    )


class ExpertStack:
    """Stacked experts' weights `(experts, out, in)` kept packed, as one `Packed` of
    `(experts * out, in)`; dequantized when used: all of them (`dense`), or only the experts a
    step chose (`chosen`), in the model's `dtype`."""

    def __init__(self, packed: Packed, experts: int, dtype: torch.dtype):
        self.packed, self.experts, self.dtype = packed, experts, dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        rows, k = self.packed.shape
        return self.experts, rows // self.experts, k

    def dense(self) -> torch.Tensor:
        """Every expert dense (a prompt's grouped route)."""
        return self._dequantized(self.packed).view(self.shape)

    def chosen(self, ids: torch.Tensor) -> torch.Tensor:
        """`(len(ids), out, in)`: expert ids[i]'s weight at i (ids on the device: no host sync)."""
        experts, out, k = self.shape
        parts = (t.view(experts, out, -1)[ids].reshape(len(ids) * out, -1) for t in self._tensors())
        return self._dequantized(Packed(*parts, self.packed.bits, self.packed.group_size)).view(len(ids), out, k)

    def _dequantized(self, packed: Packed) -> torch.Tensor:
        """`packed` dense in the model's dtype: on CUDA written by the Triton dequantizer, with
        no float32 copy on the way (the same values)."""
        if not runs_triton(packed.words):
            return packed.dequantize(self.dtype)
        from ferrum_mac.backends.torch.kernels import triton_dequant

        out = torch.empty(packed.shape, dtype=self.dtype, device=packed.words.device)
        return triton_dequant.dequantize(packed, out)

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.packed.words, self.packed.scales, self.packed.biases


class QuantLinear:
    """y = x W^T (+ b) over a `Packed` W, computing in x's dtype (`dtype`: the model's).
    `sizes_scratch`: whether a prompt's rows come through it, so that the scratch buffers should
    hold its weight whole (not a model's head, which takes a prompt's last row)."""

    quantized = True

    def __init__(
        self,
        weight: Packed,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        sizes_scratch: bool = True,
    ):
        self.weight, self.bias, self.dtype = weight, bias, dtype
        if sizes_scratch:
            reserve_scratch(weight.shape[0] * weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not runs_triton(x):
            return F.linear(x, self.weight.dequantize(x.dtype), self.bias)
        from ferrum_mac.backends.torch.kernels import triton_quant

        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= GEMV_MAX_ROWS:
            y = triton_quant.gemv(rows, self.weight, self.bias)
        elif rows.shape[0] >= DENSE_MIN_ROWS:
            y = dense_matmul(rows, self.weight, scratch_for(x.device, x.dtype), self.bias)
        else:
            y = triton_quant.matmul(rows, self.weight, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T (+ b), the residual added to the float32 sum where a kernel can
        (and off CUDA as `Linear.plus` adds it: one addmm)."""
        if x.dim() != 2 or self.bias is not None:
            return residual + self(x)
        if not runs_triton(x):
            return torch.addmm(residual, x, self.weight.dequantize(x.dtype).t())
        from ferrum_mac.backends.torch.kernels import triton_quant

        if x.shape[0] <= GEMV_MAX_ROWS:
            return triton_quant.gemv(x, self.weight, residual=residual)
        if x.shape[0] >= DENSE_MIN_ROWS:
            return dense_matmul(x, self.weight, scratch_for(x.device, x.dtype), residual=residual)
        return residual + triton_quant.matmul(x, self.weight)


def dense_matmul(
    x: torch.Tensor,
    weight: Packed,
    scratch: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x `(M, K)` times the packed W `(N, K)` transposed (+ bias, + residual) -> `(M, N)` by
    cuBLAS, over W dequantized into `scratch` (`triton_dequant.dequantize`, x's dtype): whole
    where it fits, else a slice of W's rows at a time. The residual is cuBLAS's accumulator."""
    with scratch_lock:  # (another model's thread may use the buffer: one stream, so enqueue in turn)
        return _dense_matmul(x, weight, scratch, bias, residual)


def _dense_matmul(x, weight: Packed, scratch: torch.Tensor, bias, residual) -> torch.Tensor:
    from ferrum_mac.backends.torch.kernels import triton_dequant

    n, k = weight.shape
    step = scratch.numel() // k
    assert step > 0 and scratch.dtype == x.dtype
    if step >= n:
        dense = triton_dequant.dequantize(weight, scratch[: n * k].view(n, k))
        if residual is None:
            return F.linear(x, dense, bias)
        if bias is not None:
            return residual + F.linear(x, dense, bias)
        return torch.addmm(residual, x, dense.t())
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    for start in range(0, n, step):
        end = min(n, start + step)
        part = Packed(
            *(t[start:end] for t in (weight.words, weight.scales, weight.biases)), weight.bits, weight.group_size
        )
        dense = triton_dequant.dequantize(part, scratch[: (end - start) * k].view(end - start, k))
        out[:, start:end] = F.linear(x, dense, None if bias is None else bias[start:end])
    return out if residual is None else residual + out


# the scratch buffers' size in values (`reserve_scratch`), and the buffers by (device, dtype)
_scratch_values = SCRATCH_VALUES[0]
_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# held while a dequantize and the matmul reading it are enqueued, or a captured step that
# holds both is replayed (`steps.PrefillStep`); reentrant, as a capture runs the calls inside it
scratch_lock = threading.RLock()


def reserve_scratch(values: int) -> None:
    """Size the scratch buffers made from now on for a weight of `values` values (up to
    SCRATCH_VALUES' bound): a packed linear says so when it is made, before any buffer is."""
    global _scratch_values
    _scratch_values = max(_scratch_values, min(values, SCRATCH_VALUES[1]))


def scratch_for(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The scratch buffer of `device` and `dtype` that `dense_matmul` dequantizes into: made on
    first use and never replaced or freed (a captured prefill step's graph holds its address;
    a later, larger model's weights go through it in slices)."""
    key = (device, dtype)
    if key not in _scratch:
        _scratch[key] = torch.empty(_scratch_values, dtype=dtype, device=device)
    return _scratch[key]


def runs_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take x: on CUDA, where triton imports."""
    return x.device.type == "cuda" and triton_imports()


@functools.cache
def triton_imports() -> bool:
    try:
        from ferrum_mac.backends.torch.kernels import triton_quant
    except ImportError:
        return False
    return triton_quant.triton is not None
