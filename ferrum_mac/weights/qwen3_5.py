"""Qwen3.5's text weights inside a multimodal checkpoint, by the names of a text-only one."""

from __future__ import annotations

# A Qwen3_5ForConditionalGeneration checkpoint names its text model `model.language_model.*`
# (canonical `language_model.*`); its vision tower (`visual.*`) and multi-token-prediction
# head (`mtp.*`) are not read here.
TEXT_PREFIX = "language_model."
SKIPPED_PREFIXES = ("visual.", "mtp.")


def text_tensors(tensors):
    """`tensors` by canonical text-model names (`layers.0.linear_attn.in_proj_qkv.weight`)."""
    if not any(name.startswith(TEXT_PREFIX) for name in tensors):
        return {n: t for n, t in tensors.items() if not n.startswith(SKIPPED_PREFIXES)}
    return {n[len(TEXT_PREFIX) :]: t for n, t in tensors.items() if n.startswith(TEXT_PREFIX)}
