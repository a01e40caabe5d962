"""Which kernel runs each step of an MLX forward: the one place that decides it.

The runtime picks the device's ops once at load (`device_ops`) and hands them to the model's
layers through the `TensorSource`; the model files call them and never ask where they run:

- `Ops`: MLX's own ops, Metal's path and the reference every other route is tested against.
  `ops.project(attn, ...)` is `attn.project(...)`, and so on: attention.py holds the plain path.
- `cuda.ops.CudaOps`: MLX's CUDA build, with our kernels where they take the case (decode
  attention through block tables, a token's heads in one kernel, few-row quantized matmuls,
  the MoE decode kernels) and padded shapes for MLX's cuDNN attention.
- `cpu.ops.CpuOps`: MLX's CPU build, with numpy's attention for long segments, quantized
  checkpoints loaded dense, and unfused projections.

The CUDA module is imported only on CUDA: the Mac and CPU paths never load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from ferrum_mac.backends.mlx.attention import Plan, Segment
from ferrum_mac.backends.mlx.layers import Linear
from ferrum_mac.backends.mlx.memory import on_cpu, on_cuda_gpu
from ferrum_mac.backends.options import DEFAULTS, BackendOptions

if TYPE_CHECKING:
    from ferrum_mac.backends.mlx.attention import Attention
    from ferrum_mac.backends.mlx.models.qwen3_moe import Experts, Router
    from ferrum_mac.weights import Checkpoint


class Ops:
    """MLX's own ops (Metal's path, and the reference)."""

    device = "gpu"  # where MLX computes: "gpu" (Metal), "cuda" or "cpu"
    fuse_projections = True  # linears that read one input run as one matmul (`layers.Projections`)
    segment_type = Segment
    linear_type = Linear

    def __init__(self, options: BackendOptions = DEFAULTS):
        self.options = options

    # -- loading --------------------------------------------------------------------------

    def load_tensors(self, checkpoint: "Checkpoint", dtype: mx.Dtype) -> dict:
        """The tensors the model is built from (the CPU loads quantized linears dense)."""
        return checkpoint.tensors

    def expert_weights(self, weight: mx.array) -> mx.array:
        """A dense stack of experts' weights as `gather_mm` takes it here."""
        return weight

    def router_gate(self, gate: Linear) -> Linear:
        """The MoE router's gate projection as it runs best here."""
        return gate

    def warm_up(self, attn: "Attention", dtype: mx.Dtype) -> None:
        """Compile the kernels a later step would compile in its own time (none here)."""

    # -- a forward ------------------------------------------------------------------------

    def plan(self, segments: list[Segment]) -> Plan:
        return Plan(segments)

    def project(self, attn: "Attention", x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """`attn.project`: normed x -> roped q, k and v."""
        return attn.project(x, positions)

    def attend_segment(self, attn: "Attention", q: mx.array, k: mx.array, v: mx.array, seg: Segment) -> mx.array:
        """`attn.attend_segment`: one sequence's tokens against its cache."""
        return attn.attend_segment(q, k, v, seg)

    def attend_batch(self, attn: "Attention", q: mx.array, k: mx.array, v: mx.array, plan: Plan) -> mx.array:
        """`attn.attend_batch`: one token each of several sequences, together."""
        return attn.attend_batch(q, k, v, plan)

    def route(self, router: "Router", logits: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """`router.route`: the router's logits -> expert ids and weights."""
        return router.route(logits, dtype)

    def mix_experts(self, experts: "Experts", x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        """`experts.mix`: the chosen experts' outputs, weighted and summed."""
        return experts.mix(x, ids, weights)


def device_ops(options: BackendOptions = DEFAULTS) -> Ops:
    """The ops of the device MLX computes on now (its default device)."""
    if on_cpu():
        from ferrum_mac.backends.mlx.cpu.ops import CpuOps

        return CpuOps(options)
    if on_cuda_gpu():
        from ferrum_mac.backends.mlx.cuda.ops import CudaOps

        return CudaOps(options)
    return Ops(options)
