"""The torch backend against transformers (torch CPU, fp32) on tiny random models of every
family, on stories260K's real weights, and against the MLX backend on quantized checkpoints
(which the torch backend dequantizes at load).

In fp32 both sides compute the same function and differ only in summation order (~1e-6 of
the logits' range); 1e-4 still catches any real slip (a wrong rope, a missing bias or norm
moves the logits by 1e-2 or more).
"""

from __future__ import annotations

import pytest
import torch

import ferrum_mac
import helpers
from helpers import FAMILIES, assert_close, assert_same_tokens, ferrum_greedy, hf_greedy, hf_logits, random_tokens

FP32_REL = 1e-4
PROMPT = random_tokens(40, seed=11)


def open_torch(path, dtype="float32"):
    return ferrum_mac.open_model(path, backend="torch", dtype=dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_match_transformers(zoo, family):
    model, reference = zoo.ferrum(family, "torch"), zoo.hf(family)
    got = model.forward_verify(f"parity-{family}", PROMPT)
    assert got.shape == (len(PROMPT), model.config.vocab_size) and got.dtype == torch.float32
    assert_close(got, hf_logits(reference, PROMPT), FP32_REL)
    got = ferrum_greedy(model, f"greedy-{family}", PROMPT[:8], 32)
    assert_same_tokens(got, hf_greedy(reference, PROMPT[:8], 32))
    model.release(f"parity-{family}")
    model.release(f"greedy-{family}")


# bf16, the GPU's dtype, against transformers computing in bf16 on the same bf16 checkpoint:
# both round every op at 2^-9, in slightly different places (fused matmuls, the residual
# added inside the GEMM), measured at 1.2-1.6e-2 of the logits' range over two layers
# (each side is 2-9e-2 away from the fp32 model).
BF16_REL = 4e-2


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_bfloat16_compute_matches_transformers_in_bfloat16(zoo, family):
    from transformers import AutoModelForCausalLM

    folder = zoo.path(family, dtype="bfloat16")
    model = open_torch(folder, dtype=None)
    assert model.config.dtype == "bfloat16"
    got = model.forward_verify("x", PROMPT)
    assert got.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    assert_close(got, hf_logits(reference, PROMPT), BF16_REL, "bf16 logits")


# -- Qwen3-MoE: checkpoint layouts and expert routes -------------------------------------


def test_moe_reads_transformers_5_fused_experts(zoo, tmp_path):
    """transformers 5 keeps experts fused in memory (`experts.gate_up_proj`, gate first);
    saved as-is they load without a copy and compute what the per-expert checkpoint does."""
    import shutil

    from safetensors.torch import save_file

    reference = zoo.hf("qwen3_moe")
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(zoo.path("qwen3_moe") / "config.json", tmp_path / "config.json")
    assert_close(open_torch(tmp_path).forward_verify("f", PROMPT), hf_logits(reference, PROMPT), FP32_REL)


@pytest.mark.parametrize("route", ["grouped", "gathered", "dense"])
def test_moe_routes_agree(zoo, monkeypatch, route):
    from ferrum_mac.backends.torch.models import qwen3_moe

    model = zoo.ferrum("qwen3_moe", "torch")
    want = hf_logits(zoo.hf("qwen3_moe"), PROMPT)
    for layer in model.model.layers:  # (as FERRUM_TORCH_MOE_ROUTE forces it at load)
        if isinstance(layer.mlp, qwen3_moe.SparseMoe):
            monkeypatch.setattr(layer.mlp.experts, "forced_route", route)
    assert_close(model.forward_verify(f"route-{route}", PROMPT), want, FP32_REL, f"{route} prefill")
    assert_same_tokens(ferrum_greedy(model, f"g-{route}", PROMPT[:5], 8), hf_greedy(zoo.hf("qwen3_moe"), PROMPT[:5], 8))
    model.release(f"route-{route}")
    model.release(f"g-{route}")


def test_missing_expert_is_a_corrupt_model(zoo):
    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.errors import CorruptModelError
    from ferrum_mac.weights import load_checkpoint

    checkpoint = load_checkpoint(zoo.path("qwen3_moe"))
    del checkpoint.tensors["layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(CorruptModelError, match="experts.5.up_proj"):
        TorchLLM(checkpoint)


# -- quantized checkpoints, dequantized at load: against the MLX backend on the same file ----


@pytest.fixture(scope="module")
def mlx_lm_converted(tmp_path_factory):
    pytest.importorskip("mlx_lm")
    from mlx_lm import convert
    from test_mlx_quantized import VARIANTS, build_hf_folder

    root = tmp_path_factory.mktemp("torch-mlx-quantized")
    folders = {}
    for name in ("qwen3-mixed-fp16", "llama_tied-q8g64-fp32"):
        v = VARIANTS[name]
        build_hf_folder(v, root / f"{name}-hf")
        folders[name] = root / name
        convert(
            str(root / f"{name}-hf"),
            str(folders[name]),
            quantize=True,
            q_group_size=v.group_size,
            q_bits=v.bits,
            dtype=v.dtype,
            quant_predicate=v.predicate,
        )
    return folders


@pytest.mark.parametrize("name", ["qwen3-mixed-fp16", "llama_tied-q8g64-fp32"])
def test_mlx_quantized_checkpoint_matches_the_mlx_backend(mlx_lm_converted, name):
    folder = mlx_lm_converted[name]
    want = ferrum_mac.open_model(folder, backend="mlx", dtype="float32").forward_verify("q", PROMPT)
    assert_close(open_torch(folder).forward_verify("q", PROMPT), want, 1e-5)


GGUF_TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "F16",
    "ffn_gate": "Q8_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
    "token_embd": "Q8_0",
}


def test_gguf_matches_the_mlx_backend(zoo, tmp_path):
    """Llama GGUF: quantized types, and q/k rows permuted for llama.cpp's interleaved rope."""
    pytest.importorskip("mlx.core")
    path = helpers.write_gguf_from_hf(zoo.hf("llama_tied"), "llama_tied", tmp_path / "tiny.gguf", GGUF_TYPES)
    model = open_torch(path)
    assert model.model_config.rope_traditional
    want = ferrum_mac.open_model(path, backend="mlx", dtype="float32").forward_verify("g", PROMPT)
    assert_close(model.forward_verify("g", PROMPT), want, 1e-5)


def test_llama3_rope_gguf_uses_its_rope_freqs(zoo, tmp_path):
    pytest.importorskip("mlx.core")
    path = helpers.write_gguf_from_hf(zoo.hf("llama3_rope"), "llama", tmp_path / "llama3.gguf", {})
    assert_close(open_torch(path).forward_verify("x", PROMPT), hf_logits(zoo.hf("llama3_rope"), PROMPT), FP32_REL)


@pytest.mark.parametrize("variant", ["linear_rope", "yarn_rope", "yarn_untruncated"])
def test_rope_schedules_match_transformers(tmp_path, variant):
    reference = helpers.llama_variant(variant, tmp_path)
    assert_close(open_torch(tmp_path).forward_verify("x", PROMPT), hf_logits(reference, PROMPT), FP32_REL)


# -- real weights ---------------------------------------------------------------------------


def test_stories_greedy_from_bos_matches_transformers(shared_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = shared_assets / "stories260K"
    if not (folder / "model.safetensors").is_file():
        pytest.skip("stories260K is not in the shared assets")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = open_torch(folder, dtype=None)
    assert model.config.dtype == "float32" and model.config.bos_token_id == 1
    got = ferrum_greedy(model, "story", [1], 64)
    assert_same_tokens(got, hf_greedy(reference, [1], 64))
    text = AutoTokenizer.from_pretrained(folder).decode(got)
    assert text.startswith("Once upon a time"), text  # a trained model, not noise
