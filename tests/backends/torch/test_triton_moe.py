"""The Triton MoE kernels (`triton_moe`) against the torch code they replace: the router (from
the logits, and with the gate projection), the pairs' gate_up + SwiGLU, the down projection summed over k plus the residual, the whole
block, and a Qwen3-MoE decode through them.

Without a GPU the kernels run in Triton's interpreter on CPU tensors, so shapes stay small
(8 or 16 experts, hidden 64); with one they run compiled on it.
"""

from __future__ import annotations


import pytest
import torch

from triton_interpreter import DEVICE, INTERPRET, like_a_gpu, ulps  # noqa: E402  (before triton: sets the interpreter up)

triton = pytest.importorskip("triton")

from ferrum_mac.backends.torch import steps  # noqa: E402
from ferrum_mac.backends.torch.kernels import triton_moe, triton_splits  # noqa: E402
from ferrum_mac.backends.torch.layers import Linear  # noqa: E402
from ferrum_mac.backends.torch.models.qwen3_moe import Router, SparseMoe  # noqa: E402
from ferrum_mac.backends.torch.ops import TORCH_OPS, Ops, TritonOps  # noqa: E402
from ferrum_mac.backends.torch.pointwise import torch_swiglu  # noqa: E402
from ferrum_mac.backends.torch.weights import TensorSource  # noqa: E402
from ferrum_mac.weights import ModelConfig  # noqa: E402
from ferrum_mac.weights.moe import MoeConfig  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def interpreter_rounds_like_a_gpu():
    """The interpreter computing as a GPU does (`triton_interpreter.like_a_gpu`). It pays per
    program more than per element, so by default programs take wide blocks here (the kernel
    tests ask for narrow ones, to cover partial blocks and loops)."""
    with like_a_gpu():
        if not INTERPRET:
            yield
            return
        patch = pytest.MonkeyPatch()
        patch.setattr(triton_moe, "GATE_UP_BLOCK_I", 64)
        patch.setattr(triton_moe, "DOWN_BLOCK_H", 64)
        patch.setattr(triton_moe, "UNSPLIT_DOWN_BLOCK_H", 64)
        yield
        patch.undo()


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Gate logits without ties (each row a shuffle of multiples of 1/8, exact in bf16), so the
    top k is one set of experts, whichever way ties would break."""
    rows = torch.stack([torch.randperm(experts) for _ in range(tokens)]).float()
    return ((rows - experts / 2) / 8).to(dtype).to(DEVICE)


def random_moe(experts: int, top_k: int, hidden: int, inter: int, renormalise: bool, dtype: torch.dtype) -> SparseMoe:
    """One sparse MoE layer of random weights, scaled so each projection keeps unit variance."""
    tensors = {
        "layers.0.mlp.gate.weight": torch.randn(experts, hidden) * hidden**-0.5 * 4,
        "layers.0.mlp.experts.gate_up_proj": torch.randn(experts, 2 * inter, hidden) * hidden**-0.5,
        "layers.0.mlp.experts.down_proj": torch.randn(experts, hidden, inter) * inter**-0.5,
    }
    config = ModelConfig("qwen3_moe", 320, hidden, 4 * hidden, 1, 4, 2, 16)
    moe = MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=inter, norm_topk_prob=renormalise)
    return SparseMoe(TensorSource(tensors, config, dtype, DEVICE, "random"), config, 0, moe)


def torch_pair_activations(moe: SparseMoe, x, ids, weights) -> torch.Tensor:
    """The torch path's SwiGLU outputs per pair, (token, slot) order: each projection rounded."""
    gate_up = moe.experts.gate_up[ids.reshape(-1).long()]  # (T * k, 2I, H)
    rows = x.repeat_interleave(ids.shape[1], dim=0)[:, :, None]
    return torch_swiglu(torch.bmm(gate_up, rows)[..., 0], weights.reshape(-1, 1))


# experts, top k, hidden, intermediate, tokens: a lone token; every expert shared (5 tokens
# choose 4 of 8); a partial column block (48 = 16 * 3, blocks of 32 tested below)
SHAPES = [(16, 2, 64, 32, 1), (8, 4, 64, 48, 5), (16, 3, 64, 48, 3)]
DTYPES = [torch.float32, torch.bfloat16]


