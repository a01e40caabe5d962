"""Phi-3/Phi-4 (fused projections, partial RoPE, LongRoPE) and SmolLM3 (NoPE layers) on both
backends against transformers' Phi3ForCausalLM and SmolLM3ForCausalLM (fp32, tiny random
configs): a prefill in several chunks, a decode step, `decode_batch` of mixed lengths and 64
greedy tokens; the prefix cache and speculation leave greedy output as it was; and the
checkpoints these models come in (MLX 4-bit conversions, GGUF) load to the same model.

The LongRoPE model's pretraining length is 48 of its 256 positions: opened for all 256 it
uses the long factors, as transformers does for any sequence past 48 (every prompt here);
opened for 48 it uses the short ones, as transformers does within them.
"""

from __future__ import annotations

import pytest
import torch

import ferrum_mac
import helpers
from ferrum_mac.llm import DecodeItem
from helpers import (
    BACKENDS,
    assert_close,
    assert_same_tokens,
    ferrum_greedy,
    hf_greedy,
    hf_logits,
    random_tokens,
    rel_err,
    to_np,
)
from prefix_support import greedy

FP32_REL = 1e-4
ORIGINAL = 48  # the LongRoPE model's pretraining length
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    # one factor per rotated pair (12 of 16 dims turn: 6); the long ones stretch the slow dims
    "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4],
    "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0],
}
PROMPT = random_tokens(80, seed=21)  # past ORIGINAL, in five chunks of 16
CHUNK = 16


def phi3_longrope():
    return helpers._phi3(
        rope_scaling=dict(LONGROPE), original_max_position_embeddings=ORIGINAL, max_position_embeddings=256
    )


MODELS = {
    "phi3": lambda: helpers.FAMILY_FACTORIES["phi3"](),
    "phi3_longrope": phi3_longrope,
    "smollm3": lambda: helpers.FAMILY_FACTORIES["smollm3"](),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, its save_pretrained folder), built on first use."""
    from transformers import AutoModelForCausalLM

    built = {}

    def get(name: str):
        if name not in built:
            torch.manual_seed(0)
            reference = AutoModelForCausalLM.from_config(MODELS[name](), dtype=torch.float32).eval()
            folder = tmp_path_factory.mktemp(name)
            reference.save_pretrained(folder)
            built[name] = reference, folder
        return built[name]

    return get


def opened(folder, backend: str, **kwargs):
    model = ferrum_mac.open_model(folder, backend=backend, dtype="float32", **kwargs)
    model.prefill_chunk = CHUNK
    return model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_chunked_prefill_decode_and_greedy_match_transformers(checkpoints, name, backend):
    reference, folder = checkpoints(name)
    model = opened(folder, backend)
    want = hf_logits(reference, PROMPT + [7])
    assert_close(model.forward_verify("all", PROMPT), want[:-1], FP32_REL, "every position's logits")
    assert_close(model.prefill("x", PROMPT), want[-2], FP32_REL, "a prefill in chunks")
    assert_close(model.decode("x", 7, len(PROMPT)), want[-1], FP32_REL, "a decode step")
    assert_same_tokens(ferrum_greedy(model, "g", PROMPT, 64), hf_greedy(reference, PROMPT, 64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_decode_batch_of_mixed_lengths_matches_transformers(checkpoints, name, backend):
    reference, folder = checkpoints(name)
    model = opened(folder, backend)
    prompts = {"long": PROMPT, "mid": PROMPT[5:62], "short": PROMPT[20:70]}
    for cache_id, prompt in prompts.items():
        model.prefill(cache_id, prompt)
    got = model.decode_batch([DecodeItem(cache_id, 9, len(prompt)) for cache_id, prompt in prompts.items()])
    for row, prompt in zip(got, prompts.values()):
        assert_close(row, hf_logits(reference, prompt + [9])[-1], FP32_REL, "a decode_batch row")


@pytest.mark.parametrize("name", list(MODELS))
def test_mlx_metal_path_matches_transformers(checkpoints, name):
    """MLX's own ops, as on a Mac's GPU (here on the CPU): q/k/v and gate/up fused again into
    one matmul each, MLX's attention for every segment, a batch decoded together."""
    from ferrum_mac.backends.mlx.ops import Ops

    reference, folder = checkpoints(name)
    model = helpers.open_mlx(folder, Ops())
    assert model.model.layers[0].attn.qkv.fused is not None
    assert_close(model.forward_verify("all", PROMPT), hf_logits(reference, PROMPT), FP32_REL)
    prompts = {"long": PROMPT, "short": PROMPT[30:79]}
    for cache_id, prompt in prompts.items():
        model.prefill(cache_id, prompt)
    got = model.decode_batch([DecodeItem(cache_id, 9, len(prompt)) for cache_id, prompt in prompts.items()])
    for row, prompt in zip(got, prompts.values()):
        assert_close(row, hf_logits(reference, prompt + [9])[-1], FP32_REL, "a decode_batch row")


