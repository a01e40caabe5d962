"""Qwen3-MoE on MLX: parity with transformers' `Qwen3MoeForCausalLM` (fp32), checkpoint
layouts, the sorted and unsorted expert routes, batched decode, and the 4-bit path
against mlx-lm's `qwen3_moe` on the very same quantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import helpers
from helpers import assert_close, assert_same_tokens, random_tokens

pytest.importorskip("transformers")

MOE_TINY = dict(
    helpers.TINY,
    head_dim=16,
    intermediate_size=96,  # the dense layers'
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
)
CONFIGS = {
    # a dense layer between sparse ones; top-k weights used as the softmax gave them
    "mlp_only": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False),
    # every second layer sparse (layers 1 and 3); top-k weights renormalised
    "sparse_step_2": dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=True),
}
LAYOUTS = ("per_expert", "fused")
LONG, SHORT = 40, 9  # 80 token-expert pairs take the sorted route, 18 the unsorted one


def build_hf(name: str):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**MOE_TINY, **CONFIGS[name]})).eval()


def save_fused(model, folder: Path, per_expert: Path) -> None:
    """transformers 5's in-memory layout (`experts.gate_up_proj`, `experts.down_proj`), as-is."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    shutil.copy(per_expert / "config.json", folder / "config.json")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """name -> (transformers model, {layout: checkpoint folder})."""
    root = tmp_path_factory.mktemp("qwen3-moe")
    built = {}
    for name in CONFIGS:
        model = build_hf(name)
        per_expert = helpers.save_hf_model(model, root / f"{name}-per_expert")
        save_fused(model, root / f"{name}-fused", per_expert)
        built[name] = (model, {"per_expert": per_expert, "fused": root / f"{name}-fused"})
    return built


def open_fp32(path: Path):
    import ferrum_mac

    return ferrum_mac.open_model(path, dtype="float32")


def test_transformers_saves_per_expert_tensors(moe):
    """The layouts under test are what they claim to be."""
    _, paths = moe["mlp_only"]
    per_expert = mx.load(str(paths["per_expert"] / "model.safetensors"))
    fused = mx.load(str(paths["fused"] / "model.safetensors"))
    assert per_expert["model.layers.0.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert fused["model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 32)
    assert "model.layers.1.mlp.gate_proj.weight" in per_expert  # the mlp_only layer is dense


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logits_match_transformers(moe, name, layout):
    hf, paths = moe[name]
    model = open_fp32(paths[layout])
    for n in (LONG, SHORT):
        tokens = random_tokens(n, seed=n)
        assert_close(model.forward_verify(f"p{n}", tokens), helpers.hf_logits(hf, tokens), 1e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(moe, name):
    hf, paths = moe[name]
    prompt = random_tokens(12, seed=3)
    got = helpers.ferrum_greedy(open_fp32(paths["per_expert"]), "g", prompt, 32)
    assert_same_tokens(got, helpers.hf_greedy(hf, prompt, 32))


def test_half_precision_experts(moe):
    """fp16 compute (MLX's CPU gather_mm takes float32 only; dense experts fall back to it there).
    fp16 rounds at 2^-11 per op; over 3 layers that is ~3e-3 of the logit range, as in
    transformers' own fp16 run, so 1e-2 leaves room without hiding a wrong expert."""
    import ferrum_mac

    hf, paths = moe["mlp_only"]
    model = ferrum_mac.open_model(paths["per_expert"], dtype="float16")
    tokens = random_tokens(LONG, seed=LONG)
    logits = model.forward_verify("h", tokens)
    assert logits.dtype == mx.float16
    assert_close(logits, helpers.hf_logits(hf, tokens), 1e-2)


def test_sorted_and_unsorted_routes_agree(moe, monkeypatch):
    from ferrum_mac.backends.mlx.models import qwen3_moe

    model = open_fp32(moe["mlp_only"][1]["per_expert"])
    tokens = random_tokens(LONG, seed=5)
    monkeypatch.setattr(qwen3_moe, "SORT_MIN_PAIRS", 10**9)
    unsorted = model.forward_verify("u", tokens)
    monkeypatch.setattr(qwen3_moe, "SORT_MIN_PAIRS", 1)
    assert_close(model.forward_verify("s", tokens), unsorted, 1e-5)


@pytest.mark.parametrize("tokens", [1, LONG], ids=["decode", "prefill"])
def test_routing_needs_no_host_sync(moe, tokens):
    """mx.compile traces without evaluating: any .item()/tolist() in the MoE block would raise."""
    from ferrum_mac.backends.mlx.models.qwen3_moe import SparseMoe

    model = open_fp32(moe["mlp_only"][1]["per_expert"])
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoe)
    x = mx.random.normal((1, tokens, 64), key=mx.random.key(0))
    assert_close(mx.compile(block.__call__)(x), block(x), 1e-5, "compiled MoE block")


