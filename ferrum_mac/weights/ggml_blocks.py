"""ggml's tensor blocks decoded with numpy, each type into the layout the backends compute fastest.

A block of `(values, bytes)` (`gguf_header.BLOCKS`) decodes into MLX's affine layout where the type is a
scale times an integer plus a bias per group of 32-128 values (`Affine`: unsigned codes, a
float16 scale and bias per group, w = scale * code + bias), else into a dense array. Which
types map how (`LAYOUTS`), and how close each is to ggml's own dequantization in float32:

  exact (every value bit for bit):
    Q4_0, Q4_1, Q8_0, Q5_0, Q5_1   the type's own bits, group 32
    Q3_K      8-bit, group 128: (sub-scale - 32) * q in [-124, 128], the code 128 minus it
              under the super-block's -d (sub-blocks of 16 share d, so 8 bits hold both)
    IQ4_NL    8-bit, group 32: the table's integer + 128 under d
    MXFP4     5-bit, group 32: twice the e2m1 value + 12 under the power-of-two scale (exact
              while 2^(e-128) is a float16: a block under 2^-24 reads as 0, one over 2^9 is
              refused, and none of them is seen in real checkpoints)
    F32, F16, BF16 (dense, as stored)
  exact with float32 scales and biases (each backend rounds them once, to its compute dtype,
  as it does any checkpoint's scales: float16 on CUDA's kernels, 2^-11 of |scale * q| + |bias|):
    Q4_K, Q5_K   scale d * sub-scale, bias -dmin * sub-min (6-bit each)
    IQ4_XS       8-bit: scale d * (sub-scale - 32), bias -128 * scale (the product in float32
                 may round once where ggml's does not: 17 bits of scale times 8 of code)
  dense float16, one rounding of ggml's float32 value (sub-blocks of 16 values, which no
  MLX group size holds, each with its own scale):
    Q2_K, Q6_K
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
# type -> (bits, group size) of its affine layout, or the numpy dtype name it is dense in
LAYOUTS: dict[str, tuple[int, int] | str] = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q8_0": (8, 32),
    "Q5_0": (5, 32),
    "Q5_1": (5, 32),
    "Q2_K": "float16",
    "Q3_K": (8, 128),
    "Q4_K": (4, 32),
    "Q5_K": (5, 32),
    "Q6_K": "float16",
    "IQ4_NL": (8, 32),
    "IQ4_XS": (8, 32),
    "MXFP4": (5, 32),
}
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)  # e2m1, doubled
# the tables as codes: value + 128 (8 bits), value + 12 (5 bits)
IQ4_CODES, MXFP4_CODES = (IQ4_VALUES + 128).astype(np.uint8), (MXFP4_VALUES + 12).astype(np.uint8)


@dataclass
class Affine:
    """Blocks as w = scale * code + bias: codes uint8 `(blocks, values)`, float16 (float32
    where a product of two stored numbers) scales and biases `(blocks, groups)`."""

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray


def decode(blocks: np.ndarray, kind: str) -> Affine | np.ndarray:
    """`(n, bytes per block)` uint8 blocks of ggml type `kind` (a key of `LAYOUTS`): its
    `Affine` form, or its dense values `(n, values per block)`."""
    return DECODERS[kind](blocks)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, `(n, 1)`."""
    return blocks[:, at : at + 2].copy().view(np.float16)


def _f32(blocks: np.ndarray, at: int) -> np.ndarray:
    return _f16(blocks, at).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit packing: byte j of `(n, m)` holds value j (low) and j + m (high)."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1)


