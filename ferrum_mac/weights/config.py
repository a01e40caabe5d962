"""`ModelConfig`: a model's architecture, read from config.json or GGUF metadata."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferrum_mac.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("qwen3_moe", "gpt_oss")
GEMMA3_TYPES = ("gemma3_text", "gemma3")  # gemma3: the text model inside the multimodal checkpoint
# Phi-4 / Phi-4-mini (fused qkv and gate-up, partial RoPE, LongRoPE) and SmolLM3 (NoPE layers)
ROPE_VARIANT_TYPES = ("phi3", "smollm3")
# Qwen3-Next and Qwen3.5/3.6 (dense and MoE, text): Gated DeltaNet linear-attention layers
# between gated full-attention ones; qwen3_5 and qwen3_5_moe: the text model of the multimodal checkpoint
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
SUPPORTED_TYPES = DENSE_TYPES + MOE_TYPES + GEMMA3_TYPES + ROPE_VARIANT_TYPES + HYBRID_TYPES
ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_traditional: bool = False  # GGUF llama weights are permuted for interleaved rope
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rotary_dims: int = 0  # the leading dims of each head RoPE turns (partial_rotary_factor); 0: all
    nope_layers: frozenset[int] = frozenset()  # layers that attend without RoPE (SmolLM3)
    dtype: str = "float16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: dict | None = None  # {"group_size", "bits", per-module overrides}
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window in tokens, 0 for full attention
    attention_sinks: bool = False  # a learned logit per head joins each softmax's denominator (gpt-oss)
    recurrent_layers: frozenset[int] = frozenset()  # layers of linear attention (a recurrent state, no KV)
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific keys (MoE)

    @property
    def rope_dims(self) -> int:
        return self.rotary_dims or self.head_dim

    def quant_for(self, module: str) -> dict | None:
        """Quantization of one module (canonical name without `.weight`), or None if dense."""
        q = self.quantization
        if not q:
            return None
        override = q.get(module, q.get(f"model.{module}"))
        if override is False:
            return None
        if isinstance(override, dict):
            return {"group_size": override.get("group_size", q["group_size"]), "bits": override.get("bits", q["bits"])}
        return {"group_size": q["group_size"], "bits": q["bits"]}


def read_json_object(path: Path) -> dict:
    """A model's JSON file (config.json and the like), which must hold an object; otherwise a
    one-line CorruptModelError that says what is wrong with it."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise CorruptModelError(f"{path} is not UTF-8 text; re-download the model") from None
    except json.JSONDecodeError as e:
        raise CorruptModelError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}); re-download the model"
        ) from None
    except RecursionError:
        raise CorruptModelError(f"{path} is nested too deeply to be a model's JSON; re-download the model") from None
    except OSError as e:  # a dangling or looping symlink, no permission
        raise CorruptModelError(f"{path} cannot be read ({e.strerror or e}); re-download the model") from None
    if not isinstance(value, dict):
        raise CorruptModelError(
            f"{path} holds a JSON {type(value).__name__}, not an object; re-download the model or fix the file"
        )
    return value


def _rope_settings(raw: dict) -> tuple[float, dict | None]:
    """rope theta and scaling from `rope_theta`/`rope_scaling` or transformers 5's `rope_parameters`."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        kind = {"su": "longrope"}.get(kind, kind)  # Phi-3's first name for LongRoPE
        if raw.get("model_type") == "phi3" and kind == "yarn":  # (transformers reads Phi-3's "yarn" as LongRoPE)
            kind = "longrope"
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    if scaling is not None and scaling["rope_type"] in ("longrope", "yarn"):
        scaling = _pretraining_length(raw, scaling)
    return float(theta), scaling


def _pretraining_length(raw: dict, scaling: dict) -> dict:
    """LongRoPE and YaRN scale from the context the model was pretrained for: Phi-3 keeps it
    beside `max_position_embeddings` (and it wins, as in transformers), others in the scaling
    block; neither: the model's own length. The scaling `factor`, when not given, is the ratio."""
    original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    longest = raw.get("max_position_embeddings", 4096)
    original = int(original or longest)
    factor = scaling.get("factor") or longest / original
    return {**scaling, "original_max_position_embeddings": original, "factor": float(factor)}


