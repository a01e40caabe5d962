"""MLX affine-quantized checkpoints made by mlx-lm's own converter: ferrum against mlx-lm on
the very same packed weights.

Both sides run MLX's `quantized_matmul` over identical uint32 words, scales and biases, with
activations in the checkpoint's dtype; what may differ is only how ops are grouped (ferrum
fuses q/k/v and gate/up into one matmul, mlx-lm does not). In fp32 that is summation order,
~1e-6 of the logits' range: we allow 1e-5. In bf16/fp16 one regrouped op can round an
activation differently by a unit roundoff (bf16: 2^-9 = 2e-3) and two layers can compound it
a few times, so we allow 2e-2; a wrong group size, bit width, bias or kept-dense layer moves
the logits by tens of percent (4-bit weights at this scale are ~50% off the fp32 model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import ferrum_mac
import helpers
from helpers import assert_close, assert_same_tokens, ferrum_greedy, random_tokens, rel_err, to_np

REL = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}
PROMPT = random_tokens(24, seed=31)


def mixed_predicate(path: str, module) -> bool | dict:
    """Per-layer choices like mlx-lm's mixed recipes: some layers 8-bit, one kept dense."""
    if path.endswith("layers.0.self_attn.q_proj") or path.endswith("lm_head"):
        return {"group_size": 32, "bits": 8}
    if path.endswith("layers.1.self_attn.v_proj"):
        return False
    return True


@dataclass
class Variant:
    family: str
    dtype: str  # the converted checkpoint's dtype (and so the compute dtype)
    group_size: int
    bits: int
    predicate: object = None
    overrides: dict = field(default_factory=dict)  # changes to the tiny config


VARIANTS = {
    # mlx-community's usual layout: bf16 scales, 4-bit, group 64
    "llama3_rope-q4g64-bf16": Variant("llama3_rope", "bfloat16", 64, 4),
    "qwen2-q4g32-fp32": Variant("qwen2", "float32", 32, 4),  # qkv bias stays dense beside packed weights
    "llama_tied-q8g64-fp32": Variant("llama_tied", "float32", 64, 8),  # quantized embedding is also the head
    # 8-bit overrides, a layer kept dense by the predicate, and an MLP width (96) the group
    # size does not divide, which mlx-lm leaves unquantized without saying so in config.json
    "qwen3-mixed-fp16": Variant("qwen3", "float16", 64, 4, mixed_predicate, {"intermediate_size": 96}),
}


