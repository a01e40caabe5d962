#!/usr/bin/env python3
"""Checks and times the torch backend's Triton MoE kernels (`ferrum_mac/backends/torch/kernels/triton_moe.py`)
on a CUDA GPU at Qwen3-30B-A3B's MoE layer shape (128 experts, top 8, hidden 2048, expert
intermediate 768) in bf16 with random weights, for 1, 8 and 32 tokens:

- router: `qwen3_moe.Router` (softmax, top k, renormalise) vs `triton_moe.route` on its gate's
  logits, and vs `triton_moe.gate_route` (the gate projection in the same kernel) on x
- gate_up + SwiGLU: the gathered route's per-pair activations vs `triton_moe.gate_up_swiglu`
- down + sum over k + residual: the gathered route's vs `triton_moe.down_sum_plus`, split over
  the pairs (the default) and a program per token
- block: the grouped route (what runs outside decode steps) vs `TritonOps.sparse_moe`, both from x

then times the whole block (gate projection, router, experts, residual add) both ways, its
kernels (gate+route: cuBLAS's gate projection and `route`, as before `gate_route`), and
`down_sum_plus` per token against split over the pairs at 1, 4 and 8 tokens, its calls cycling
through random routings whose experts outgrow the L2 cache (as a step's layers read other
experts). Times are device microseconds per call, from CUDA graphs of 100 back-to-back calls
(a decode step runs as a graph). GB/s: the chosen experts' weights (each read once) over the
time. `--sweep` also times the expert kernels at other tile sizes. Exits 1 on a mismatch.
Needs only torch (with its triton); from the repository root:

    python3 scripts/check-torch-moe.py [--sweep]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gpu_check import can_check, compare, cycling, failures, graph_us, verdict  # noqa: E402  (this folder)

from ferrum_mac.backends.torch import pointwise  # noqa: E402
from ferrum_mac.backends.torch.kernels import triton_moe  # noqa: E402
from ferrum_mac.backends.torch.models.qwen3_moe import SparseMoe  # noqa: E402
from ferrum_mac.backends.torch.ops import TORCH_OPS, TritonOps  # noqa: E402
from ferrum_mac.backends.torch.weights import TensorSource  # noqa: E402
from ferrum_mac.weights import ModelConfig  # noqa: E402
from ferrum_mac.weights.moe import MoeConfig  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
TOKENS = (1, 8, 32)
DOWN_TOKENS = (1, 4, 8)
ROUTINGS = 16  # a timed down projection's calls cycle through these (~80 of the experts at 1 token: 250 MB)
DTYPE = torch.bfloat16
SWEEP_GATE_UP = [(16, 128), (16, 256), (32, 128), (32, 64), (64, 64)]  # (block_i, block_h)
SWEEP_DOWN = [  # split over the pairs?, (block_h, block_i)
    (True, (16, 1024)), (True, (8, 1024)), (True, (32, 1024)), (True, (16, 256)), (True, (32, 256)),
    (False, (16, 256)), (False, (8, 256)), (False, (16, 128)), (False, (32, 128)),
]  # fmt: skip


def main() -> int:
    if not can_check(triton_moe):
        return 2
    print(f"experts {EXPERTS}, top {TOP_K}, hidden {HIDDEN}, intermediate {INTER}, {DTYPE}\n")
    torch.manual_seed(0)
    moe = random_moe()
    timings, sweeps = [], []
    for tokens in TOKENS:
        x, residual = (torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE) for _ in range(2))
        check(moe, x, residual)
        timings.append(time_blocks(moe, x, residual))
        if "--sweep" in sys.argv:
            sweeps += sweep_gate_up(moe, x)

    downs = []
    for tokens in DOWN_TOKENS:
        down, down_sweep = time_down(moe, tokens)
        downs.append(down)
        sweeps += down_sweep

    print(
        f"{'tokens':>6} {'grouped us':>10} {'triton us':>9} {'speedup':>7}  {'gate+route':>10} {'gate_route':>10} {'gate_up':>7} {'down':>6}  {'GB/s':>5}"
    )
    for tokens, grouped, fused, gate_and_route, gate_route, gate_up, down, gbps in timings:
        print(f"{tokens:>6} {grouped:>10.2f} {fused:>9.2f} {grouped / fused:>6.2f}x  {gate_and_route:>10.2f} {gate_route:>10.2f} "
              f"{gate_up:>7.2f} {down:>6.2f}  {gbps:>5.0f}")  # fmt: skip
    print(
        f"\ndown_sum_plus, weights past L2\n{'tokens':>6} {'MB read':>7} {'per token us':>12} {'GB/s':>5} {'split us':>8} {'GB/s':>5} {'speedup':>7}"
    )
    for tokens, weight_bytes, per_token, split in downs:
        print(f"{tokens:>6} {weight_bytes / 1e6:>7.1f} {per_token:>12.2f} {weight_bytes / per_token / 1e3:>5.0f} "
              f"{split:>8.2f} {weight_bytes / split / 1e3:>5.0f} {per_token / split:>6.2f}x")  # fmt: skip
    if sweeps:
        print(f"\n{'tokens':>6}  {'kernel':<15} {'blocks':<10} {'us':>7}")
        for tokens, kernel, blocks, us in sweeps:
            print(f"{tokens:>6}  {kernel:<15} {str(blocks):<10} {us:>7.2f}")
    return verdict()


def random_moe() -> SparseMoe:
    """One MoE layer of random weights on the GPU, scaled so each projection keeps unit variance."""

    def randn(*shape, scale):
        return torch.randn(*shape, device="cuda", dtype=DTYPE) * scale

    tensors = {
        "layers.0.mlp.gate.weight": randn(EXPERTS, HIDDEN, scale=HIDDEN**-0.5),
        "layers.0.mlp.experts.gate_up_proj": randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
        "layers.0.mlp.experts.down_proj": randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5),
    }
    config = ModelConfig("qwen3_moe", 151936, HIDDEN, 6144, 1, 32, 4, 128)
    moe = MoeConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=INTER, norm_topk_prob=True)
    return SparseMoe(TensorSource(tensors, config, DTYPE, torch.device("cuda"), "random"), config, 0, moe)


def check(moe: SparseMoe, x: torch.Tensor, residual: torch.Tensor) -> None:
    tokens = x.shape[0]
    where = f"tokens={tokens}"
    router, experts = moe.router, moe.experts
    want_ids, want_weights = router(x)
    routed = {
        "router": triton_moe.route(router.gate(x), TOP_K, router.renormalise, DTYPE),
        "gate+router": triton_moe.gate_route(x, router.gate.weight, TOP_K, router.renormalise),
    }
    for name, (ids, weights) in routed.items():
        if not torch.equal(ids.long(), want_ids):
            probs = torch.softmax(router.gate(x).float(), dim=-1)  # bf16 logits can tie: either expert is right
            if not torch.equal(probs.gather(1, ids.long()), probs.gather(1, want_ids)):
                failures.append(f"{where} {name}: other experts chosen")
        compare(f"{where} {name} weights", weights, want_weights)

    # each expert kernel from the torch path's own inputs
    ids = want_ids.int()
    gate_up = experts.gate_up[want_ids.reshape(-1)]  # (T * k, 2I, H): the gathered route's
    rows = x.repeat_interleave(TOP_K, dim=0)[:, :, None]
    activations = pointwise.torch_swiglu(torch.bmm(gate_up, rows)[..., 0], want_weights.reshape(-1, 1))
    compare(f"{where} gate_up+swiglu", triton_moe.gate_up_swiglu(x, ids, want_weights, experts.gate_up), activations)
    del gate_up
    down = experts.down[want_ids.reshape(-1)]
    want = residual + torch.bmm(down, activations[:, :, None])[..., 0].view(tokens, TOP_K, HIDDEN).sum(dim=1)
    compare(f"{where} down+sum+residual", triton_moe.down_sum_plus(activations, ids, experts.down, residual), want)
    compare(
        f"{where} down+sum+residual, per token",
        triton_moe.down_sum_plus(activations, ids, experts.down, residual, split=False),
        want,
    )
    del down
    compare(f"{where} block vs grouped", TritonOps().sparse_moe(moe, x, residual), grouped_block(moe, x, residual))


def grouped_block(moe: SparseMoe, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The block as it runs without the Triton MoE kernels (grouped_mm on an SM80+ GPU)."""
    assert moe.experts.route(x.shape[0] * TOP_K) == "grouped"
    return residual + moe.experts(x, *moe.router(x), TORCH_OPS)