def _rotary_dims(raw: dict, head_dim: int) -> int:
    """How many leading dims of each head RoPE turns (Phi-4-mini: 0.75 of them); 0: all."""
    params = raw.get("rope_parameters") or {}
    factor = raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    dims = int(head_dim * float(factor))
    if dims <= 0 or dims > head_dim or dims % 2:
        raise CorruptModelError(f"partial_rotary_factor {factor} leaves {dims} of {head_dim} dims to rotate")
    return 0 if dims == head_dim else dims


def _nope_layers(raw: dict, layers: int) -> frozenset[int]:
    """SmolLM3's layers without RoPE: `no_rope_layers` flags each layer (1: RoPE, 0: none), else
    every `no_rope_layer_interval`-th layer goes without (transformers' default, 4)."""
    if raw.get("model_type") != "smollm3":
        return frozenset()
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval") or 4)
        return frozenset(i for i in range(layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) < layers:
        raise CorruptModelError(f"no_rope_layers must flag each of the {layers} layers (1: RoPE, 0: none)")
    return frozenset(i for i in range(layers) if not flags[i])


def _eos_ids(raw: dict, generation: dict) -> tuple[int, ...]:
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _mlx_quantization(raw: dict, where: str) -> dict | None:
    """MLX's `quantization` block; other quantizers (GPTQ, AWQ, fp8) are refused by name."""
    q = raw.get("quantization") or raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method is not None or q.get("mode", "affine") != "affine":
        kind = method or q.get("mode")
        raise UnsupportedModelError(
            f"{where}: {kind} quantization is not supported; use an MLX affine-quantized (mlx-community) or bf16 checkpoint"
        )
    return q


def _mxfp4_experts(raw: dict) -> bool:
    """OpenAI's gpt-oss checkpoints: MXFP4 experts, which the family reads (`weights.gpt_oss`),
    and every other weight dense."""
    q = raw.get("quantization_config") or {}
    return raw.get("model_type") == "gpt_oss" and q.get("quant_method") == "mxfp4"


def check_model_type(model_type: str, where: str) -> None:
    if model_type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
        )


def _layer_windows(raw: dict) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), or () when no layer slides: transformers
    5's `layer_types`; Qwen2/3's `use_sliding_window` (layers from `max_window_layers` on);
    Mistral's `sliding_window`, which applies to every layer."""
    window, layers = raw.get("sliding_window"), raw.get("num_hidden_layers", 0)
    if not window or raw.get("use_sliding_window") is False:
        return ()
    if raw.get("layer_types"):
        kinds = raw["layer_types"]
        unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedModelError(f"layer_types holds {unknown[0]!r}, which ferrum does not run")
    elif raw.get("use_sliding_window") is not None:
        first = raw.get("max_window_layers", 0)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif raw.get("model_type") in ("mistral", "phi3"):  # a set window applies to every layer
        kinds = ["sliding_attention"] * layers
    else:
        return ()
    if len(kinds) != layers:
        raise CorruptModelError(f"layer_types names {len(kinds)} layers of {layers}; re-download the model")
    windows = tuple(int(window) if kind == "sliding_attention" else 0 for kind in kinds)
    return windows if any(windows) else ()


