"""Model families, by `model_type`."""

from __future__ import annotations

from ferrum_mac.backends.torch.models import gemma3, llama, qwen3_moe

FAMILIES = {
    "llama": llama.Model,
    "mistral": llama.Model,
    "qwen2": llama.Model,
    "qwen3": llama.Model,
    "qwen3_moe": qwen3_moe.Model,
    # Gemma 3 (text)
    "gemma3_text": gemma3.Model,
}
