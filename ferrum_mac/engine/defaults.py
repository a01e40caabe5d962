"""What the engine uses when nobody says otherwise: the longest answer, and
sampling settings from the model's generation_config.json (or, for the bundled GGUF, which
carries none, what its authors recommend).

As Ollama does, a mild repetition penalty over the last 64 tokens keeps a small model from
looping ("I'm a magic chat. I'm a magic chat. ..."), and an answer stops at a few thousand
tokens (or the end of the context) instead of running for minutes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from ferrum_mac.engine.sampling import SamplingError, SamplingParams

FALLBACK_SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.1, penalty_window=64)
DEFAULT_MAX_TOKENS = 4096  # an answer's default limit, where the model's generation_config sets none

# generation_config.json key -> SamplingParams field
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def sampling_defaults(model_path: str | Path, recommended: Mapping[str, float] | None = None) -> SamplingParams:
    """FALLBACK_SAMPLING with what the model's generation_config.json sets (where it has none,
    `recommended`: for the bundled GGUF, its authors' recommendation, which the composition
    root looks up); plain greedy when it says `do_sample: false` (as transformers' generate
    would be)."""
    config = _read_generation_config(Path(model_path)) or dict(recommended or {})
    if config.get("do_sample") is False:
        return FALLBACK_SAMPLING.replace(temperature=0.0, repetition_penalty=1.0)
    found = {field: config[key] for key, field in _GENERATION_KEYS.items() if isinstance(config.get(key), (int, float))}
    if found.get("top_k") is not None:
        found["top_k"] = int(found["top_k"])
    try:
        return FALLBACK_SAMPLING.replace(**found)
    except SamplingError:  # out-of-range values in the file: ignore them all
        return FALLBACK_SAMPLING


def max_tokens_default(model_path: str | Path) -> int:
    """The most tokens an answer gets unless the user says otherwise: the model's
    generation_config `max_new_tokens`, else DEFAULT_MAX_TOKENS."""
    limit = _read_generation_config(Path(model_path)).get("max_new_tokens")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else DEFAULT_MAX_TOKENS


def _read_generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # a broken generation config is not worth refusing the model over
    return value if isinstance(value, dict) else {}