# -- router -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts, top_k, tokens", [(8, 2, 1), (16, 4, 5), (12, 3, 3)])
@pytest.mark.parametrize("renormalise", [True, False])
def test_route_matches_router(dtype, experts, top_k, tokens, renormalise):
    torch.manual_seed(1)
    logits = distinct_logits(tokens, experts, dtype)
    identity = Linear(torch.eye(experts, dtype=dtype, device=DEVICE))  # the router's gate passes the logits through
    want_ids, want_weights = Router(identity, top_k, renormalise)(logits)

    ids, weights = triton_moe.route(logits, top_k, renormalise, dtype)

    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=ulps(dtype) / 4, atol=ulps(dtype) / 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "experts, top_k, tokens", [(8, 2, 1), (16, 4, 5), (14, 3, 3)]
)  # 14: a partial block of experts
@pytest.mark.parametrize("renormalise", [True, False])
def test_gate_route_matches_router(dtype, experts, top_k, tokens, renormalise):
    """The gate projection too, its logits rounded as F.linear's; the last of a token's
    programs routes it and leaves its arrival counter at zero for the next launch."""
    torch.manual_seed(5)
    hidden = 100  # two blocks of 64, the second partial
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    gate = Linear((torch.randn(experts, hidden, device=DEVICE) * hidden**-0.5 * 4).to(dtype))
    want_ids, want_weights = Router(gate, top_k, renormalise)(x)
    top = torch.softmax(gate(x).float(), dim=-1).topk(top_k + 1).values
    assert (top[:, top_k - 1] > top[:, top_k]).all(), "the seed gives no tie at the top-k cut"

    ids, weights = triton_moe.gate_route(x, gate.weight, top_k, renormalise, block_e=4, block_h=64)

    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=ulps(dtype), atol=ulps(dtype))
    assert not triton_splits.split_counters(DEVICE).any()


def test_route_breaks_ties_to_the_lower_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]], device=DEVICE)
    ids, weights = triton_moe.route(logits, 2, False, torch.float32)
    assert ids.tolist() == [[1, 3]] and weights[0, 0] == weights[0, 1]