def config_from_hf(folder: Path) -> ModelConfig:
    """Read config.json (and generation_config.json when present) from a model folder."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json; point at a model folder or a .gguf file")
    generation_path = folder / "generation_config.json"
    generation = read_json_object(generation_path) if generation_path.is_file() else {}
    return config_from_dict(read_json_object(path), generation, str(path))


def config_from_dict(raw: dict, generation: dict | None = None, where: str = "config.json") -> ModelConfig:
    """A `ModelConfig` from a Hugging Face config dict (and its generation config)."""
    with wrong_types_are_corrupt(where):
        return check_sizes(_config_from_dict(raw, generation or {}, where), where)


@contextmanager
def wrong_types_are_corrupt(where: str):
    """A config value of the wrong type (a list where a number belongs, an object where a list
    does) fails wherever it is first used; say which file is at fault, in one line."""
    try:
        yield
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:
        raise CorruptModelError(
            f"{where} has a value of the wrong type ({e}); re-download the model or fix it"
        ) from None


def check_sizes(config: ModelConfig, where: str) -> ModelConfig:
    """Refuse sizes no model has (missing, zero, negative, not integers) before a backend builds from them."""
    sizes = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
    }
    for name, value in sizes.items():
        if type(value) is not int or value <= 0:
            raise _impossible(where, name, value)
    if type(config.intermediate_size) is not int or config.intermediate_size < 0:  # 0: none given (MoE)
        raise _impossible(where, "intermediate_size", config.intermediate_size)
    if config.num_heads % config.num_kv_heads:
        raise CorruptModelError(
            f"{where}: {config.num_heads} attention heads cannot share {config.num_kv_heads} kv heads"
        )
    for name in ("rope_theta", "rms_norm_eps"):
        if not math.isfinite(getattr(config, name)) or getattr(config, name) < 0:
            raise _impossible(where, name, getattr(config, name))
    _check_longrope_factors(config, where)
    return config


def _check_longrope_factors(config: ModelConfig, where: str) -> None:
    """LongRoPE rescales each pair of rotated dims: one number per pair in each list."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return
    pairs = config.rope_dims // 2
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != pairs or not all(_is_number(f) for f in factors):
            raise CorruptModelError(
                f"{where}: rope scaling {key} must list {pairs} numbers (one per pair of rotated dims); "
                "re-download the model or fix its config"
            )


def _is_number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0


def _impossible(where: str, name: str, value) -> CorruptModelError:
    return CorruptModelError(f"{where} gives {name} = {str(value)[:40]}, which no model has; re-download the model")


def _config_from_dict(raw: dict, generation: dict, where: str) -> ModelConfig:
    model_type = raw.get("model_type", "")
    check_model_type(model_type, where)
    if model_type in GEMMA3_TYPES:
        return gemma3_config(raw, generation, where)
    if model_type in HYBRID_TYPES:
        return qwen3_5_config(raw, generation, where)
    theta, scaling = _rope_settings(raw)
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float16"
    try:
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        return ModelConfig(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw.get("intermediate_size", 0),
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or raw.get("attention_bias", False),
            o_bias=model_type != "qwen2" and raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rotary_dims=_rotary_dims(raw, head_dim),
            nope_layers=_nope_layers(raw, raw["num_hidden_layers"]),
            dtype=str(dtype).replace("torch.", ""),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=_eos_ids(raw, generation),
            quantization=None if _mxfp4_experts(raw) else _mlx_quantization(raw, where),
            layer_windows=_layer_windows(raw),
            attention_sinks=model_type == "gpt_oss",
            extra=raw,
        )
    except KeyError as e:
        raise CorruptModelError(f"{where} lacks {e.args[0]!r}; re-download the model or fix its config.json") from None


# -- Gemma 3 -------------------------------------------------------------------------------

GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh",)


