"""ferrum (MLX, fp32) against transformers (torch CPU, fp32) on tiny random models of every family.

Both sides compute the same function in fp32; what differs is summation order, so the
logits agree to ~1e-6 of their range. 1e-4 leaves room for that and still catches any
real slip (a wrong rope, a missing bias or norm moves them by 1e-2 or more).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import ferrum_mac
import mlx.core as mx
from helpers import (
    FAMILIES,
    LLAMA_VARIANTS,
    assert_close,
    assert_same_tokens,
    ferrum_greedy,
    hf_greedy,
    hf_logits,
    installed_backends,
    llama_variant,
    random_tokens,
    read_config,
    rel_err,
    to_np,
)

FP32_REL = 1e-4
PROMPT = random_tokens(40, seed=11)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers(zoo, family):
    model = zoo.ferrum(family)
    want = hf_logits(zoo.hf(family), PROMPT)
    got = model.forward_verify(f"parity-{family}", PROMPT)
    assert got.shape == (len(PROMPT), model.config.vocab_size)
    assert_close(got, want, FP32_REL)
    # prefill returns the last position's row of the same computation
    last = model.prefill(f"parity-last-{family}", PROMPT)
    assert_close(last, want[-1], FP32_REL, "prefill's last logits")
    model.release(f"parity-{family}")
    model.release(f"parity-last-{family}")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(zoo, family):
    prompt = PROMPT[:8]
    want = hf_greedy(zoo.hf(family), prompt, 32)
    got = ferrum_greedy(zoo.ferrum(family), f"greedy-{family}", prompt, 32)
    zoo.ferrum(family).release(f"greedy-{family}")
    assert_same_tokens(got, want)


def test_config_reports_the_checkpoint(zoo):
    model = zoo.ferrum("qwen3")
    c = model.config
    assert (c.model_type, c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size) == ("qwen3", 2, 2, 32, 320)
    assert c.dtype == "float32"
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1


def test_rope_scaling_changes_the_reference(zoo):
    """The llama3-rope model shares the plain llama's weights (same seed), so its parity test
    only proves the Llama-3 schedule if that schedule moves the logits a lot."""
    plain = hf_logits(zoo.hf("llama"), PROMPT)
    scaled = hf_logits(zoo.hf("llama3_rope"), PROMPT)
    assert rel_err(scaled, plain) > 0.05
    assert read_config(zoo.path("llama3_rope")).get("rope_parameters", {}).get("rope_type") == "llama3"


def test_tied_checkpoint_has_no_lm_head(zoo):
    from safetensors import safe_open

    folder = zoo.path("llama_tied")
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_sharded_checkpoint_loads_identically(zoo):
    folder = zoo.path("qwen3", shards=True)
    shards = sorted(folder.glob("*.safetensors"))
    assert (folder / "model.safetensors.index.json").is_file() and len(shards) > 1
    sharded = ferrum_mac.open_model(folder, dtype="float32")
    got = sharded.forward_verify("s", PROMPT)
    want = zoo.ferrum("qwen3").forward_verify("unsharded", PROMPT)
    zoo.ferrum("qwen3").release("unsharded")
    np.testing.assert_array_equal(to_np(got), to_np(want))


# Half-precision checkpoints. Loaded with dtype="float32" the weights are upcast exactly,
# so ferrum must match a transformers model holding the same rounded weights to fp32
# precision. Computed in their own dtype, each rounding of a matmul input or output
# costs up to the unit roundoff u (fp16: 2^-12 = 2.4e-4; bf16: 2^-9 = 2.0e-3), and two
# layers of attention, MLP, norms and residuals compound that: measured against the
# fp32 model it is 15-25 u (fp16 ~4e-3, bf16 2-5e-2 across these families). The bounds
# are ~40 u, still well below what a slip such as a missing norm or a wrong rope does
# (tens of percent).
HALF_REL = {"float16": 1e-2, "bfloat16": 8e-2}


def rounded_copy(model, dtype):
    """`model` with its parameters rounded to `dtype` and kept in fp32. (Not `.to(dtype)`:
    that would also round the rotary `inv_freq` buffer, which a checkpoint never stores.)"""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_half_precision_checkpoint(zoo, family, dtype):
    folder = zoo.path(family, dtype=dtype)
    assert read_config(folder)["dtype"] == dtype
    rounded = rounded_copy(zoo.hf(family), getattr(torch, dtype))
    exact = ferrum_mac.open_model(folder, dtype="float32")
    assert_close(exact.forward_verify("x", PROMPT), hf_logits(rounded, PROMPT), FP32_REL, f"{dtype} weights in fp32")

    default = ferrum_mac.open_model(folder).config.dtype
    assert default == ("float32" if mx.default_device() == mx.cpu else dtype)  # MLX's CPU build: fp32 is fast
    native = ferrum_mac.open_model(folder, dtype=dtype)
    assert native.config.dtype == dtype
    got = native.forward_verify("x", PROMPT)
    assert str(got.dtype).endswith(dtype)
    assert_close(got, hf_logits(zoo.hf(family), PROMPT), HALF_REL[dtype], f"{dtype} compute against the fp32 model")


def test_legacy_config_layout(zoo, tmp_path):
    """Most Hub checkpoints carry transformers-4 keys: `rope_theta`/`rope_scaling` at the top
    level and `torch_dtype`. Same weights, same numbers."""
    import shutil

    from helpers import write_config

    folder = tmp_path / "legacy"
    shutil.copytree(zoo.path("llama3_rope"), folder)
    raw = read_config(folder)
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope  # {"rope_type": "llama3", "factor": ...}
    raw["torch_dtype"] = raw.pop("dtype")
    write_config(folder, raw)
    model = ferrum_mac.open_model(folder)
    assert model.config.dtype == "float32"
    assert_close(model.forward_verify("x", PROMPT), hf_logits(zoo.hf("llama3_rope"), PROMPT), FP32_REL)


@pytest.mark.parametrize("backend", installed_backends())
@pytest.mark.parametrize("family", ["mistral", "qwen2", "phi3"])
def test_sliding_window_models_attend_within_the_window(zoo, tmp_path, family, backend):
    """Mistral's and Phi-3's window (every layer) and Qwen2's (layers from max_window_layers on) are the
    sliding-window layers of Gemma 3's path: past the window ferrum agrees with transformers,
    in a forward and in decode steps."""
    from transformers import AutoModelForCausalLM

    from ferrum_mac.sequence_state import SlidingWindow
    from helpers import FAMILY_FACTORIES

    config = FAMILY_FACTORIES[family]()
    config.sliding_window = 16
    if family == "qwen2":
        config.use_sliding_window, config.max_window_layers = True, 1  # layer 1 slides
        config.layer_types = ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.save_pretrained(tmp_path)
    model = ferrum_mac.open_model(tmp_path, backend=backend, dtype="float32")
    assert model.kv_capacity() > 16
    slides = [isinstance(kind, SlidingWindow) for kind in model.config.layer_kinds]
    assert slides == ([True, True] if family in ("mistral", "phi3") else [False, True])
    assert_close(model.forward_verify("x", PROMPT), hf_logits(reference, PROMPT), FP32_REL)
    assert_same_tokens(ferrum_greedy(model, "g", PROMPT[:20], 24), hf_greedy(reference, PROMPT[:20], 24))
    # the family's zoo model has the same weights (same seed) and no window: the window
    # leaves the first 16 positions alone and really changes transformers' answer past them
    full = hf_logits(zoo.hf(family), PROMPT)
    windowed = hf_logits(reference, PROMPT)
    assert rel_err(windowed[:16], full[:16]) < FP32_REL
    assert rel_err(windowed[16:], full[16:]) > 0.05


# GGUF files written from the tiny models the way llama.cpp writes them (llama q/k rows
# permuted for its interleaved rope), each weight in a different ggml type, read back by
# transformers' own GGUF loader (which dequantizes to fp32 and un-permutes) as the reference.
# ferrum runs fp32 activations over the very same dequantized values: fp32 tolerance.
GGUF_TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "F16",
    "ffn_gate": "Q8_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
    "token_embd": "Q8_0",
    "output": "Q8_0",
}


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_gguf_matches_transformers_gguf_loader(zoo, tmp_path, family):
    from transformers import AutoModelForCausalLM

    from helpers import write_gguf_from_hf

    source = zoo.hf(family)
    path = write_gguf_from_hf(source, family, tmp_path / f"{family}.gguf", GGUF_TYPES)
    # transformers' GGUF loader leaves head_dim at its config default (128 for Qwen3) instead
    # of reading qwen3.attention.key_length; tell it. ferrum reads the key.
    extra = {"head_dim": source.config.head_dim} if family == "qwen3" else {}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32, **extra).eval()
    model = ferrum_mac.open_model(path, dtype="float32")
    assert model.config.head_dim == getattr(source.config, "head_dim", 16)
    assert model.model_config.rope_traditional == family.startswith("llama")
    assert_close(model.forward_verify("x", PROMPT), hf_logits(reference, PROMPT), FP32_REL)
    assert_same_tokens(ferrum_greedy(model, "g", PROMPT[:5], 16), hf_greedy(reference, PROMPT[:5], 16))
    # the quantization is real: the file's model is not the fp32 one
    assert rel_err(hf_logits(reference, PROMPT), hf_logits(source, PROMPT)) > 0.05


def test_llama3_rope_gguf_uses_its_rope_freqs(zoo, tmp_path):
    """Llama 3.1/3.2 GGUF files carry the Llama-3 rope schedule only as a `rope_freqs.weight`
    tensor of per-frequency divisors. Written in F32 beside the llama3_rope model's weights,
    the file must compute what transformers computes from the safetensors checkpoint."""
    from helpers import write_gguf_from_hf

    path = write_gguf_from_hf(zoo.hf("llama3_rope"), "llama", tmp_path / "llama3.gguf", {})
    model = ferrum_mac.open_model(path, dtype="float32")
    assert_close(model.forward_verify("x", PROMPT), hf_logits(zoo.hf("llama3_rope"), PROMPT), FP32_REL)


@pytest.mark.parametrize("variant", list(LLAMA_VARIANTS))
def test_llama_config_variants_match_transformers(tmp_path, variant):
    reference = llama_variant(variant, tmp_path)
    model = ferrum_mac.open_model(tmp_path, dtype="float32")
    assert_close(model.forward_verify("x", PROMPT), hf_logits(reference, PROMPT), FP32_REL)


def test_yarn_changes_the_reference(zoo, tmp_path):
    plain = hf_logits(zoo.hf("llama"), PROMPT)
    for variant in ("yarn_rope", "yarn_untruncated"):
        assert rel_err(hf_logits(llama_variant(variant, tmp_path / variant), PROMPT), plain) > 0.05
