"""Model families, by `model_type`."""

from __future__ import annotations

from ferrum_mac.backends.torch.models import llama, qwen3_moe
from ferrum_mac.backends.torch.models import phi3, smollm3

FAMILIES = {
    "llama": llama.Model,
    "mistral": llama.Model,
    "qwen2": llama.Model,
    "qwen3": llama.Model,
    "qwen3_moe": qwen3_moe.Model,
    # fused projections, partial RoPE and LongRoPE; NoPE layers
    "phi3": phi3.Model,
    "smollm3": smollm3.Model,
}