@pytest.mark.parametrize("sort_from", [1, 10**9], ids=["sorted", "unsorted"])
def test_decode_batch_equals_sequential_decodes(moe, monkeypatch, sort_from):
    from ferrum_mac import DecodeItem
    from ferrum_mac.backends.mlx.models import qwen3_moe

    monkeypatch.setattr(qwen3_moe, "SORT_MIN_PAIRS", sort_from)
    model = open_fp32(moe["sparse_step_2"][1]["per_expert"])
    prompts = [random_tokens(n, seed=n) for n in (3, 7, 12, 5)]
    items, singles = [], []
    for i, prompt in enumerate(prompts):
        for prefix in ("b", "s"):
            model.prefill(f"{prefix}{i}", prompt)
        token = prompt[-1]
        items.append(DecodeItem(f"b{i}", token, len(prompt)))
        singles.append(model.decode(f"s{i}", token, len(prompt)))
    assert_close(model.decode_batch(items), mx.stack(singles), 1e-5)


def test_missing_expert_is_a_corrupt_model(moe):
    from ferrum_mac.backends.mlx.runtime import MlxLLM
    from ferrum_mac.errors import CorruptModelError
    from ferrum_mac.weights import load_checkpoint

    checkpoint = load_checkpoint(moe["mlp_only"][1]["per_expert"])
    del checkpoint.tensors["layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(CorruptModelError, match="experts.5.up_proj"):
        MlxLLM(checkpoint)


def test_moe_keys_from_every_config_style():
    from ferrum_mac.backends.mlx.models.qwen3_moe import MoeConfig, moe_config
    from ferrum_mac.errors import CorruptModelError
    from ferrum_mac.weights import ModelConfig

    def config(**extra):
        return ModelConfig("qwen3_moe", 320, 64, 96, 4, 4, 2, 16, extra=extra)

    hf4 = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    assert moe_config(config(**hf4)) == MoeConfig(8, 2, 32, True)
    hf5 = dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2)
    hf5["mlp_only_layers"] = [0]
    assert moe_config(config(**hf5)) == MoeConfig(8, 2, 32, False, 2, frozenset({0}))
    gguf = dict(expert_count=8, expert_used_count=2, expert_feed_forward_length=32)
    assert moe_config(config(**gguf)) == MoeConfig(8, 2, 32, True)
    with pytest.raises(CorruptModelError, match="num_experts_per_tok"):
        moe_config(config(num_experts=8, moe_intermediate_size=32))


# -- 4-bit: against mlx-lm on the same quantized weights ---------------------------------


@pytest.fixture(scope="module")
def quantized(moe, tmp_path_factory):
    """dtype -> folder of the `mlp_only` model converted by mlx-lm (4-bit, group 32)."""
    import contextlib
    import io

    from mlx_lm import convert

    root = tmp_path_factory.mktemp("qwen3-moe-4bit")
    hf_folder = root / "hf"
    shutil.copytree(moe["mlp_only"][1]["per_expert"], hf_folder)
    raw = helpers.read_config(hf_folder)
    # mlx-lm reads the pre-transformers-5 names that released checkpoints carry
    raw.update(num_experts=raw["num_local_experts"], rope_theta=raw["rope_parameters"]["rope_theta"])
    helpers.write_config(hf_folder, raw)
    helpers.write_tiny_tokenizer(hf_folder)
    folders = {}
    for dtype in ("float32", "bfloat16"):
        folders[dtype] = root / dtype
        with contextlib.redirect_stdout(io.StringIO()):
            convert(str(hf_folder), str(folders[dtype]), quantize=True, q_group_size=32, q_bits=4, dtype=dtype)
    return folders


