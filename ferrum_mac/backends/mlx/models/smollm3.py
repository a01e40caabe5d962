"""SmolLM3: the Llama decoder with NoPE layers, which attend without positions.

Every fourth layer (`no_rope_layers`, or every `no_rope_layer_interval`-th) leaves q and k
unrotated, so it matches by content alone over any distance."""

from __future__ import annotations

from ferrum_mac.backends.mlx.layers import NoRope, TensorSource
from ferrum_mac.backends.mlx.models import llama


class Model(llama.Model):
    def make_block(self, src: TensorSource, layer: int) -> llama.Block:
        block = super().make_block(src, layer)
        if layer in self.config.nope_layers:
            block.attn.rope = NoRope()
        return block
