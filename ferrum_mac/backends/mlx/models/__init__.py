"""Model families, by `model_type`."""

from __future__ import annotations

from ferrum_mac.backends.mlx.models import gemma3, gpt_oss, llama, phi3, qwen3_5, qwen3_moe, smollm3

FAMILIES = {
    "llama": llama.Model,
    "mistral": llama.Model,
    "qwen2": llama.Model,
    "qwen3": llama.Model,
    "qwen3_moe": qwen3_moe.Model,
    # MoE with biases and a clamped SwiGLU, attention sinks, alternating windows
    "gpt_oss": gpt_oss.Model,
    # Gemma 3 (text)
    "gemma3_text": gemma3.Model,
    # fused projections, partial RoPE and LongRoPE; NoPE layers
    "phi3": phi3.Model,
    "smollm3": smollm3.Model,
    # hybrid linear attention: Gated DeltaNet layers and gated full attention
    "qwen3_5_text": qwen3_5.Model,
    "qwen3_5_moe_text": qwen3_5.Model,
    "qwen3_next": qwen3_5.Model,
}