@pytest.mark.parametrize("backend", BACKENDS)
def test_longrope_within_the_pretraining_length_uses_the_short_factors(checkpoints, backend):
    reference, folder = checkpoints("phi3_longrope")
    model = opened(folder, backend, kv_capacity=ORIGINAL)
    prompt = PROMPT[:30]
    want = hf_logits(reference, prompt)
    assert_close(model.forward_verify("short", prompt), want, FP32_REL)
    assert_same_tokens(
        ferrum_greedy(model, "g", prompt, ORIGINAL - len(prompt)), hf_greedy(reference, prompt, ORIGINAL - len(prompt))
    )
    # the long factors really are another function of the same prompt
    assert rel_err(opened(folder, backend).forward_verify("long", prompt), want) > 0.05


def test_each_feature_moves_the_reference(checkpoints):
    """Partial rotary, LongRoPE and NoPE each change transformers' logits a lot, so parity proves them."""
    from transformers import AutoModelForCausalLM

    def logits(config):
        torch.manual_seed(0)
        return hf_logits(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), PROMPT)

    phi3, longrope, smollm3 = (hf_logits(checkpoints(n)[0], PROMPT) for n in ("phi3", "phi3_longrope", "smollm3"))
    assert rel_err(logits(helpers._phi3(partial_rotary_factor=1.0)), phi3) > 0.05
    assert rel_err(longrope, phi3) > 0.05
    everywhere = helpers.FAMILY_FACTORIES["smollm3"]()
    everywhere.no_rope_layers = [1, 1]
    assert rel_err(logits(everywhere), smollm3) > 0.05


# -- the prefix cache and speculation: greedy output as without them -------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_prefix_cache_and_speculation_keep_greedy_output(checkpoints, name, backend):
    from ferrum_mac.engine.sampling import SamplingParams
    from ferrum_mac.engine.speculation.controller import MAX_K
    from ferrum_mac.engine.speculation.step_times import StepTimes
    from ferrum_mac.engine.speculation import Speculate
    from ferrum_mac.engine.speculation.verify import Speculator, speculative_tokens

    _, folder = checkpoints(name)
    model = opened(folder, backend)
    turn1 = PROMPT[:60]
    answer1, _ = greedy(model, "turn1", turn1, 8, reuse=True)
    turn2 = turn1 + answer1 + PROMPT[60:]
    cold, _ = greedy(model, "cold", turn2, 16, reuse=False)
    warm, found = greedy(model, "warm", turn2, 16, reuse=True)
    assert found >= len(turn1) - 1 and warm == cold

    # a prompt that repeats itself, so prompt lookup has guesses to verify
    prompt = PROMPT[:20] * 3 + PROMPT[:10]
    plain = ferrum_greedy(model, "plain", prompt, 40)
    times = StepTimes()
    times.use([1.0] * (MAX_K + 1))  # a verify as cheap as a step: always guess
    sampler = model.sampler(SamplingParams(temperature=0.0))
    speculator = Speculator.for_answer(model, Speculate("ngram"), "spec", times)
    tokens = speculative_tokens(model, sampler, "spec", model.prefill("spec", prompt), 40, speculator, prompt)
    assert list(tokens) == plain
    assert speculator.stats.steps > 0  # it did verify guesses


