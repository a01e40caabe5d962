"""What a local model is, read from its files: format, quantization, architecture, size in
parameters, context length, chat template, license. Reads headers and small JSON files only."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ferrum_mac.errors import CorruptModelError
from ferrum_mac.weights.config import read_json_object
from ferrum_mac.weights.gguf_header import GgufInfo, read_gguf_info, shard_paths
from ferrum_mac.weights.safetensors import read_header

DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_LICENSE_LINE = re.compile(r"^license:\s*['\"]?([^'\"\n]+?)['\"]?\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ModelFacts:
    format: str  # "mlx" (MLX-quantized safetensors), "safetensors" or "gguf"
    quantization: str  # "4bit", "bf16", "Q4_1", ...
    architecture: str | None = None
    parameters: int | None = None
    context_length: int | None = None
    chat_template: bool = False
    license: str | None = None
    types: str | None = None  # a GGUF's tensor types and their shares of the weights


def format_and_quant(path: Path) -> tuple[str, str]:
    """The cheap part of `describe`, for listing many models."""
    if path.suffix == ".gguf":
        from ferrum_mac.store.select import gguf_quant_of

        info = read_gguf_info(path)  # also proves the header whole
        return "gguf", gguf_quant_of(path.name) or info.quantization  # the name says Q4_K_M, the tensors Q4_K
    config = read_config(path)
    return _format(config), _quantization(config)


def describe(path: Path) -> ModelFacts:
    if path.suffix == ".gguf":
        return _describe_gguf(path)
    config = read_config(path, strict=True)
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return ModelFacts(
        format=_format(config),
        quantization=_quantization(config),
        architecture=_architecture(config),
        parameters=count_parameters(path, config),
        context_length=text_config.get("max_position_embeddings"),
        chat_template=_has_chat_template(path),
        license=_license(path),
    )


def read_config(folder: Path, strict: bool = False) -> dict:
    """The folder's config.json ({} when there is none); a damaged one is {} too, or with
    `strict` a one-line CorruptModelError (`ferrum show` says what is wrong, `ferrum list` moves on)."""
    path = folder / "config.json"
    if not path.is_file():
        return {}
    try:
        return read_json_object(path)
    except CorruptModelError:
        if strict:
            raise
        return {}


def is_language_model(config: dict) -> bool:
    """True for the configs of text generators (decoder LMs), not encoders or vision models."""
    return any(
        isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
        for a in _architectures(config)
    )


def _architectures(config: dict) -> list:
    architectures = config.get("architectures")
    return architectures if isinstance(architectures, list) else []


def _format(config: dict) -> str:
    return "mlx" if isinstance(config.get("quantization"), dict) else "safetensors"


def _quantization(config: dict) -> str:
    mlx = config.get("quantization")
    if isinstance(mlx, dict) and "bits" in mlx:
        return f"{mlx['bits']}bit"
    hf = config.get("quantization_config")
    if isinstance(hf, dict):
        method, bits = hf.get("quant_method", "quantized"), hf.get("bits")
        return f"{method}-{bits}bit" if bits else str(method)
    dtype = config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get("torch_dtype")
    return DTYPES.get(str(dtype), str(dtype or "?"))


def _architecture(config: dict) -> str | None:
    architectures = _architectures(config)
    model_type = config.get("model_type")
    if architectures and model_type:
        return f"{architectures[0]} ({model_type})"
    return (architectures or [model_type])[0]


def count_parameters(folder: Path, config: dict | None = None) -> int | None:
    """Parameters from the safetensors headers; an MLX-quantized matrix counts as its unpacked size."""
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        try:
            tensors.update(safetensors_shapes(shard))
        except (OSError, ValueError):
            return None
    if not tensors:
        return None
    quant = (config or {}).get("quantization") if isinstance((config or {}).get("quantization"), dict) else {}
    total = 0
    for name, shape in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases") and f"{prefix}.weight" in tensors:
            continue
        scales = tensors.get(f"{prefix}.scales")
        if leaf == "weight" and scales is not None:
            total += math.prod(shape[:-1]) * scales[-1] * _group_size(quant, prefix)
        else:
            total += math.prod(shape)
    return total


def _group_size(quant: dict, prefix: str) -> int:
    override = quant.get(prefix)
    if isinstance(override, dict) and "group_size" in override:
        return override["group_size"]
    return quant.get("group_size", 64)


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    _, header = read_header(path)
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _license(folder: Path) -> str | None:
    """From the model card's front matter (`license: apache-2.0`)."""
    try:
        card = (folder / "README.md").read_text(errors="replace")
    except OSError:
        card = ""
    if card.startswith("---"):
        front = card[3:].split("\n---", 1)[0]
        match = _LICENSE_LINE.search(front)
        if match:
            return match.group(1)
    return "see LICENSE" if (folder / "LICENSE").is_file() else None


def _describe_gguf(path: Path) -> ModelFacts:
    shards = [read_gguf_info(shard) for shard in shard_paths(path)]  # the first holds the metadata
    info = GgufInfo(shards[0].metadata, [tensor for shard in shards for tensor in shard.tensors])
    meta = info.metadata
    arch = meta.get("general.architecture")
    return ModelFacts(
        format="gguf",
        quantization=info.quantization,
        architecture=arch,
        parameters=info.parameters,
        context_length=meta.get(f"{arch}.context_length"),
        chat_template=bool(meta.get("tokenizer.chat_template")),
        license=meta.get("general.license") or _license(path.parent),
        types=info.type_mix,
    )
