"""Random weights of real model shapes, built once and shared by ferrum and mlx-lm.

mlx-lm's own model classes initialise the weights (so both sides read the very same
arrays) and its quantizer makes the 4-bit variant with the per-layer choices an
mlx-community conversion would make.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

_QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
}

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {
        **_QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "llama3-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen3-30b-a3b": {
        **_QWEN3,
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    # Small shapes for a CPU: a Qwen3 of ~40M parameters and a small Qwen3-MoE.
    "qwen3-tiny": {
        **_QWEN3,
        "vocab_size": 32768,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "qwen3-moe-tiny": {
        **_QWEN3,
        "model_type": "qwen3_moe",
        "vocab_size": 32768,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
}
QUANTS = ("bf16", "4bit")


@dataclass
class RandomModel:
    config: dict  # config.json as a conversion would write it (with `quantization` for 4-bit)
    weights: dict  # mlx-lm parameter names -> arrays
    peer: object  # the mlx-lm model holding the same arrays


def build_random(shape: str, quant: str) -> RandomModel:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model

    from ferrum_mac.errors import FerrumError

    if shape not in SHAPES:
        raise FerrumError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise FerrumError(f"unknown --quant {quant!r}; choose one of: {', '.join(QUANTS)}")
    config = {**SHAPES[shape], "dtype": "bfloat16"}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)
    if quant == "4bit":
        with contextlib.redirect_stdout(sys.stderr):  # it prints a summary line
            model, config = quantize_model(model, config, group_size=64, bits=4)
    model.eval()
    weights = dict(tree_flatten(model.parameters()))
    for array in weights.values():
        mx.eval(array)  # one at a time, so the float32 initialisers never coexist
    return RandomModel(config, weights, model)
