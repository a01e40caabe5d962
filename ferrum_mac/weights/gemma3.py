"""Gemma 3's text weights inside a multimodal checkpoint, by the names of a text-only one."""

from __future__ import annotations

# A Gemma3ForConditionalGeneration checkpoint names its text model `language_model.model.*`
# (transformers 4, the Hub's and mlx-community's files) or `model.language_model.*`
# (transformers 5, canonical `language_model.*`); the vision tower and projector are not read.
TEXT_PREFIXES = ("language_model.model.", "language_model.")
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def text_tensors(tensors):
    """`tensors` by canonical text-model names (`layers.0.self_attn.q_proj.weight`): itself
    when it holds a text-only checkpoint."""
    if not any(name.startswith(TEXT_PREFIXES) for name in tensors):
        return tensors
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(VISION_PREFIXES):
            continue
        prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), "")
        out[name[len(prefix) :]] = tensor
    return out
