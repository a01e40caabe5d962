"""GGUF checkpoints: the config from the header (`gguf_header`), the tensors on first use: every
type `ggml_blocks` decodes, read with numpy (`gguf_tensors`, shards too), or through `mx.load`
where it reads them all (Q4_0, Q4_1 and Q8_0 as MLX affine-quantized tensors of group size 32,
F16/F32 dense). Names are mapped to the canonical (Hugging Face, without the `model.` prefix)
names the backends use."""

from __future__ import annotations

import math
import re
import struct
from collections.abc import MutableMapping
from pathlib import Path

from ferrum_mac.errors import CorruptModelError, UnsupportedModelError
from ferrum_mac.weights import ggml_blocks, gguf_tensors
from ferrum_mac.weights.config import ModelConfig, check_model_type, check_sizes, wrong_types_are_corrupt
from ferrum_mac.weights.gguf_header import GgufInfo

# ggml type -> (bits, group size) of its MLX affine layout, or the dtype it is dense in
SUPPORTED_GGML = ggml_blocks.LAYOUTS
MLX_LOADS = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")  # the types `mx.load` reads itself
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q/k/v (its fused gate/up is `ffn_up`: `fused.split_phi3`)
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)$")
# Block names an architecture uses otherwise, by llama.cpp's architecture name.
_ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {}


def canonical_module(gguf_module: str, arch: str = "") -> str | None:
    if gguf_module in _TOP_NAMES:
        return _TOP_NAMES[gguf_module]
    m = _BLOCK.match(gguf_module)
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    if m and m.group(2) in names:
        return f"layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def architecture(info: GgufInfo) -> str:
    """llama.cpp's architecture name in the header (`general.architecture`)."""
    return str(_scalar(info.metadata, "general.architecture", ""))


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if hasattr(value, "item"):
        value = value.item()
    return value


def config_from_gguf(path: Path, meta: dict, quantization: dict, has_output: bool, token_count: int = 0) -> ModelConfig:
    with wrong_types_are_corrupt(str(path)):
        config = _config_from_gguf(path, meta, quantization, has_output, token_count)
        if config.model_type == "gemma3_text":
            gemma3_from_gguf(config)
        return check_sizes(config, str(path))