def _bits(words: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each little-endian word (uint8 `(..., count)`)."""
    return ((words[..., None] >> np.arange(count, dtype=words.dtype)) & 1).astype(np.uint8)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit sub-block scales and eight mins."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mins = np.concatenate((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return scales, mins


def q4_0(b: np.ndarray) -> Affine:  # d, 16 bytes of q: w = d * (q - 8)
    d = _f16(b, 0)
    return Affine(_nibbles(b[:, 2:18]), d, d * np.float16(-8))


def q4_1(b: np.ndarray) -> Affine:  # d, m, 16 bytes of q: w = d * q + m
    return Affine(_nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2))


def q8_0(b: np.ndarray) -> Affine:  # d, 32 int8: w = d * q, q + 128 unsigned
    d = _f16(b, 0)
    return Affine((b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, d * np.float16(-128))


def q5_0(b: np.ndarray) -> Affine:  # d, 32 high bits, 16 bytes of low nibbles: w = d * (q - 16)
    d = _f16(b, 0)
    high = _bits(b[:, 2:6].copy().view(np.uint32)[:, 0], 32)
    return Affine(_nibbles(b[:, 6:22]) | (high << 4), d, d * np.float16(-16))


def q5_1(b: np.ndarray) -> Affine:  # d, m, 32 high bits, 16 bytes of low nibbles: w = d * q + m
    high = _bits(b[:, 4:8].copy().view(np.uint32)[:, 0], 32)
    return Affine(_nibbles(b[:, 8:24]) | (high << 4), _f16(b, 0), _f16(b, 2))


def q2_k(b: np.ndarray) -> np.ndarray:
    """16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit q, d, dmin; sub-blocks of 16:
    w = d * scale * q - dmin * min. Byte j of each 32 holds values j, j + 32, j + 64, j + 96
    of its 128 (two bits each, lowest first)."""
    n = len(b)
    sub, d, dmin = b[:, 0:16], _f32(b, 80), _f32(b, 82)
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    scale = (d * (sub & 15).astype(np.float32))[:, :, None]
    low = (dmin * (sub >> 4).astype(np.float32))[:, :, None]
    return (scale * q.reshape(n, 16, 16).astype(np.float32) - low).reshape(n, QK_K).astype(np.float16)


def q3_k(b: np.ndarray) -> Affine:
    """32 bytes of high bits, 64 bytes of low 2-bit q, 12 bytes of 6-bit scales, d; sub-blocks
    of 16: w = d * (scale - 32) * q, q = low - 4 where the high bit is clear."""
    n = len(b)
    low = (b[:, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    high = (b[:, 0:32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = low.reshape(n, 16, 16).astype(np.int16) - 4 * (1 - high.reshape(n, 16, 16).astype(np.int16))
    packed = b[:, 96:108]
    lo = (packed[:, 0:8, None] >> np.array([0, 4], dtype=np.uint8)).transpose(0, 2, 1).reshape(n, 16) & 15
    hi = (packed[:, 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 2, 1).reshape(n, 16) & 3
    scale = (lo | (hi << 4)).astype(np.int16) - 32
    codes = (128 - scale[:, :, None] * q).reshape(n, QK_K).astype(np.uint8)  # in [0, 252]
    d = _f16(b, 108)
    return Affine(codes, np.repeat(-d, 2, axis=1), np.repeat(d * np.float16(128), 2, axis=1))


def q4_k(b: np.ndarray) -> Affine:
    """d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of q; sub-blocks of 32:
    w = d * scale * q - dmin * min. Each 32 bytes hold two sub-blocks (low nibbles, then high)."""
    n = len(b)
    scale, low = _k_scale_and_bias(b)
    q = b[:, 16:144].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]
    return Affine((q & 15).reshape(n, QK_K), scale, low)


def q5_k(b: np.ndarray) -> Affine:
    """As Q4_K, with 32 bytes of fifth bits first: bit j of byte i is sub-block j's value i."""
    n = len(b)
    scale, low = _k_scale_and_bias(b)
    q = (b[:, 48:176].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 15
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return Affine((q.reshape(n, 8, 32) | (high << 4)).reshape(n, QK_K), scale, low)


def _k_scale_and_bias(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scales, mins = _k_scales(b[:, 4:16])
    return _f32(b, 0) * scales.astype(np.float32), -(_f32(b, 2) * mins.astype(np.float32))


def q6_k(b: np.ndarray) -> np.ndarray:
    """128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, d; sub-blocks of 16:
    w = d * scale * (q - 32). Each half of 128 values: its 64 low-nibble bytes hold values j
    and j + 64, its 32 high-bit bytes values j, j + 32, j + 64, j + 96."""
    n = len(b)
    low = (b[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 15
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = (low.reshape(n, 2, 4, 32) | (high << 4)).astype(np.float32) - 32
    scale = _f32(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return (scale[:, :, None] * q.reshape(n, 16, 16)).reshape(n, QK_K).astype(np.float16)


def iq4_nl(b: np.ndarray) -> Affine:  # d, 16 bytes of 4-bit indexes into IQ4_VALUES: w = d * value
    d = _f16(b, 0)
    return Affine(IQ4_CODES[_nibbles(b[:, 2:18])], d, d * np.float16(-128))


def iq4_xs(b: np.ndarray) -> Affine:
    """d, 16 bits of 2-bit scale highs, 4 bytes of 4-bit scale lows, 8 x 16 bytes of indexes;
    sub-blocks of 32: w = d * (scale - 32) * IQ4_VALUES[index]."""
    n = len(b)
    lows = (b[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(n, 8) & 15
    highs = (b[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    sub = (lows | (highs.astype(np.uint8) << 4)).astype(np.float32) - 32
    scale = _f32(b, 0) * sub
    codes = IQ4_CODES[_nibbles(b[:, 8:136].reshape(n, 8, 16))]
    return Affine(codes.reshape(n, QK_K), scale, scale * np.float32(-128))


def mxfp4(b: np.ndarray) -> Affine:
    """An e8m0 exponent e, 16 bytes of e2m1 indexes (ggml's nibble order): w = value * 2^(e-127),
    here twice the value * 2^(e-128) (`e8m0_scale`)."""
    scale = e8m0_scale(b[:, 0:1])
    codes = MXFP4_CODES[_nibbles(b[:, 1:17])]
    with np.errstate(over="ignore"):
        return Affine(codes, scale.astype(np.float16), (scale * -12).astype(np.float16))


def e8m0_scale(e: np.ndarray) -> np.ndarray:
    """2^(e - 128) in float32 (ggml's e8m0 to float "half", subnormal for e < 2)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)


DECODERS = {
    "Q4_0": q4_0,
    "Q4_1": q4_1,
    "Q8_0": q8_0,
    "Q5_0": q5_0,
    "Q5_1": q5_1,
    "Q2_K": q2_k,
    "Q3_K": q3_k,
    "Q4_K": q4_k,
    "Q5_K": q5_k,
    "Q6_K": q6_k,
    "IQ4_NL": iq4_nl,
    "IQ4_XS": iq4_xs,
    "MXFP4": mxfp4,
}


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes `(rows, k)` -> MLX's uint32 words `(rows, k * bits / 32)`: a little-endian
    bit stream, value i at bit i * bits (4 and 8 bits: whole bytes)."""
    rows, k = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes).view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.uint32)
    # 8 values fill `bits` whole bytes: byte j gathers the bits of the values crossing it
    values = [codes[:, i::8] for i in range(8)]
    stream = np.zeros((rows, k // 8, bits), dtype=np.uint8)
    for j in range(bits):
        for i in range(8):
            shift = bits * i - 8 * j  # where value i's lowest bit lands in byte j
            if -bits < shift < 8:
                stream[:, :, j] |= values[i] << shift if shift >= 0 else values[i] >> -shift
    return stream.reshape(rows, -1).view(np.uint32)
