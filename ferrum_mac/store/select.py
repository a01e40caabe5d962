"""Which files of a repository a model needs.

Config, generation config, tokenizer, chat template, a README (for the license) and one set
of weights: safetensors when there are any (never the pickled `.bin` beside them, nor GGUF
copies), else exactly one GGUF file. Only the repository's top level: Meta's repositories
keep a second, pickled copy of the weights under `original/`.
"""

from __future__ import annotations

import re

from ferrum_mac.errors import ModelNotFoundError, UnsupportedModelError

SIDE_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "README.md",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)
# GGUF tensor types ferrum loads, best first when a repository offers several.
GGUF_PREFERENCE = ("Q4_0", "Q4_1", "Q8_0", "F16", "F32")
_GGUF_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d_[A-Z0-9_]*?|BF16|F16|F32)(?=[.-]|$)", re.IGNORECASE)


def gguf_quant_of(filename: str) -> str | None:
    """`Llama-3.2-1B-Instruct-Q8_0.gguf` -> "Q8_0" (the tag GGUF publishers put in file names)."""
    match = _GGUF_QUANT.search(filename.rsplit("/", 1)[-1].removesuffix(".gguf"))
    return match.group(1).upper() if match else None


def needed_files(paths: list[str], gguf_quant: str | None = None, repo: str = "the repository") -> list[str]:
    """The subset of a repository's file list (`paths`) to download, in a stable order."""
    top = [p for p in paths if "/" not in p]
    safetensors = [p for p in top if p.endswith(".safetensors")]
    ggufs = [p for p in top if p.endswith(".gguf")]
    if gguf_quant is not None or not safetensors:
        if not ggufs:
            raise _no_weights(top, repo)
        weights = [choose_gguf(ggufs, gguf_quant, repo)]
        # A GGUF carries its own config and tokenizer; the side files would describe other weights.
        return sorted(p for p in top if p == "README.md") + weights
    return sorted(p for p in top if p in SIDE_FILES) + _safetensors_set(top, safetensors)


def _safetensors_set(top: list[str], safetensors: list[str]) -> list[str]:
    # Mistral's repositories hold the weights twice: `model-*.safetensors` for transformers and
    # `consolidated.safetensors` in their own layout. Take the transformers set when both exist.
    transformers_set = [p for p in safetensors if p.startswith("model")]
    chosen = transformers_set or safetensors
    index = [p for p in top if p == "model.safetensors.index.json"]
    return index + sorted(chosen)


def choose_gguf(ggufs: list[str], quant: str | None, repo: str = "the repository") -> str:
    """One GGUF file: the one tagged `quant`, else the first loadable type in GGUF_PREFERENCE."""
    by_quant = {gguf_quant_of(p): p for p in sorted(ggufs)}
    if quant is not None:
        if quant.upper() in by_quant:
            return by_quant[quant.upper()]
        raise ModelNotFoundError(f"{repo} has no {quant} GGUF; it has: {_tags(by_quant)}")
    if len(ggufs) == 1:
        return ggufs[0]
    for preferred in GGUF_PREFERENCE:
        if preferred in by_quant:
            return by_quant[preferred]
    raise UnsupportedModelError(
        f"{repo} has no GGUF of a type ferrum loads ({', '.join(GGUF_PREFERENCE)}); it has: {_tags(by_quant)}"
    )


def _tags(by_quant: dict) -> str:
    return ", ".join(str(tag) for tag in by_quant)


def _no_weights(top: list[str], repo: str) -> Exception:
    if any(p.endswith((".bin", ".pt", ".pth")) for p in top):
        return UnsupportedModelError(
            f"{repo} has only pickled PyTorch weights; ferrum loads safetensors or GGUF (look for a safetensors conversion)"
        )
    return ModelNotFoundError(f"{repo} has no model weights (no .safetensors or .gguf files at its top level)")