def gemma3_config(raw: dict, generation: dict, where: str) -> ModelConfig:
    """Gemma 3's text model: local (sliding-window) and global layers, each with its RoPE base;
    a multimodal checkpoint's (`gemma3`) is its `text_config`. The family's own settings go in
    `extra` under `gemma3_*` keys (read by the model files)."""
    text = {**raw.get("text_config", raw), "model_type": "gemma3_text"} if raw["model_type"] == "gemma3" else raw
    refuse_gemma3_variants(text, where)
    kinds = gemma3_layer_types(text)
    window = int(text.get("sliding_window") or 4096)
    params = text.get("rope_parameters") or {}
    global_rope = {"rope_theta": text.get("rope_theta", 1_000_000.0), **(params.get("full_attention") or {})}
    if text.get("rope_scaling"):
        global_rope.update(text["rope_scaling"])
    local_rope = params.get("sliding_attention") or {}
    local_theta = float(local_rope.get("rope_theta", text.get("rope_local_base_freq", 10_000.0)))
    theta, scaling = _rope_settings({"rope_parameters": global_rope})
    defaults = {"vocab_size": 262_208, "hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4}
    text = {**defaults, **text, "num_hidden_layers": len(kinds), "head_dim": text.get("head_dim", 256)}
    text["query_pre_attn_scalar"] = text.get("query_pre_attn_scalar", 256)
    windowless = {k: v for k, v in text.items() if k not in ("layer_types", "sliding_window", "rope_parameters")}
    config = _config_from_dict(
        {**windowless, "model_type": "llama", "rope_theta": theta, "rope_scaling": None}, generation, where
    )
    config.model_type, config.rope_scaling, config.qk_norm = "gemma3_text", scaling, True
    config.tie_word_embeddings = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    config.max_position_embeddings = text.get("max_position_embeddings", 131_072)
    config.layer_windows = tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
    config.extra = {
        **text,
        "gemma3_local_rope_theta": local_theta,
        "gemma3_attn_softcap": text.get("attn_logit_softcapping"),
        "gemma3_final_softcap": text.get("final_logit_softcapping"),
    }
    return config


def gemma3_layer_types(text: dict) -> list[str]:
    """`layer_types`, or the older `sliding_window_pattern` (every Nth layer global)."""
    if text.get("layer_types"):
        kinds = list(text["layer_types"])
        unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedModelError(f"layer_types holds {unknown[0]!r}, which ferrum does not run")
        return kinds
    pattern = int(text.get("sliding_window_pattern", 6))
    layers = int(text.get("num_hidden_layers", 26))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def refuse_gemma3_variants(text: dict, where: str) -> None:
    """A Gemma 3 variant ferrum does not compute is refused by the field that makes it one."""
    if text.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{where}: use_bidirectional_attention is set; ferrum runs causal Gemma 3 only")
    activation = text.get("hidden_activation") or text.get("hidden_act") or GEMMA3_ACTIVATIONS[0]
    if activation not in GEMMA3_ACTIVATIONS:
        raise UnsupportedModelError(f"{where}: hidden_activation {activation!r} is not Gemma 3's gelu_pytorch_tanh")


# -- Qwen3.5 / 3.6 (hybrid linear attention) -----------------------------------------------

LINEAR_DEFAULTS = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}


def qwen3_5_config(raw: dict, generation: dict, where: str) -> ModelConfig:
    """Qwen3.5's and Qwen3-Next's text model: Gated DeltaNet layers (`linear_attention`) and
    gated full attention with partial RoPE; a multimodal checkpoint's (`qwen3_5`,
    `qwen3_5_moe`) is its `text_config`. The linear layers' sizes go in `extra` under their
    config names (`LINEAR_DEFAULTS`), as do the MoE's (`weights.moe`)."""
    family = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(raw["model_type"], raw["model_type"])
    text = raw.get("text_config", raw) if raw["model_type"] in ("qwen3_5", "qwen3_5_moe") else raw
    layers = int(text.get("num_hidden_layers", 32))
    kinds = text.get("layer_types") or [
        "full_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(layers)
    ]
    unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if unknown or len(kinds) != layers:
        raise CorruptModelError(f"{where}: layer_types {str(unknown or kinds)[:60]} does not fit {layers} layers")
    params = {"partial_rotary_factor": 0.25, **(text.get("rope_parameters") or {})}
    if text.get("partial_rotary_factor"):
        params["partial_rotary_factor"] = text["partial_rotary_factor"]
    base = {k: v for k, v in text.items() if k not in ("layer_types", "rope_parameters", "sliding_window")}
    config = _config_from_dict(
        {**base, "model_type": "llama", "rope_parameters": params, "head_dim": text.get("head_dim", 256)},
        generation,
        where,
    )
    config.model_type, config.qk_norm = family, True
    config.tie_word_embeddings = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    config.recurrent_layers = frozenset(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    config.extra = {**LINEAR_DEFAULTS, **text}
    if family == "qwen3_5_moe_text":  # its router always renormalises its top k
        config.extra["norm_topk_prob"] = True
    return config