def mlx_lm_greedy(model, prompt, n):
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_quantized_checkpoint_is_what_mlx_community_ships(quantized):
    raw = json.loads((quantized["float32"] / "config.json").read_text())
    assert raw["quantization"]["bits"] == 4
    assert raw["quantization"]["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}  # router kept at 8 bits
    tensors = mx.load(str(quantized["float32"] / "model.safetensors"))
    assert tensors["model.layers.0.mlp.switch_mlp.gate_proj.weight"].shape == (8, 32, 64 * 4 // 32)


@pytest.mark.parametrize("dequantize", ["0", "1"])
def test_quantized_fp32_matches_mlx_lm(quantized, monkeypatch, dequantize):
    """fp32 arithmetic on identical 4-bit weights: only the order of float sums differs
    (quantized kernels as on a GPU, or weights dequantized at load as on MLX's CPU build)."""
    import ferrum_mac
    from mlx_lm import load

    monkeypatch.setenv("FERRUM_DEQUANTIZE_ON_CPU", dequantize)
    peer, _ = load(str(quantized["float32"]))
    model = ferrum_mac.open_model(quantized["float32"])
    assert model.config.dtype == "float32"
    for n in (LONG, SHORT):
        tokens = random_tokens(n, seed=n)
        assert_close(model.forward_verify(f"q{n}", tokens), peer(mx.array([tokens]))[0], 1e-4)
    prompt = random_tokens(12, seed=3)
    assert_same_tokens(helpers.ferrum_greedy(model, "g", prompt, 16), mlx_lm_greedy(peer, prompt, 16))


def test_quantized_bf16_error_no_worse_than_mlx_lm(quantized, monkeypatch):
    """bf16 (what mlx-community ships) rounds differently on each side, and this random
    init-0.2 model amplifies rounding (~7-10% of the logit range on both sides), so the two
    are not compared to each other: each is compared to an fp32 evaluation of the same
    4-bit weights, and ours must be about as accurate as mlx-lm's."""
    import ferrum_mac
    from mlx_lm import load

    monkeypatch.setenv("FERRUM_DEQUANTIZE_ON_CPU", "0")  # the quantized kernels, as on a GPU
    peer, _ = load(str(quantized["bfloat16"]))
    model = ferrum_mac.open_model(quantized["bfloat16"], dtype="bfloat16")
    truth = ferrum_mac.open_model(quantized["bfloat16"], dtype="float32")
    assert model.config.dtype == "bfloat16"
    for n in (LONG, SHORT):
        tokens = random_tokens(n, seed=n)
        want = truth.forward_verify("t", tokens)
        truth.release("t")
        ours = helpers.rel_err(model.forward_verify(f"q{n}", tokens), want)
        theirs = helpers.rel_err(peer(mx.array([tokens]))[0], want)
        assert ours <= 1.5 * theirs + 1e-3, f"bf16 error vs fp32: ferrum {ours:.3g}, mlx-lm {theirs:.3g}"


# -- GGUF: llama.cpp's qwen3moe names and metadata ------------------------------------------


def gguf_tensors(hf) -> dict:
    """hf's weights under llama.cpp names (`blk.N.ffn_gate_exps.weight`, ...), as numpy."""
    from ferrum_mac.weights.gguf import _BLOCK_NAMES, _TOP_NAMES

    to_gguf = {canonical: name for name, canonical in {**_BLOCK_NAMES, **_TOP_NAMES}.items()}
    out = {}
    for name, tensor in hf.state_dict().items():
        a, module = tensor.numpy(), name.removeprefix("model.").removesuffix(".weight")
        layer, _, rest = module.removeprefix("layers.").partition(".")
        if rest == "mlp.experts.gate_up_proj":
            half = a.shape[1] // 2
            parts = {"mlp.switch_mlp.gate_proj": a[:, :half], "mlp.switch_mlp.up_proj": a[:, half:]}
        else:
            parts = {rest.replace("experts.", "switch_mlp.") if rest else module: a}
        for canonical, array in parts.items():
            prefix = f"blk.{layer}." if rest else ""
            out[f"{prefix}{to_gguf[canonical]}.weight"] = array.copy()
    return out


def write_qwen3moe_gguf(hf, path: Path, q8: bool) -> Path:
    import gguf

    c, q8_0 = hf.config, gguf.GGMLQuantizationType.Q8_0
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    helpers.add_gguf_shape(w, c)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    for name, a in gguf_tensors(hf).items():
        if q8 and a.ndim > 1 and name != "token_embd.weight":
            w.add_tensor(name, gguf.quants.quantize(a, q8_0), raw_dtype=q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def q8_rounded(hf):
    """hf with every matrix but the embedding rounded through Q8_0, kept in fp32."""
    import copy

    import gguf
    import torch

    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.ndim > 1 and "embed_tokens" not in name:
                q = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)).reshape(p.shape))
    return rounded


@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8_0"])
def test_gguf_matches_transformers(zoo, tmp_path, q8):
    """GGUF has no mlp_only_layers/decoder_sparse_step (llama.cpp makes every layer sparse): the
    zoo's all-sparse model. Q8_0 experts arrive as MLX 8-bit (E, out, in) and run on gather_qmm;
    the reference holds the same Q8_0-rounded weights, so fp32 parity still holds."""
    pytest.importorskip("gguf")
    import ferrum_mac

    hf = zoo.hf("qwen3_moe")
    model = ferrum_mac.open_model(write_qwen3moe_gguf(hf, tmp_path / "m.gguf", q8), dtype="float32")
    assert model.config.model_type == "qwen3_moe"
    experts = model.model.layers[0].mlp.experts.gate_up
    assert (experts.bits, experts.weight.shape[:2]) == ((8, (8, 64)) if q8 else (0, (8, 64)))
    tokens = random_tokens(LONG, seed=LONG)
    assert_close(model.forward_verify("g", tokens), helpers.hf_logits(q8_rounded(hf) if q8 else hf, tokens), 1e-4)