# -- experts --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts, top_k, hidden, inter, tokens", SHAPES)
def test_gate_up_swiglu_matches_torch(dtype, experts, top_k, hidden, inter, tokens):
    torch.manual_seed(2)
    moe = random_moe(experts, top_k, hidden, inter, True, dtype)
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    ids, weights = triton_moe.route(moe.router.gate(x), top_k, True, dtype)

    got = triton_moe.gate_up_swiglu(x, ids, weights, moe.experts.gate_up, block_i=32, block_h=32)

    want = torch_pair_activations(moe, x, ids, weights)
    torch.testing.assert_close(got, want, rtol=ulps(dtype), atol=ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts, top_k, hidden, inter, tokens", SHAPES)
@pytest.mark.parametrize("split", [True, False])
def test_down_sum_plus_is_one_rounding_of_the_exact_sum(dtype, experts, top_k, hidden, inter, tokens, split):
    """Within a rounding of the float64 result; the torch path, which rounds each pair's output
    and the sum before the residual add, is further off (bf16: a few ulps). Split over the
    pairs, it leaves its arrival counters at zero, ready for the next launch."""
    torch.manual_seed(3)
    moe = random_moe(experts, top_k, hidden, inter, False, dtype)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int().to(DEVICE)
    activations = torch.randn(tokens * top_k, inter, device=DEVICE).to(dtype)
    residual = torch.randn(tokens, hidden, device=DEVICE).to(dtype)

    got = triton_moe.down_sum_plus(activations, ids, moe.experts.down, residual, block_h=32, block_i=32, split=split)

    down = moe.experts.down[ids.reshape(-1).long()]  # (T * k, H, I)
    per_pair = torch.bmm(down.double(), activations.double()[:, :, None])[..., 0]
    exact = residual.double() + per_pair.view(tokens, top_k, hidden).sum(dim=1)
    close = {torch.float32: 1e-5, torch.bfloat16: 2**-8}[dtype]  # bf16: one ulp
    torch.testing.assert_close(got.double(), exact, rtol=close, atol=1e-5)
    torch_path = residual + torch.bmm(down, activations[:, :, None])[..., 0].view(tokens, top_k, hidden).sum(dim=1)
    torch.testing.assert_close(got, torch_path, rtol=ulps(dtype), atol=ulps(dtype))
    assert not triton_splits.split_counters(DEVICE).any()


@pytest.mark.parametrize(
    "dtype, route, renormalise",
    [
        (torch.float32, "grouped", True),
        (torch.bfloat16, "grouped", False),
        (torch.float32, "gathered", False),
        (torch.bfloat16, "gathered", True),
    ],
)
def test_moe_block_matches_the_torch_routes(dtype, route, renormalise):
    torch.manual_seed(4)
    moe = random_moe(8, 4, 64, 48, renormalise, dtype)
    x = torch.randn(5, 64, device=DEVICE).to(dtype)
    residual = torch.randn(5, 64, device=DEVICE).to(dtype)
    experts, weights = moe.router(x)
    top = torch.softmax(moe.router.gate(x).float(), dim=-1).topk(5).values
    assert (top[:, 3] > top[:, 4]).all(), "the seed gives no tie at the top-k cut"

    got = TritonOps().sparse_moe(moe, x, residual)

    pairs = getattr(moe.experts, route)(x, experts.reshape(-1), weights.reshape(-1), TORCH_OPS)
    want = residual + pairs.view(5, 4, -1).sum(dim=1)
    torch.testing.assert_close(got, want, rtol=ulps(dtype), atol=ulps(dtype))


def test_triton_block_only_for_decode_sizes(monkeypatch):
    moe = random_moe(8, 4, 64, 32, True, torch.float32)
    monkeypatch.setattr(triton_moe, "gate_route", lambda *args: (None, None))
    monkeypatch.setattr(triton_moe, "experts_plus", lambda *args: "triton")
    monkeypatch.setattr(Ops, "sparse_moe", lambda self, moe, x, residual: "torch")
    x = torch.randn(64, 64)
    assert TritonOps().sparse_moe(moe, x, x) == "triton"
    assert TritonOps().sparse_moe(moe, torch.randn(65, 64), x) == "torch"  # 256 pairs at most
    moe.experts.forced_route = "grouped"  # a forced torch route (FERRUM_TORCH_MOE_ROUTE)
    assert TritonOps().sparse_moe(moe, x, x) == "torch"


class MoeOnTriton(TritonOps):
    """Torch's ops but for the MoE blocks: Triton's there."""

    triton = False  # attention stays torch's, which masks by the plan's bias
    rms_norm, swiglu, attention = Ops.rms_norm, Ops.swiglu, Ops.attention

    def __init__(self):
        super().__init__(gemv=frozenset())


# -- a whole decode -----------------------------------------------------------------------------


def test_decode_batch_through_triton_moe_matches_torch(zoo, monkeypatch):
    """Two sequences at different positions, two steps of the tiny Qwen3-MoE: the logits with
    the MoE blocks on Triton (their ops forced on the CPU under the interpreter) equal torch's."""
    from helpers import decode_batch_steps, random_tokens

    model = zoo.ferrum("qwen3_moe", "torch")
    prompts = {"a": random_tokens(3, seed=4), "b": random_tokens(6, seed=5)}

    def decode_twice(tag: str) -> list[torch.Tensor]:
        return decode_batch_steps(model, prompts, tag)

    launches = []
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: TORCH_OPS)
    expected = decode_twice("torch")
    model.reset()  # drops the decode steps: the next run makes its own
    monkeypatch.setattr(steps, "decode_ops", lambda device, options, verify=False: MoeOnTriton())
    gate_route = triton_moe.gate_route
    monkeypatch.setattr(triton_moe, "gate_route", lambda *args: launches.append(1) or gate_route(*args))
    on_triton = decode_twice("triton")
    model.reset()
    for got, want in zip(on_triton, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert launches, "the MoE blocks ran on Triton"
