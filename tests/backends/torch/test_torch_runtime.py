"""The torch backend's machinery: decode steps that never read the device from the host (so
CUDA can capture them as graphs), steps kept per cache buffer, loading without MLX, and the
device sampler."""

from __future__ import annotations

import sys

import pytest
import torch

import ferrum_mac
import helpers
from ferrum_mac.llm import DecodeItem
from helpers import assert_close, hf_logits, random_tokens

PROMPT = random_tokens(12, seed=21)


def torch_model(zoo, family: str):
    return zoo.ferrum(family, "torch")


# -- decode steps -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, route", [("qwen3", ""), ("qwen3_moe", "grouped"), ("qwen3_moe", "gathered"), ("qwen3_moe", "dense")]
)
def test_decode_step_never_reads_the_device(zoo, monkeypatch, family, route):
    """On the meta device tensors have shapes but no values, so `.item()`, `.tolist()` or an op
    whose output shape depends on values fails: a step that runs there can be a CUDA graph."""
    from ferrum_mac.backends.options import BackendOptions
    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.weights import load_checkpoint

    options = BackendOptions(torch_moe_route=route)
    model = TorchLLM(
        load_checkpoint(zoo.path(family)), dtype="bfloat16", device="meta", options=options
    )  # grouped_mm: bf16 as on CUDA
    model.prefill("a", PROMPT)
    out = model.decode_batch([DecodeItem("a", 5, len(PROMPT)), DecodeItem("b", torch.tensor(7, device="meta"), 0)])
    assert out.shape == (2, model.config.vocab_size) and out.device.type == "meta"


def test_steps_are_kept_by_rows_and_width(zoo):
    """A later sequence of the same shape reuses a step (on CUDA its captured graph); growing
    the pool drops every step (their graphs read the old buffers)."""
    from ferrum_mac.backends.torch.kv import BLOCK_TOKENS
    from ferrum_mac.backends.torch.runtime import MIN_WIDTH

    model = torch_model(zoo, "llama")
    model.reset()  # the model is shared: earlier tests left caches in its pool
    model.prepare("first", 40)  # warms up (captures, on CUDA) a one-row step
    step = model.steps.steps[(1, MIN_WIDTH, 1)]
    model.release("first")
    model.prefill("second", PROMPT)
    model.decode("second", 3, len(PROMPT))
    assert model.steps.steps[(1, MIN_WIDTH, 1)] is step  # short sequences share the narrowest step
    blocks = model.kv.blocks
    held = model.state.length("second")
    longer = random_tokens(blocks * BLOCK_TOKENS - held, seed=3)  # more blocks than the pool holds
    model.prefill("second", longer)
    model.decode("second", 3, held + len(longer))
    assert model.kv.blocks > blocks
    width = max(MIN_WIDTH, 1 << (len(model.kv.get("second").blocks) - 1).bit_length())
    assert list(model.steps.steps) == [(1, width, 1)]  # the others died with the old buffers
    model.release("second")


def test_prepare_captures_the_one_row_steps_up_to_its_tokens(zoo, monkeypatch):
    """On CUDA `prepare` captures a one-row step for each table width the sequence may reach
    (here: capture stands in for a CUDA graph's)."""
    from ferrum_mac.backends.torch import steps

    captured = []
    monkeypatch.setattr(steps.DecodeStep, "capture", lambda step: captured.append((step.rows, step.width)))
    model = torch_model(zoo, "llama")
    model.reset()
    monkeypatch.setattr(model.steps, "get", captured_steps(model.steps.get))
    model.prepare("a", 20 * 32)  # 20 blocks: widths from the narrowest (8) to 32
    assert sorted(set(captured)) == [(1, 8), (1, 16), (1, 32)]  # (the stand-in keeps no graph)
    model.reset()


def captured_steps(get):
    """`DecodeSteps.get`, its steps marked as captured (as on CUDA)."""

    def get_captured(rows: int, width: int, sequences: int | None = None):
        step = get(rows, width, sequences)
        step.captured = True
        return step

    return get_captured


def test_decode_batch_leaves_sequences_outside_the_batch_alone(zoo):
    """A batch of three runs a four-row step (the last row on the scratch block); "b", not in
    the batch, keeps its cache."""
    model = torch_model(zoo, "llama")
    model.reset()
    for cid in ("a", "b", "c", "d"):
        model.prefill(cid, PROMPT)
    model.decode_batch([DecodeItem(cid, 5, len(PROMPT)) for cid in ("a", "c", "d")])
    assert list(model.steps.steps) == [(4, 8, 4)]  # rows a power of two; the narrowest width
    got = model.decode("b", 7, len(PROMPT))
    model.prefill("fresh", PROMPT)
    want = model.decode("fresh", 7, len(PROMPT))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    model.reset()