def _config_from_gguf(path: Path, meta: dict, quantization: dict, has_output: bool, token_count: int) -> ModelConfig:
    arch_name = _scalar(meta, "general.architecture", "")
    model_type = ARCHITECTURES.get(arch_name, arch_name)
    check_model_type(model_type, str(path))
    a = arch_name
    heads = _scalar(meta, f"{a}.attention.head_count")
    hidden = _scalar(meta, f"{a}.embedding_length")
    vocab = _scalar(meta, f"{a}.vocab_size") or token_count or len(meta.get("tokenizer.ggml.tokens", []))
    eos = _scalar(meta, "tokenizer.ggml.eos_token_id")
    extra = {k.split(".", 1)[1]: _scalar(meta, k) for k in meta if k.startswith(f"{a}.") and "." in k}
    head_dim = _scalar(meta, f"{a}.attention.key_length") or hidden // heads
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_scalar(meta, f"{a}.feed_forward_length", 0),
        num_layers=_scalar(meta, f"{a}.block_count"),
        num_heads=heads,
        num_kv_heads=_scalar(meta, f"{a}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(_scalar(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_scalar(meta, f"{a}.rope.freq_base", 10000.0)),
        # llama.cpp permutes llama q/k rows so its interleaved rope applies; use the same.
        rope_traditional=arch_name in ("llama", "smollm3"),
        rotary_dims=_rotary_dims(meta, a, head_dim),
        nope_layers=_nope_layers(arch_name, _scalar(meta, f"{a}.block_count")),
        max_position_embeddings=_scalar(meta, f"{a}.context_length", 4096),
        tie_word_embeddings=not has_output,
        qkv_bias=arch_name == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        dtype="float16",
        bos_token_id=_scalar(meta, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        quantization=quantization or None,
        extra=extra,
    )


# -- Phi-3's partial and LongRoPE, SmolLM3's NoPE layers ------------------------------------


def _rotary_dims(meta: dict, arch: str, head_dim: int) -> int:
    """`rope.dimension_count` where it turns fewer dims than a head has (Phi-4-mini); 0: all."""
    dims = _scalar(meta, f"{arch}.rope.dimension_count") or head_dim
    return 0 if dims == head_dim else dims


def _nope_layers(arch: str, layers: int) -> frozenset[int]:
    """SmolLM3's layers without RoPE: GGUF has no key for them; llama.cpp takes every fourth."""
    return frozenset(i for i in range(layers) if (i + 1) % 4 == 0) if arch == "smollm3" else frozenset()


def _longrope(shards: gguf_tensors.Shards, config: ModelConfig) -> dict:
    """Phi-3's LongRoPE from its `rope_factors_long`/`_short` tensors and rope scaling keys."""
    meta = shards[0][1].metadata
    a = _scalar(meta, "general.architecture")
    original = _scalar(meta, f"{a}.rope.scaling.original_context_length") or config.max_position_embeddings
    scaling = {
        "rope_type": "longrope",
        "long_factor": _f32_tensor(shards, "rope_factors_long.weight").tolist(),
        "short_factor": _f32_tensor(shards, "rope_factors_short.weight").tolist(),
        "original_max_position_embeddings": int(original),
        "factor": config.max_position_embeddings / original,
    }
    attention = _scalar(meta, f"{a}.rope.scaling.attn_factor")
    return scaling if attention is None else {**scaling, "attention_factor": float(attention)}


def _quantization_by_module(tensors: list, arch: str) -> dict:
    """Per-module quantization from the tensor table (`gguf_tensors.check_tensors` vetted it)."""
    per_module: dict = {}
    for name, _, type_name in tensors:
        layout = SUPPORTED_GGML[type_name]
        module = canonical_module(name.rsplit(".", 1)[0], arch)
        if isinstance(layout, tuple) and module:
            per_module[module] = {"group_size": layout[1], "bits": layout[0]}
    if not per_module:
        return {}
    first = next(iter(per_module.values()))
    return {"group_size": first["group_size"], "bits": first["bits"], **per_module}


def load_gguf(path: Path, read=None) -> tuple[ModelConfig, "LazyTensors", int]:
    """The config (from the header alone), the canonical tensors (read on first use) and how
    many weights the file stores quantized. `path`: a file, or any shard of a set.
    `read(shards)`: another reader of the canonical tensors (in MLX's layout) than MLX's."""
    if read is None:
        try:
            import mlx.core  # noqa: F401
        except ImportError:
            raise UnsupportedModelError(
                f"{path}: reading GGUF files needs MLX (pip install mlx); use a safetensors checkpoint"
            ) from None

    shards = gguf_tensors.read_shards(path)  # (the tokenizer reads the same first header)
    gguf_tensors.check_tensors(shards)
    path, info = shards[0]
    arch = architecture(info)
    table = [tensor for _, shard in shards for tensor in shard.tensors]
    quantization = _quantization_by_module(table, arch)
    names = {}  # canonical name -> GGUF name, for the tensors the reader will return
    for name, _, _ in table:
        canonical = canonical_name(name, arch)
        if canonical is not None:
            names[canonical] = name
    config = config_from_gguf(
        path,
        info.metadata,
        quantization,
        has_output="lm_head.weight" in names,
        token_count=info.array_lengths.get("tokenizer.ggml.tokens", 0),
    )
    tensors = LazyTensors(lambda: _read_tensors(shards, arch) if read is None else read(shards))
    stored = {name for name, _, _ in table}
    if "rope_freqs.weight" in stored:  # Llama 3.1+: the llama3 rope schedule as per-frequency divisors
        config.rope_scaling = {"rope_type": "freq_factors", "factors": _f32_tensor(shards, "rope_freqs.weight")}
    if "rope_factors_long.weight" in stored:  # Phi-3/Phi-4-mini 128k
        config.rope_scaling = _longrope(shards, config)
        check_sizes(config, str(path))  # (its factor lists against the rotated dims)
    # Only modules GGUF stored quantized are quantized; mark the rest dense.
    if config.quantization:
        for name in names:
            module = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and module not in config.quantization:
                config.quantization[module] = False
    quantized = sum(math.prod(shape) for _, shape, kind in table if gguf_tensors.stored_quantized(kind))
    return config, tensors, quantized


def canonical_name(gguf_name: str, arch: str = "") -> str | None:
    module, _, suffix = gguf_name.rpartition(".")
    canonical = canonical_module(module, arch)
    return None if canonical is None else f"{canonical}.{suffix}"


class LazyTensors(MutableMapping):
    """A checkpoint's canonical tensors, read from the file on first use: a backend that finds
    them elsewhere (MLX's dense copy on the CPU) never pays for reading them."""

    def __init__(self, read):
        self._read, self._tensors = read, None

    @property
    def loaded(self) -> dict:
        if self._tensors is None:
            self._tensors = self._read()
        return self._tensors

    def __getitem__(self, name):
        return self.loaded[name]

    def __setitem__(self, name, value):
        self.loaded[name] = value

    def __delitem__(self, name):
        del self.loaded[name]

    def __iter__(self):
        return iter(self.loaded)

    def __len__(self):
        return len(self.loaded)

    def clear(self):
        self._tensors = {}  # nothing left to read


def _read_raw(path: Path) -> dict:
    import mlx.core as mx

    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise CorruptModelError(f"{path} cannot be read ({str(e).splitlines()[0]}); download it again") from None


def _read_tensors(shards: gguf_tensors.Shards, arch: str) -> dict:
    (path, info), *others = shards
    if others or any(kind not in MLX_LOADS for _, _, kind in info.tensors):
        return gguf_tensors.read_tensors(shards, lambda name: canonical_name(name, arch), _mlx_array)
    tensors = {}
    for name, array in _read_raw(path).items():
        canonical = canonical_name(name, arch)
        if canonical is not None:
            tensors[canonical] = array
    return tensors


def _mlx_array(array, dtype: str):
    import mlx.core as mx

    return mx.array(array).view(mx.bfloat16) if dtype == "bfloat16" else mx.array(array)


def _f32_tensor(shards: gguf_tensors.Shards, tensor: str):
    """A small tensor outside the canonical ones (rope factors), read on its own when it is F32
    (as converters write them)."""
    import mlx.core as mx

    found = [(path, info) for path, info in shards if tensor in info.offsets]
    if not found:
        raise CorruptModelError(f"{shards[0][0]} lacks tensor {tensor!r}; download it again")
    path, info = found[0]
    shape, kind = next((shape, kind) for name, shape, kind in info.tensors if name == tensor)
    if kind != "F32":
        only = gguf_tensors.read_tensors([(path, info)], lambda n: n if n == tensor else None, _mlx_array)
        return only[tensor]
    count = math.prod(shape)
    with open(path, "rb") as f:
        f.seek(info.offsets[tensor])
        data = f.read(4 * count)
    return mx.array(struct.unpack(f"<{count}f", data), dtype=mx.float32)


# -- Gemma 3 -------------------------------------------------------------------------------

ARCHITECTURES["gemma3"] = "gemma3_text"
_ARCH_BLOCK_NAMES["gemma3"] = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_PATTERN = 6  # llama.cpp's: every sixth layer global (the header does not say)


def gemma3_from_gguf(config: ModelConfig) -> None:
    """What llama.cpp's Gemma 3 takes from its header or fixes: a window on five layers of six,
    local layers turning at base 10000, scores scaled by 1/sqrt(head_dim) (the 27B's, 62
    layers: by 1/sqrt(hidden / heads)), and norm weights stored as (1 + w) already."""
    extra = config.extra
    window = int(extra.get("attention.sliding_window") or 0)
    pattern = int(extra.get("attention.sliding_window_pattern") or GEMMA3_PATTERN)
    if window:
        config.layer_windows = tuple(window if (i + 1) % pattern else 0 for i in range(config.num_layers))
    scaling = extra.get("rope.scaling.type")
    if scaling and scaling != "none":
        config.rope_scaling = {"rope_type": scaling, "factor": float(extra.get("rope.scaling.factor", 1.0))}
    scalar = config.hidden_size // config.num_heads if config.num_layers == 62 else config.head_dim
    config.qk_norm = True
    config.extra = {
        **extra,
        "query_pre_attn_scalar": scalar,
        "gemma3_local_rope_theta": 10_000.0,
        "gemma3_attn_softcap": extra.get("attn_logit_softcapping"),
        "gemma3_final_softcap": extra.get("final_logit_softcapping"),
        "gemma3_norm_offset": 0.0,
    }
