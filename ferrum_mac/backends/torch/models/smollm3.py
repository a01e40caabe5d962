"""SmolLM3: the Llama decoder with NoPE layers, which attend without positions.

Every fourth layer (`no_rope_layers`, or every `no_rope_layer_interval`-th) leaves q and k
unrotated, so it matches by content alone over any distance.

A NoPE layer takes RoPE tables at angle zero (cos 1, sin 0), which leave q and k exactly as
projected: every kernel that norms, ropes and writes q/k (the Triton ones included) serves
it unchanged."""

from __future__ import annotations

import torch

from ferrum_mac.backends.torch.models import llama
from ferrum_mac.backends.torch.weights import TensorSource


class NopeBlock(llama.Block):
    def __call__(self, h: torch.Tensor, plan, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return super().__call__(h, plan, torch.ones_like(cos), torch.zeros_like(sin))


class Model(llama.Model):
    def make_block(self, src: TensorSource, layer: int) -> llama.Block:
        if layer in self.config.nope_layers:
            return NopeBlock(src, self.config, layer, self.rope, self.make_mlp(src, layer))
        return super().make_block(src, layer)
