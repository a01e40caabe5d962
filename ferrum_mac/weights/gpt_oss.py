"""gpt-oss's experts: their config keys and every checkpoint layout, read the same way by every backend.

Layouts of a layer's experts, all brought to mlx-lm's names (`mlp.experts.{gate,up,down}_proj`
`.weight` `(E, out, in)` and `.bias` `(E, out)`, which MLX conversions already use):

- transformers' `save_pretrained`: `mlp.experts.gate_up_proj` `(E, hidden, 2 * inter)` with
  gate and up interleaved along the last dim (gate at even columns), its bias
  `gate_up_proj_bias` `(E, 2 * inter)` likewise; `down_proj` `(E, inter, hidden)` and
  `down_proj_bias` `(E, hidden)`: inputs first, as `x @ W` takes them;
- mlx-lm conversions (mlx-community): already split and outputs first, maybe affine-quantized;
- OpenAI's released checkpoints: MXFP4, `gate_up_proj_blocks` `(E, 2 * inter, hidden / 32, 16)`
  (two 4-bit e2m1 values a byte, the low nibble first) and `gate_up_proj_scales`
  `(E, 2 * inter, hidden / 32)` (a power of two per 32 values, biased by 127), outputs first;
  `down_proj` likewise. MLX keeps them packed (its `mxfp4` quantization is this format:
  `weight` the blocks as uint32 words, `scales` as they are); torch dequantizes them here, at
  load, to the compute dtype (bf16 holds every MXFP4 value exactly), dense in memory
  (gpt-oss-20b: about 40 GB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ferrum_mac.errors import CorruptModelError
from ferrum_mac.weights.config import ModelConfig

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# e2m1: a sign bit, two exponent bits, one mantissa bit
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


@dataclass(frozen=True)
class GptOssMoe:
    num_experts: int
    top_k: int
    intermediate_size: int
    swiglu_alpha: float  # the sigmoid's gain in gate * sigmoid(alpha * gate)
    swiglu_limit: float  # gate clamped to <= limit, up to [-limit, limit]


def gpt_oss_moe(config: ModelConfig) -> GptOssMoe:
    raw = config.extra
    for key in ("num_local_experts", "num_experts_per_tok"):
        if raw.get(key) is None:
            raise CorruptModelError(f"the gpt_oss config lacks {key!r}; re-download the model or fix its config.json")
    moe = GptOssMoe(
        num_experts=int(raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=config.intermediate_size,
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )
    impossible = {
        "num_local_experts": moe.num_experts < 1,
        "num_experts_per_tok": not 1 <= moe.top_k <= moe.num_experts,
        "intermediate_size": moe.intermediate_size < 1,
        "swiglu_limit": not moe.swiglu_limit > 0,
    }
    for key, wrong in impossible.items():
        if wrong:
            raise CorruptModelError(
                f"the gpt_oss config gives {key} = {raw.get(key)}, which no model has "
                f"({moe.num_experts} experts, top {moe.top_k}); re-download the model or fix its config.json"
            )
    return moe


@dataclass(frozen=True)
class ArrayOps:
    """The few array ops loading needs, in a backend's own arrays."""

    swapped: Callable  # the last two dims swapped
    copied: Callable  # a strided view made contiguous
    to_numpy: Callable
    from_numpy: Callable
    # MXFP4 blocks `(E, out, G, 16)` and scales -> the backend's packed weight and scales; None: dequantize
    packed_mxfp4: Callable | None = None


def split_experts(tensors: dict, layers: int, ops: ArrayOps) -> None:
    """transformers' fused, interleaved, inputs-first experts, or OpenAI's MXFP4 ones (fused,
    interleaved, outputs first) -> mlx-lm's names, in place."""
    for layer in range(layers):
        p = f"layers.{layer}.mlp.experts"
        if f"{p}.gate_up_proj_blocks" in tensors and ops.packed_mxfp4 is not None:
            split_packed_mxfp4(tensors, p, ops)
        elif f"{p}.gate_up_proj_blocks" in tensors:
            gate_up = ops.from_numpy(mxfp4_stack(tensors, f"{p}.gate_up_proj", ops))
            down = ops.from_numpy(mxfp4_stack(tensors, f"{p}.down_proj", ops))
            tensors[f"{p}.gate_proj.weight"], tensors[f"{p}.up_proj.weight"] = deinterleaved(gate_up, ops)
            tensors[f"{p}.down_proj.weight"] = ops.copied(down)
        elif f"{p}.gate_up_proj" in tensors:
            gate_up, down = ops.swapped(tensors.pop(f"{p}.gate_up_proj")), ops.swapped(tensors.pop(f"{p}.down_proj"))
            tensors[f"{p}.gate_proj.weight"], tensors[f"{p}.up_proj.weight"] = deinterleaved(gate_up, ops)
            tensors[f"{p}.down_proj.weight"] = ops.copied(down)
        else:
            continue
        bias = tensors.pop(f"{p}.gate_up_proj_bias")
        tensors[f"{p}.gate_proj.bias"] = ops.copied(bias[:, 0::2])
        tensors[f"{p}.up_proj.bias"] = ops.copied(bias[:, 1::2])
        tensors[f"{p}.down_proj.bias"] = tensors.pop(f"{p}.down_proj_bias")


def deinterleaved(gate_up, ops: ArrayOps) -> tuple:
    """A fused `(E, 2 * inter, ...)` stack's gate rows (even) and up rows (odd)."""
    return ops.copied(gate_up[:, 0::2]), ops.copied(gate_up[:, 1::2])


def split_packed_mxfp4(tensors: dict, p: str, ops: ArrayOps) -> None:
    """OpenAI's MXFP4 experts kept packed: each stack's rows are whole blocks, so gate and up
    split along them as the dense rows do."""
    parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    for fused, names in parts.items():
        blocks, scales = tensors.pop(f"{p}.{fused}_blocks"), tensors.pop(f"{p}.{fused}_scales")
        for i, name in enumerate(names):
            rows = slice(i, None, len(names))
            weight, packed_scales = ops.packed_mxfp4(blocks[:, rows], scales[:, rows])
            tensors[f"{p}.{name}.weight"], tensors[f"{p}.{name}.scales"] = weight, packed_scales


def mxfp4_stack(tensors: dict, name: str, ops: ArrayOps) -> np.ndarray:
    """The MXFP4 stack `name` (its `_blocks` and `_scales`, popped) as float32 `(E, out, in)`."""
    blocks, scales = tensors.pop(f"{name}_blocks"), tensors.pop(f"{name}_scales")
    blocks, scales = ops.to_numpy(blocks), ops.to_numpy(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise CorruptModelError(
            f"{name}_blocks {blocks.shape} and _scales {scales.shape} are not MXFP4 blocks and their scales; "
            "re-download the model"
        )
    return mxfp4_dense(blocks, scales)


def mxfp4_dense(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks `(..., G, 16)` (two e2m1 values a byte, the low nibble first) and scales `(..., G)`
    (2^(s - 127) each) -> `(..., G * 32)` float32."""
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
    values = np.ldexp(values, scales.astype(np.int32)[..., None, None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)
