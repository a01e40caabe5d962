"""Fused projections in a checkpoint (Phi-3's `qkv_proj`, `gate_up_proj`) split into separate ones.

Every family loads q/k/v and gate/up separately (and fuses them again as its device likes).
Rows are the output dim, so dense weights, MLX-quantized ones (packed words, scales
and biases) and GGUF's all split by slicing rows: no copy, no dequantizing."""

from __future__ import annotations

from ferrum_mac.errors import CorruptModelError
from ferrum_mac.weights.config import ModelConfig

SUFFIXES = ("weight", "scales", "biases", "bias")


def split_rows(tensors: dict, config: ModelConfig, fused: str, parts: dict[str, int]) -> None:
    """Replace module `fused`'s tensors by one module per entry of `parts` (name -> rows, in
    order), in place; its quantization entry, if any, goes to each part."""
    total = sum(parts.values())
    for suffix in SUFFIXES:
        name = f"{fused}.{suffix}"
        if name not in tensors:
            continue
        tensor = tensors.pop(name)
        if tensor.shape[0] != total:
            raise CorruptModelError(
                f"tensor {name!r} has {tensor.shape[0]} rows, expected {total} ({' + '.join(map(str, parts.values()))})"
            )
        start = 0
        for part, rows in parts.items():
            tensors[f"{part}.{suffix}"] = tensor[start : start + rows]
            start += rows
    q = config.quantization
    if q:
        for key in (fused, f"model.{fused}"):
            if key in q:
                q.update({part: q[key] for part in parts})


def rename_module(tensors: dict, config: ModelConfig, old: str, new: str) -> None:
    """Module `old`'s tensors (and quantization entry) under the name `new`, in place."""
    for suffix in SUFFIXES:
        if f"{old}.{suffix}" in tensors:
            tensors[f"{new}.{suffix}"] = tensors.pop(f"{old}.{suffix}")
    if config.quantization and old in config.quantization:
        config.quantization[new] = config.quantization.pop(old)


def split_phi3(tensors: dict, config: ModelConfig) -> None:
    """Every layer's `self_attn.qkv_proj` (q rows, then k, then v) and `mlp.gate_up_proj`
    (gate rows, then up) as the separate projections, in place. Checkpoints that store them
    separately already pass through."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for layer in range(c.num_layers):
        attn, mlp = f"layers.{layer}.self_attn", f"layers.{layer}.mlp"
        if f"{mlp}.up_proj.weight" in tensors and f"{mlp}.gate_proj.weight" not in tensors:
            rename_module(tensors, c, f"{mlp}.up_proj", f"{mlp}.gate_up_proj")  # GGUF: llama.cpp calls it ffn_up
        split_rows(
            tensors,
            c,
            f"{attn}.qkv_proj",
            {f"{attn}.q_proj": q_rows, f"{attn}.k_proj": kv_rows, f"{attn}.v_proj": kv_rows},
        )
        split_rows(
            tensors,
            c,
            f"{mlp}.gate_up_proj",
            {f"{mlp}.gate_proj": c.intermediate_size, f"{mlp}.up_proj": c.intermediate_size},
        )