def test_model_tensors_are_shared_not_copied(zoo):
    """Built from a transformers model's own tensors (as `ferrum bench` does), the backend keeps
    them: only fused projections are new, so both sides fit in memory at once."""
    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.weights import Checkpoint, config_from_dict
    from ferrum_mac.weights.safetensors import canonical_name

    reference = zoo.hf("qwen3_moe")
    state = reference.state_dict()
    tensors = {canonical_name(k): v for k, v in state.items()}
    config = config_from_dict({**reference.config.to_dict(), "dtype": "float32"})
    model = TorchLLM(Checkpoint(config, tensors, zoo.path("qwen3_moe"), "safetensors"), device="cpu")  # the reference's
    assert model.model.embed.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up.data_ptr() == state["model.layers.0.mlp.experts.gate_up_proj"].data_ptr()
    assert_close(model.forward_verify("x", PROMPT), hf_logits(reference, PROMPT), 1e-4)


# -- without MLX ------------------------------------------------------------------------------


@pytest.fixture
def no_mlx(monkeypatch):
    """Imports of MLX fail, as on a CUDA machine without it."""
    for name in [m for m in sys.modules if m == "mlx" or m.startswith("mlx.")] + ["mlx", "mlx.core"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_without_mlx_auto_opens_safetensors_with_torch(zoo, no_mlx, monkeypatch):
    from transformers import AutoModelForCausalLM

    from ferrum_mac import backends
    from ferrum_mac.backends.torch.runtime import TorchLLM

    monkeypatch.setattr(backends, "available", lambda b: b == "torch")
    folder = zoo.path("qwen3", dtype="bfloat16")
    model = ferrum_mac.open_model(folder, dtype="float32")
    assert isinstance(model, TorchLLM)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # bf16 weights, upcast
    assert_close(model.forward_verify("x", PROMPT), hf_logits(reference, PROMPT), 1e-4)


def test_without_mlx_gguf_says_what_it_needs(no_mlx, tmp_path):
    from ferrum_mac.errors import UnsupportedModelError
    from ferrum_mac.weights.gguf import load_gguf

    with pytest.raises(UnsupportedModelError, match="needs MLX") as err:
        load_gguf(tmp_path / "x.gguf")
    assert "\n" not in str(err.value)


def test_without_torch_asking_for_it_says_how_to_install(monkeypatch):
    from ferrum_mac import backends
    from ferrum_mac.errors import UnsupportedError

    monkeypatch.setattr(backends, "available", lambda b: b == "mlx")
    with pytest.raises(UnsupportedError, match="pip install"):
        backends.choose("torch")


@pytest.mark.parametrize(
    "installed, gpu, chosen",
    [
        ({"mlx", "torch"}, True, "torch"),
        ({"mlx", "torch"}, False, "mlx"),
        ({"mlx"}, True, "mlx"),
        ({"torch"}, False, "torch"),
    ],
)
def test_auto_prefers_torch_on_an_nvidia_gpu_else_mlx(monkeypatch, installed, gpu, chosen):
    from ferrum_mac import backends

    monkeypatch.setattr(backends, "available", lambda b: b in installed)
    monkeypatch.setattr(backends, "nvidia_gpu_present", lambda: gpu)
    assert backends.choose("auto") == chosen


# -- the sampler --------------------------------------------------------------------------

TOP, SECOND, VOCAB = 5, 9, 320


def made_up(top: float = 4.0, second: float = 3.0) -> torch.Tensor:
    """Logits on the device `torch_model`'s models take by default (on a GPU machine, its GPU)."""
    values = torch.full((VOCAB,), -10.0, device="cuda" if torch.cuda.is_available() else "cpu")
    values[TOP], values[SECOND] = top, second
    return values


def pick(model, logits=None, context=(), **params) -> int:
    from ferrum_mac.engine.sampling import SamplingParams

    sampler = model.sampler(SamplingParams(temperature=0.0).replace(**params), list(context))
    token = sampler.sample(made_up() if logits is None else logits)
    assert isinstance(token, torch.Tensor)  # on the device, not read yet
    return sampler.read(token)


def test_sampler_bias_and_penalties(zoo):
    model = torch_model(zoo, "llama")
    assert pick(model) == TOP
    assert pick(model, logit_bias={7: 100.0}) == 7
    assert pick(model, logit_bias={TOP: -float("inf")}) == SECOND
    assert pick(model, context=[TOP], repetition_penalty=2.0) == SECOND  # 4 / 2 < 3
    assert pick(model, context=[TOP], repetition_penalty=1.2) == TOP
    assert pick(model, made_up(-1.0, -1.5), context=[TOP], repetition_penalty=2.0) == SECOND  # -1 * 2 < -1.5
    assert pick(model, context=[TOP], presence_penalty=2.0) == SECOND
    assert pick(model, context=[TOP, TOP], frequency_penalty=0.6) == SECOND
    assert pick(model, context=[TOP] + [100] * 70, presence_penalty=2.0, penalty_window=64) == TOP


def test_sampler_draws(zoo):
    model = torch_model(zoo, "llama")
    tied = made_up(3.0, 3.0)
    assert {pick(model, tied, temperature=1.0, seed=s) for s in range(12)} == {TOP, SECOND}
    assert len({pick(model, tied, temperature=1.0, top_k=1, seed=s) for s in range(6)}) == 1
    assert {pick(model, made_up(3.0, 2.5), temperature=1.0, min_p=0.5, seed=s) for s in range(12)} == {TOP, SECOND}
    assert {pick(model, made_up(3.0, 2.9), temperature=1.0, top_p=1e-6, seed=s) for s in range(6)} == {TOP}
    assert pick(model, tied, temperature=1.0, seed=4) == pick(model, tied, temperature=1.0, seed=4)


def test_sampler_penalises_what_it_picked_before_reading_it(zoo):
    from ferrum_mac.engine.sampling import SamplingParams

    sampler = torch_model(zoo, "llama").sampler(SamplingParams(temperature=0.0, presence_penalty=2.0), [])
    first, second = sampler.sample(made_up()), sampler.sample(made_up())
    assert (sampler.read(first), sampler.read(second)) == (TOP, SECOND)


def test_sampled_tokens_drive_decode(zoo):
    """The engine's loop: sample on the device, decode with the unread token."""
    from ferrum_mac.engine.sampling import SamplingParams

    model = torch_model(zoo, "qwen3")
    sampler = model.sampler(SamplingParams(temperature=0.0), PROMPT)
    token, pos, got = sampler.sample(model.prefill("s", PROMPT)), len(PROMPT), []
    for _ in range(6):
        following = sampler.sample(model.decode("s", token, pos))
        got.append(sampler.read(token))
        token, pos = following, pos + 1
    model.release("s")
    assert got == helpers.ferrum_greedy(model, "g", PROMPT, 6)
    model.release("g")


@pytest.mark.parametrize("n, size", [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (16, 16), (17, 32)])
def test_decode_steps_take_powers_of_two(n, size):
    from ferrum_mac.backends.torch.runtime import power_of_two_above

    assert power_of_two_above(n) == size


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_a_fresh_prompt_as_a_prefill_step_equals_the_forward(zoo, family):
    """A fresh prompt run as a `PrefillStep` (padded; a CUDA graph on a GPU, eager here) gives
    the forward's logits and the same cache: decoding on gives the same logits, and another
    sequence's blocks are untouched by the padding."""
    model = torch_model(zoo, family)
    model.reset()
    other = random_tokens(40, seed=8)
    model.prefill("other", other)
    for n in (5, 45, 70):  # within a block, across blocks, past the first padded length
        prompt = random_tokens(n, seed=n)
        model.captured_prefill = True
        got = model.prefill("step", prompt)
        assert model.state.length("step") == n and any(key[0] == "prefill" for key in model.steps.steps)
        model.captured_prefill = False
        want = model.prefill("forward", prompt)
        assert_close(got, want, 1e-5)
        assert_close(model.decode("step", 3, n), model.decode("forward", 3, n), 1e-5)
        model.release("step")
        model.release("forward")
    model.prefill("again", other)
    assert_close(model.decode("other", 5, 40), model.decode("again", 5, 40), 1e-5)
    model.reset()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_verifies_as_decode_rows_equal_the_forward(zoo, family):
    """The CUDA route of `verify_batch` (a decode step with a row per token), here eager:
    each sequence's rows give the forward's logits and leave the cache the forward leaves."""
    from ferrum_mac.llm import ForwardItem

    model = torch_model(zoo, family)
    model.reset()
    prompts, guesses = [random_tokens(30, seed=1), random_tokens(3, seed=2)], [random_tokens(5, seed=3), [9, 4]]
    for route, rows in (("rows", 64), ("forward", 0)):
        model.verify_rows = rows
        for i, prompt in enumerate(prompts):
            model.prefill(f"{route}{i}", prompt)
        items = [ForwardItem(f"{route}{i}", g, len(p)) for i, (p, g) in enumerate(zip(prompts, guesses))]
        if route == "rows":
            got = model.verify_batch(items)
        else:
            want = model.verify_batch(items)
    for i, (p, g) in enumerate(zip(prompts, guesses)):
        assert_close(got[i], want[i], 1e-5)
        assert_close(
            model.decode(f"rows{i}", 6, len(p) + len(g)), model.decode(f"forward{i}", 6, len(p) + len(g)), 1e-5
        )
    model.verify_rows = 0
    model.reset()