# -- checkpoint formats -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["phi3", "smollm3"])
def test_mlx_4bit_conversion_matches_mlx_lm(checkpoints, tmp_path, name):
    """mlx-lm's own conversion (Phi-3 keeps qkv_proj and gate_up_proj fused, packed) loads on
    both backends and computes what mlx-lm's model computes from it."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm import convert, load

    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(checkpoints(name)[1], folder)
    helpers.write_tiny_tokenizer(folder)
    raw = helpers.read_config(folder)  # mlx-lm reads rope_theta at the top, where released checkpoints keep it
    helpers.write_config(folder, {**raw, "rope_theta": raw["rope_parameters"]["rope_theta"]})
    out = tmp_path / "q4"
    convert(str(folder), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    mlx_lm_model, _ = load(str(out))
    want = to_np(mlx_lm_model(mx.array([PROMPT]))[0])
    model = ferrum_mac.open_model(out, backend="mlx", dtype="float32")
    assert model.model_config.quantization
    assert_close(model.forward_verify("q", PROMPT), want, FP32_REL, "against mlx-lm")
    assert_close(
        ferrum_mac.open_model(out, backend="torch", dtype="float32").forward_verify("q", PROMPT),
        want,
        FP32_REL,
        "torch",
    )
    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.backends.torch.weights import load_onto

    kept = TorchLLM(load_onto(out, torch.device("cpu")), dtype="float32", packed=True)  # as on CUDA
    assert kept.model.layers[0].attn.qkv.quantized
    assert_close(kept.forward_verify("q", PROMPT), want, FP32_REL, "torch, weights kept packed")


GGUF_TYPES = {
    "attn_qkv": "Q8_0",
    "attn_q": "Q8_0",
    "attn_k": "Q4_1",
    "attn_v": "Q4_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
}


@pytest.mark.parametrize("name", ["phi3", "phi3_longrope", "smollm3"])
def test_gguf_as_llama_cpp_writes_it(checkpoints, tmp_path, name):
    """llama.cpp's names and layout (Phi-3: `attn_qkv`, gate and up in `ffn_up`, the rotated
    dims and LongRoPE's factors as tensors; SmolLM3: permuted q/k, NoPE every fourth layer):
    in F32 the file computes what transformers does; quantized, both backends agree."""
    from transformers import AutoModelForCausalLM

    reference = checkpoints(name)[0]
    if name == "smollm3":  # llama.cpp knows only SmolLM3-3B's pattern, every fourth layer
        torch.manual_seed(0)
        config = helpers.FAMILY_FACTORIES["smollm3"]()
        config.num_hidden_layers, config.no_rope_layers = 4, [1, 1, 1, 0]
        config.layer_types = ["full_attention"] * 4
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    family = "smollm3" if name == "smollm3" else "phi3"
    exact = helpers.write_gguf_from_hf(reference, family, tmp_path / "f32.gguf", {})
    packed = helpers.write_gguf_from_hf(reference, family, tmp_path / "q.gguf", GGUF_TYPES)
    want = hf_logits(reference, PROMPT)
    for backend in BACKENDS:
        model = ferrum_mac.open_model(exact, backend=backend, dtype="float32")
        assert_close(model.forward_verify("x", PROMPT), want, FP32_REL, f"{backend} F32 GGUF")
    quantized = [
        ferrum_mac.open_model(packed, backend=b, dtype="float32").forward_verify("q", PROMPT) for b in BACKENDS
    ]
    assert rel_err(quantized[0], want) > 1e-3  # really quantized
    if len(quantized) == 2:
        assert_close(quantized[1], quantized[0], 1e-5, "torch against MLX")
        # torch keeping the weights packed (as on CUDA): q/k rows reordered in their packed words
        from ferrum_mac.backends.torch.runtime import TorchLLM
        from ferrum_mac.backends.torch.weights import load_onto

        kept = TorchLLM(load_onto(packed, torch.device("cpu")), dtype="float32", packed=True)
        assert_close(kept.forward_verify("q", PROMPT), quantized[0], 1e-5, "torch packed against MLX")


def test_the_prefix_disk_tier_keeps_each_longrope_factor_list_apart(checkpoints, tmp_path):
    """Keys computed with the short factors must never come back from disk for a model opened
    with the long ones (nor the reverse): the disk tier's folder differs."""
    from ferrum_mac.backends.mlx.runtime import MlxLLM
    from ferrum_mac.backends.options import BackendOptions
    from ferrum_mac.weights import load_checkpoint

    folder = checkpoints("phi3_longrope")[1]
    options = BackendOptions(prefix_dir=tmp_path / "prefix", prefix_disk_mb=64)

    def disk_folder(capacity: int):
        model = MlxLLM(load_checkpoint(folder), dtype="float32", kv_capacity=capacity, options=options)
        return model.kv.prefix.disk.folder

    assert disk_folder(ORIGINAL) != disk_folder(256)
    assert disk_folder(ORIGINAL) == disk_folder(ORIGINAL // 2)


def test_a_longrope_gguf_without_its_short_factors_is_corrupt(checkpoints, tmp_path, monkeypatch):
    import gguf

    from ferrum_mac.errors import CorruptModelError

    add_tensor = gguf.GGUFWriter.add_tensor

    def all_but_the_short_factors(self, name, *args, **kwargs):
        if name != "rope_factors_short.weight":
            add_tensor(self, name, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", all_but_the_short_factors)
    path = helpers.write_gguf_from_hf(checkpoints("phi3_longrope")[0], "phi3", tmp_path / "no-short.gguf", {})
    with pytest.raises(CorruptModelError, match="rope_factors_short"):
        ferrum_mac.open_model(path, dtype="float32")