def time_blocks(moe: SparseMoe, x: torch.Tensor, residual: torch.Tensor) -> tuple:
    router, experts = moe.router, moe.experts
    ids, weights = triton_moe.gate_route(x, router.gate.weight, TOP_K, router.renormalise)
    activations = triton_moe.gate_up_swiglu(x, ids, weights, experts.gate_up)
    fused = graph_us(lambda: TritonOps().sparse_moe(moe, x, residual))
    chosen = ids.unique().numel()
    weight_bytes = chosen * 3 * INTER * HIDDEN * experts.down.element_size()
    return (
        x.shape[0],
        graph_us(lambda: grouped_block(moe, x, residual)),
        fused,
        graph_us(lambda: triton_moe.route(router.gate(x), TOP_K, router.renormalise, DTYPE)),
        graph_us(lambda: triton_moe.gate_route(x, router.gate.weight, TOP_K, router.renormalise)),
        graph_us(lambda: triton_moe.gate_up_swiglu(x, ids, weights, experts.gate_up)),
        graph_us(lambda: triton_moe.down_sum_plus(activations, ids, experts.down, residual)),
        weight_bytes / fused / 1e3,
    )


def time_down(moe: SparseMoe, tokens: int) -> tuple[tuple, list]:
    """(tokens, the experts' down bytes a call reads on average, per-token us, split us), and
    with --sweep the sweep's rows; each call on the next of ROUTINGS random routings."""
    down = moe.experts.down
    routings = [
        torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(tokens)]).int()
        for _ in range(ROUTINGS)
    ]
    activations = torch.randn(tokens * TOP_K, INTER, device="cuda", dtype=DTYPE)
    residual = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE)
    per_token = triton_moe.down_sum_plus(
        activations, routings[0], down, residual, split=False
    )  # checked against torch's in check()

    def timed(**blocks) -> float:
        compare(
            f"tokens={tokens} down {blocks}",
            triton_moe.down_sum_plus(activations, routings[0], down, residual, **blocks),
            per_token,
        )
        return graph_us(
            cycling(lambda ids: triton_moe.down_sum_plus(activations, ids, down, residual, **blocks), routings)
        )

    experts_read = sum(ids.unique().numel() for ids in routings) / ROUTINGS
    row = (tokens, experts_read * HIDDEN * INTER * down.element_size(), timed(split=False), timed(split=True))
    sweeps = []
    if "--sweep" in sys.argv:
        for split, (block_h, block_i) in SWEEP_DOWN:
            us = timed(split=split, block_h=block_h, block_i=block_i)
            sweeps.append((tokens, "down split" if split else "down per token", (block_h, block_i), us))
    return row, sweeps


def sweep_gate_up(moe: SparseMoe, x: torch.Tensor) -> list:
    experts = moe.experts
    ids, weights = triton_moe.gate_route(x, moe.router.gate.weight, TOP_K, moe.router.renormalise)
    activations = triton_moe.gate_up_swiglu(x, ids, weights, experts.gate_up)
    rows = []
    for block_i, block_h in SWEEP_GATE_UP:

        def gate_up():
            return triton_moe.gate_up_swiglu(x, ids, weights, experts.gate_up, block_i=block_i, block_h=block_h)

        compare(f"tokens={x.shape[0]} gate_up {block_i, block_h}", gate_up(), activations)
        rows.append((x.shape[0], "gate_up", (block_i, block_h), graph_us(gate_up)))
    return rows


if __name__ == "__main__":
    sys.exit(main())
