"""The mixture-of-experts keys of a checkpoint's config (Qwen3-MoE), read the same way by every backend."""

from __future__ import annotations

from dataclasses import dataclass

from ferrum_mac.errors import CorruptModelError
from ferrum_mac.weights.config import ModelConfig


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: frozenset[int] = frozenset()

    def is_sparse(self, layer: int) -> bool:
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )


def moe_config(config: ModelConfig) -> MoeConfig:
    """MoE keys from config.json (transformers 5 writes `num_local_experts`) or GGUF metadata."""
    raw = config.extra

    def first(*keys):
        for key in keys:
            if raw.get(key) is not None:
                return raw[key]
        raise CorruptModelError(f"the qwen3_moe config lacks {keys[0]!r}; re-download the model or fix its config.json")

    is_gguf = "expert_count" in raw
    return MoeConfig(
        num_experts=int(first("num_experts", "num_local_experts", "expert_count")),
        top_k=int(first("num_experts_per_tok", "expert_used_count")),
        intermediate_size=int(first("moe_intermediate_size", "expert_feed_forward_length")),
        # GGUF has no such key: llama.cpp's qwen3moe always renormalises.
        norm_topk_prob=bool(raw.get("norm_topk_prob", is_gguf)),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=frozenset(raw.get("mlp_only_layers") or ()),
    )