def build_hf_folder(variant: Variant, folder: Path) -> None:
    """A tiny random transformers checkpoint in the layout mlx-lm reads."""
    import torch
    from transformers import AutoModelForCausalLM

    config = helpers.FAMILY_FACTORIES[variant.family]()
    for key, value in variant.overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    helpers.write_tiny_tokenizer(folder)
    # mlx-lm 0.32's qwen2 and llama read `rope_theta`/`rope_scaling` only at the top level,
    # as transformers 4 wrote them (and as real checkpoints on the Hub still have them).
    raw = helpers.read_config(folder)
    rope = raw.pop("rope_parameters", {}) or {}
    raw["rope_theta"] = rope.get("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        raw["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    helpers.write_config(folder, raw)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """name -> folder converted by `mlx_lm.convert`, built on first use."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("mlx-quantized")
    built: dict = {}

    def get(name: str) -> Path:
        if name not in built:
            v = VARIANTS[name]
            hf_folder = root / f"{name}-hf"
            build_hf_folder(v, hf_folder)
            out = root / name
            convert(
                str(hf_folder),
                str(out),
                quantize=True,
                q_group_size=v.group_size,
                q_bits=v.bits,
                dtype=v.dtype,
                quant_predicate=v.predicate,
            )
            built[name] = out
        return built[name]

    return get


def mlx_lm_logits(model, tokens) -> mx.array:
    return model(mx.array([list(tokens)]))[0]


def mlx_lm_greedy(model, prompt, n: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([list(prompt)]), cache=cache)[0, -1]
    out = []
    for step in range(n):
        out.append(int(mx.argmax(logits)))
        if step + 1 < n:
            logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_quantized_checkpoint_matches_mlx_lm(converted, name, monkeypatch):
    from mlx_lm import load

    monkeypatch.setenv("FERRUM_DEQUANTIZE_ON_CPU", "0")  # run the quantized kernels, as on a GPU
    v = VARIANTS[name]
    folder = converted(name)
    peer, _ = load(str(folder))
    model = ferrum_mac.open_model(folder, dtype=None if mx.default_device() != mx.cpu else v.dtype)
    assert model.config.dtype == v.dtype  # the compute dtype follows the scales (CPU: asked for)
    want = mlx_lm_logits(peer, PROMPT)
    got = model.forward_verify("v", PROMPT)
    assert got.dtype == want.dtype
    assert_close(got, want, REL[v.dtype])
    prompt = PROMPT[:6]
    assert_same_tokens(ferrum_greedy(model, "g", prompt, 16), mlx_lm_greedy(peer, prompt, 16))


def test_cpu_loads_quantized_weights_dense_in_float32(converted):
    """MLX's CPU build runs quantized and half-precision matmuls slowly, so there ferrum
    dequantizes at load and computes in float32: same logits as mlx-lm's fp32 reading."""
    from mlx_lm import load

    if mx.default_device() != mx.cpu:
        pytest.skip("the dense-on-CPU policy applies to MLX's CPU device only")
    name = next(n for n, v in VARIANTS.items() if v.dtype == "float32")
    folder = converted(name)
    model = ferrum_mac.open_model(folder)
    assert model.config.dtype == "float32"
    assert not any(block.mlp.down.quantized for block in model.model.layers)
    peer, _ = load(str(folder))
    assert_close(model.forward_verify("d", PROMPT), mlx_lm_logits(peer, PROMPT), REL["float32"])


def test_quantization_is_read_per_layer(converted):
    """The mixed checkpoint's layers really differ, and ferrum reads each as mlx-lm wrote it."""
    from ferrum_mac.weights import load_checkpoint

    ckpt = load_checkpoint(converted("qwen3-mixed-fp16"))
    c, t = ckpt.config, ckpt.tensors
    assert ckpt.format == "mlx-quantized"
    assert c.quant_for("layers.0.self_attn.q_proj") == {"group_size": 32, "bits": 8}
    assert c.quant_for("layers.0.self_attn.k_proj") == {"group_size": 64, "bits": 4}
    assert t["layers.0.self_attn.q_proj.weight"].shape == (128, 64 * 8 // 32)
    assert t["layers.0.self_attn.k_proj.weight"].shape == (64, 64 * 4 // 32)  # 2 kv heads of 32
    # kept dense without a config entry: by the predicate, and for a width of 96 vs group 64
    assert "layers.1.self_attn.v_proj.scales" not in t and t["layers.1.self_attn.v_proj.weight"].dtype == mx.float16
    assert "layers.0.mlp.down_proj.scales" not in t and t["layers.0.mlp.down_proj.weight"].shape == (64, 96)


def test_quantized_is_close_to_the_dense_model_only_loosely(converted, zoo):
    """4-bit weights change the function a lot at this init scale; 8-bit much less. This is what
    makes the tolerances above meaningful: quantization errors are far above them."""
    from mlx_lm import load

    q4 = load(str(converted("qwen2-q4g32-fp32")))[0]
    q8 = load(str(converted("llama_tied-q8g64-fp32")))[0]
    dense_qwen2 = helpers.hf_logits(zoo.hf("qwen2"), PROMPT)
    dense_tied = helpers.hf_logits(zoo.hf("llama_tied"), PROMPT)
    assert rel_err(mlx_lm_logits(q4, PROMPT), dense_qwen2) > 0.05
    assert rel_err(mlx_lm_logits(q8, PROMPT), dense_tied) < 0.1
    assert np.argmax(to_np(mlx_lm_logits(q8, PROMPT))[-1]) == np.argmax(to_np(dense_tied)[-1])


def test_one_row_of_a_4bit_weight_takes_the_one_row_kernel_where_it_fits(monkeypatch):
    """On CUDA one row of a 4-bit weight in a 2-byte float, its K a multiple of 1,024 up to
    16,384 and its groups of 32 values or more, takes the one-row kernel whatever the weight's
    shape; its launch covers every output row. Without it, a large widening weight takes the
    few-row kernel and the rest MLX's vector kernel."""
    from ferrum_mac.backends.mlx.cuda import qmatmul as cuda_qmatmul

    shapes = [(4096, 4096), (4096, 12288), (5120, 2048), (24576, 4096), (151936, 2048), (300, 1024)]
    for out_dim, in_dim in shapes:
        assert cuda_qmatmul.runs(1, out_dim, in_dim, 64, 4, mx.bfloat16)
        assert cuda_qmatmul.one_row_fits(in_dim, 64, 4, mx.float16)
    assert not cuda_qmatmul.one_row_fits(4096, 64, 8, mx.bfloat16)  # 8-bit
    assert not cuda_qmatmul.one_row_fits(4096, 64, 4, mx.float32)
    assert not cuda_qmatmul.one_row_fits(1536, 64, 4, mx.bfloat16)  # K not whole 512-byte reads
    assert not cuda_qmatmul.one_row_fits(32768, 64, 4, mx.bfloat16)  # x past 32 KB of shared memory
    assert not cuda_qmatmul.one_row_fits(4096, 16, 4, mx.bfloat16)  # a group smaller than a lane's read

    launches = []

    def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        launches.append((dict(template), grid[0] // threadgroup[0], threadgroup[0] // 32))
        return [mx.zeros(output_shapes[0], output_dtypes[0])]

    monkeypatch.setattr(cuda_qmatmul, "_one_row_kernel", lambda: kernel)
    for out_dim, in_dim in shapes:
        w, scales, biases = mx.quantize(mx.zeros((out_dim, in_dim)), group_size=64, bits=4)
        for swiglu in (False, True):
            x = mx.zeros((1, 1, in_dim), mx.bfloat16)
            out = cuda_qmatmul.quantized_matmul(x, w, scales, biases, 64, 4, swiglu=swiglu)
            template, blocks, warps = launches[-1]
            assert out.shape == (1, 1, out_dim // 2 if swiglu else out_dim)
            assert (template["K"], template["N"], template["SWIGLU"]) == (in_dim, out_dim, swiglu)
            assert 0 <= blocks * warps * template["R"] - out.shape[-1] < warps * template["R"]

    monkeypatch.setattr(cuda_qmatmul, "ONE_ROW", False)
    assert cuda_qmatmul.runs(1, 24576, 4096, 64, 4) and cuda_qmatmul.runs(1, 151936, 2048, 64, 4)
    assert not cuda_qmatmul.runs(1, 4096, 4096, 64, 4)  # o_proj
    assert not cuda_qmatmul.runs(1, 4096, 12288, 64, 4)  # down
    assert not cuda_qmatmul.runs(1, 5120, 2048, 64, 4)  # Qwen3-30B-A3B's qkv: small
    assert cuda_qmatmul.runs(2, 4096, 4096, 64, 4)  # two rows: always (MLX's tiled kernel is slower)


def test_swiglu_goes_into_the_few_row_kernel(converted, monkeypatch):
    """Where the few-row kernel runs a stacked gate/up weight, it writes the SwiGLU too. With
    the kernel standing in as MLX's ops (`cuda_qmatmul.reference`), a model routed through it
    decodes (one sequence, a batch) exactly as the plain path."""
    from ferrum_mac.backends.mlx.cuda import qmatmul as cuda_qmatmul
    from ferrum_mac.backends.mlx.cuda.ops import CudaLinear
    from ferrum_mac.backends.mlx.ops import Ops
    from ferrum_mac.llm import DecodeItem
    from helpers import open_mlx

    class QmmOnTheCpu(Ops):
        linear_type = CudaLinear  # CUDA's linears, MLX's attention

    def run(tag: str, ops) -> tuple[list[int], np.ndarray]:
        # one matmul for q/k/v and for gate/up, as on a GPU (where the kernel reads the stacked weight)
        model = open_mlx(converted("qwen2-q4g32-fp32"), ops)
        tokens = ferrum_greedy(model, tag, PROMPT[:6], 5)
        for i, prompt in enumerate((PROMPT[:5], PROMPT[3:12])):
            model.prefill(f"{tag}-{i}", prompt)
        batch = model.decode_batch([DecodeItem(f"{tag}-0", 3, 5), DecodeItem(f"{tag}-1", 4, 9)])
        return tokens, np.array(batch)

    want_tokens, want_batch = run("plain", Ops())
    calls = []

    def stand_in(x, *args, swiglu=False, **_):
        calls.append((x.size // x.shape[-1], swiglu))
        return cuda_qmatmul.reference(x, *args, swiglu=swiglu)

    monkeypatch.setattr(cuda_qmatmul, "ONE_ROW_MIN_WEIGHTS", 0)
    monkeypatch.setattr(cuda_qmatmul, "quantized_matmul", stand_in)
    tokens, batch = run("fused", QmmOnTheCpu())
    assert tokens == want_tokens
    np.testing.assert_array_equal(batch, want_batch)
    assert (1, False) in calls and (1, True) in calls  # one token: qkv, gate_up + SwiGLU
    assert (2, True) in calls  # and a batch's rows
