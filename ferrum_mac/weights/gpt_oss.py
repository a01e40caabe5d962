"""gpt-oss's experts: their config keys and every checkpoint layout, read the same way by every backend.

Layouts of a layer's experts, all brought to mlx-lm's names (`mlp.experts.{gate,up,down}_proj`
`.weight` `(E, out, in)` and `.bias` `(E, out)`, which MLX conversions already use):

- transformers' `save_pretrained`: `mlp.experts.gate_up_proj` `(E, hidden, 2 * inter)` with
  gate and up interleaved along the last dim (gate at even columns), its bias
  `gate_up_proj_bias` `(E, 2 * inter)` likewise; `down_proj` `(E, inter, hidden)` and
  `down_proj_bias` `(E, hidden)`: inputs first, as `x @ W` takes them;
- mlx-lm conversions (mlx-community): already split and outputs first, maybe affine-quantized.

The released checkpoints store the experts as MXFP4 blocks and scales
(`gate_up_proj_blocks`, `gate_up_proj_scales`): not read yet, refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrum_mac.errors import CorruptModelError, UnsupportedModelError
from ferrum_mac.weights.config import ModelConfig

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


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
    return GptOssMoe(
        num_experts=int(raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=config.intermediate_size,
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )


def split_experts(tensors: dict, layers: int, transpose, contiguous=lambda a: a) -> None:
    """transformers' fused, interleaved, inputs-first experts -> mlx-lm's names, in place.
    `transpose(a)` swaps a stack's last two dims (each backend's own op); `contiguous` copies
    a strided view where the backend needs it."""
    for layer in range(layers):
        p = f"layers.{layer}.mlp.experts"
        if f"{p}.gate_up_proj_blocks" in tensors:
            raise UnsupportedModelError(
                "this gpt-oss checkpoint stores its experts as MXFP4 blocks, which ferrum does not read yet; "
                "use a bf16 or an MLX affine-quantized conversion"
            )
        if f"{p}.gate_up_proj" not in tensors:
            continue
        gate_up, bias = transpose(tensors.pop(f"{p}.gate_up_proj")), tensors.pop(f"{p}.gate_up_proj_bias")
        tensors[f"{p}.gate_proj.weight"] = contiguous(gate_up[:, 0::2])
        tensors[f"{p}.up_proj.weight"] = contiguous(gate_up[:, 1::2])
        tensors[f"{p}.gate_proj.bias"] = contiguous(bias[:, 0::2])
        tensors[f"{p}.up_proj.bias"] = contiguous(bias[:, 1::2])
        tensors[f"{p}.down_proj.weight"] = contiguous(transpose(tensors.pop(f"{p}.down_proj")))
        tensors[f"{p}.down_proj.bias"] = tensors.pop(f"{p}.down_proj_bias")
