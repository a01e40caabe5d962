"""GGUF's K-quant, i-quant, MXFP4 and BF16 types: each decoded as the `gguf` package's
reference dequantizes it (float32), through both backends' layouts; tiny models stored in them
compute what transformers computes from the same file; sharded files load as one model; bad
files fail in one line before anything is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ferrum_mac
import helpers
from ferrum_mac.backends.torch import quant
from ferrum_mac.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from ferrum_mac.weights import ggml_blocks
from ferrum_mac.weights.gguf import load_gguf
from ferrum_mac.weights.gguf_header import BLOCKS, read_gguf_info

gguf = pytest.importorskip("gguf")
mx = pytest.importorskip("mlx.core")

EXACT = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "IQ4_NL", "MXFP4")
DENSE_FP16 = ("Q2_K", "Q6_K")
QUANTIZED = (*EXACT, "IQ4_XS", *DENSE_FP16)


def blocks_of(kind: str, count: int, rng) -> np.ndarray:
    """`count` blocks: `gguf.quants.quantize`d normal values where it can, else random bytes."""
    per_block, block_bytes = BLOCKS[kind]
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    try:
        values = rng.normal(0, 0.1, (count, per_block)).astype(np.float32)
        return gguf.quants.quantize(values, qtype).reshape(count, block_bytes)
    except NotImplementedError:
        return helpers.ggml_random_blocks(kind, (count, per_block), 0.1, rng)


def test_the_types_are_the_documented_ones():
    assert set(ggml_blocks.LAYOUTS) == {*QUANTIZED, "F32", "F16", "BF16"}
    assert all(isinstance(ggml_blocks.LAYOUTS[kind], str) for kind in DENSE_FP16)


@pytest.mark.parametrize("kind", QUANTIZED)
def test_blocks_decode_as_the_gguf_reference(kind):
    rng = np.random.default_rng(sum(map(ord, kind)))
    blocks = blocks_of(kind, 64, rng)
    want = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind)).reshape(64, -1)
    decoded = ggml_blocks.decode(blocks, kind)
    if kind in DENSE_FP16:  # one rounding of the reference
        assert decoded.dtype == np.float16 and np.array_equal(decoded, want.astype(np.float16))
        return
    bits, group = ggml_blocks.LAYOUTS[kind]
    assert decoded.codes.max() < 1 << bits
    words = ggml_blocks.pack(decoded.codes.reshape(64, -1), bits)
    scales, biases = decoded.scales.reshape(64, -1), decoded.biases.reshape(64, -1)
    # MLX's own dequantization of the words (scales in float32: w = scale * q + bias unrounded)
    f32 = [mx.array(t).astype(mx.float32) for t in (scales, biases)]
    by_mlx = np.array(mx.dequantize(mx.array(words), *f32, group_size=group, bits=bits))
    packed = quant.Packed(torch.from_numpy(words.view(np.int32)), *map(torch.from_numpy, (scales, biases)), bits, group)
    assert np.array_equal(packed.dequantize().numpy(), by_mlx)
    if bits not in quant.BITS:  # the torch kernels read 8-bit words of the same values
        assert np.array_equal(packed.widened().dequantize().numpy(), by_mlx)
    if kind in EXACT:
        assert np.array_equal(by_mlx, want)
    else:  # IQ4_XS: 17 bits of scale times 8 of code, rounded once in float32
        assert np.all(np.abs(by_mlx - want) <= 2.0**-24 * np.abs(want))
    # float16 scales (what 16-bit compute rounds them to) move a weight by at most one
    # rounding of its group's scale and bias
    s16, b16 = (t.astype(np.float16).astype(np.float32).repeat(group, 1) for t in (scales, biases))
    codes = decoded.codes.reshape(64, -1).astype(np.float32)
    bound = 2.0**-11 * (np.abs(s16) * codes + np.abs(b16))
    assert np.all(np.abs(s16 * codes + b16 - want) <= bound + 2.0**-24 * np.abs(want))


# Q4_K_M's mix (Q6_K for attn_v, ffn_down and the head, Q4_K elsewhere), and every other type
MIXES = {
    "Q4_K_M": {
        **dict.fromkeys(("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "token_embd"), "Q4_K"),
        **dict.fromkeys(("attn_v", "ffn_down", "output"), "Q6_K"),
    },
    "others": {
        "attn_q": "Q5_K",
        "attn_k": "Q3_K",
        "attn_v": "IQ4_NL",
        "attn_output": "Q2_K",
        "ffn_gate": "IQ4_XS",
        "ffn_up": "MXFP4",
        "ffn_down": "Q5_0",
        "token_embd": "Q5_1",
        "output": "BF16",
    },
}
PROMPT = helpers.random_tokens(24, seed=5)


@pytest.fixture(scope="module")
def wide_qwen3():
    """A tiny Qwen3 with rows of 256 values (K-quants' block)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        **{**helpers.TINY, "hidden_size": 256, "intermediate_size": 512, "initializer_range": 0.05},
        head_dim=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("mix", MIXES)
def test_a_model_in_each_type_matches_transformers_on_both_backends(wide_qwen3, tmp_path, mix):
    from transformers import AutoModelForCausalLM

    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.backends.torch.weights import load_onto

    path = helpers.write_gguf_from_hf(wide_qwen3, "qwen3", tmp_path / f"{mix}.gguf", MIXES[mix])
    assert {kind for _, _, kind in read_gguf_info(path).tensors} == set(MIXES[mix].values()) | {"F32"}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32, head_dim=64)
    want = helpers.hf_logits(reference.eval(), PROMPT)
    on_mlx = ferrum_mac.open_model(path, backend="mlx", dtype="float32")
    helpers.assert_close(on_mlx.forward_verify("x", PROMPT), want, 1e-3)
    on_torch = TorchLLM(load_onto(path, torch.device("cpu")), dtype="float32", device="cpu", packed=True)
    helpers.assert_close(on_torch.forward_verify("x", PROMPT), want, 1e-3)


def test_show_names_the_type_mix(wide_qwen3, tmp_path, capsys):
    from ferrum_mac.cli.store_commands import show_command

    path = helpers.write_gguf_from_hf(wide_qwen3, "qwen3", tmp_path / "m.gguf", MIXES["Q4_K_M"])
    show_command(str(path), "mlx")
    assert "tensor types    Q4_K 69%, Q6_K 30%, F32 <1%" in capsys.readouterr().out


def test_shards_load_as_one_model(zoo, tmp_path):
    source = zoo.hf("qwen3")
    whole = helpers.write_gguf_from_hf(source, "qwen3", tmp_path / "whole.gguf", {"attn_q": "Q8_0"})
    first = helpers.write_gguf_from_hf(
        source, "qwen3", tmp_path / "split.gguf", {"attn_q": "Q8_0"}, split_max_tensors=8
    )
    count = first.name.removeprefix("split-00001-of-").removesuffix(".gguf")
    assert int(count) > 2
    want = ferrum_mac.open_model(whole, dtype="float32").forward_verify("x", PROMPT)
    for backend in ("mlx", "torch"):
        model = ferrum_mac.open_model(tmp_path / f"split-00002-of-{count}.gguf", backend=backend, dtype="float32")
        helpers.assert_close(model.forward_verify("x", PROMPT), want, 1e-6)
    from ferrum_mac.store.describe import describe
    from ferrum_mac.text import read_gguf_metadata

    assert len(read_gguf_metadata(tmp_path / f"split-00002-of-{count}.gguf")["tokenizer.ggml.tokens"]) == 320

    assert describe(first).parameters == describe(whole).parameters
    assert describe(first).types == describe(whole).types
    folder = tmp_path / "folder"
    folder.mkdir()
    for shard in tmp_path.glob("split-*.gguf"):
        shard.rename(folder / shard.name)
    assert ferrum_mac.open_model(folder, dtype="float32").model_config.num_layers == 2
    (folder / f"split-00002-of-{count}.gguf").unlink()
    with pytest.raises(ModelNotFoundError, match=f"split-00002-of-{count}.gguf is missing"):
        load_gguf(folder / f"split-00001-of-{count}.gguf")


def tensor_type_at(path, name: str) -> int:
    """The byte offset of tensor `name`'s type id in the header."""
    data = path.read_bytes()
    at = data.index(name.encode()) + len(name)
    dims = int.from_bytes(data[at : at + 4], "little")
    return at + 4 + 8 * dims


@pytest.fixture
def small_gguf(tmp_path, zoo):
    return helpers.write_gguf_from_hf(zoo.hf("qwen3"), "qwen3", tmp_path / "small.gguf", {"attn_q": "Q5_0"})


@pytest.mark.parametrize(
    "type_id, error, message",
    [
        (16, UnsupportedModelError, r"tensor blk\.0\.attn_q\.weight is IQ2_XXS, which ferrum cannot load"),
        (34, UnsupportedModelError, r"tensor blk\.0\.attn_q\.weight is TQ1_0"),
        (99, UnsupportedModelError, r"tensor blk\.0\.attn_q\.weight is type 99"),
        (12, CorruptModelError, r"tensor blk\.0\.attn_q\.weight of shape \(\d+, 64\) is not whole Q4_K blocks"),
    ],
)
def test_a_type_ferrum_cannot_read_or_a_size_it_disagrees_with(small_gguf, type_id, error, message):
    data = bytearray(small_gguf.read_bytes())
    at = tensor_type_at(small_gguf, "blk.0.attn_q.weight")
    data[at : at + 4] = type_id.to_bytes(4, "little")
    small_gguf.write_bytes(bytes(data))
    for backend in ("mlx", "torch"):
        with pytest.raises(error, match=message) as failure:
            ferrum_mac.open_model(small_gguf, backend=backend, dtype="float32")
        assert "\n" not in str(failure.value)


def test_a_file_cut_inside_a_block(small_gguf):
    cut = read_gguf_info(small_gguf).offsets["blk.1.attn_q.weight"] + 5  # inside its first Q5_0 block
    small_gguf.write_bytes(small_gguf.read_bytes()[:cut])
    with pytest.raises(CorruptModelError, match=r"is truncated \(\d+ of \d+ bytes\)"):
        load_gguf(small_gguf)


@pytest.mark.parametrize("kind", ["Q5_0", "MXFP4", "IQ4_NL"])
def test_moe_experts_in_5_and_8_bit_layouts_agree_on_both_backends(zoo, tmp_path, kind):
    """Stacked experts `(experts, out, in)` keep the type's layout: MLX's gather_qmm over 5 or 8
    bits, the torch experts widened to 8; both compute the same logits."""
    from backends.test_qwen3_moe import gguf_tensors

    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.backends.torch.weights import load_onto

    hf, qtype = zoo.hf("qwen3_moe"), getattr(gguf.GGMLQuantizationType, kind)
    path, c = tmp_path / "moe.gguf", hf.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    helpers.add_gguf_shape(w, c)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    for name, a in gguf_tensors(hf).items():
        if "_exps" in name:
            w.add_tensor(
                name,
                blocks_of(kind, a.size // 32, np.random.default_rng(0)).reshape(*a.shape[:-1], -1),
                raw_dtype=qtype,
            )
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    on_mlx = ferrum_mac.open_model(path, backend="mlx", dtype="float32")
    assert on_mlx.model.layers[0].mlp.experts.gate_up.bits == ggml_blocks.LAYOUTS[kind][0]
    on_torch = TorchLLM(load_onto(path, torch.device("cpu")), dtype="float32", device="cpu", packed=True)
    helpers.assert_close(on_torch.forward_verify("x", PROMPT), on_mlx.forward_verify("x", PROMPT), 1e-5)


def test_block_scales_beyond_float16_are_refused_in_one_line():
    from ferrum_mac.weights.gguf_tensors import read_tensor

    block = np.zeros(17, dtype=np.uint8)
    block[0] = 200  # MXFP4's scale 2^72: 12 times it is no float16
    with pytest.raises(UnsupportedModelError, match=r"^f: tensor t \(MXFP4\) has block scales beyond float16's range"):
        read_tensor(block, 0, (1, 32), "MXFP4", "f: tensor t")
    block[0] = 90  # 2^-38: under float16's smallest, the block's values (< 2^-34) read as 0
    assert not read_tensor(block, 0, (1, 32), "MXFP4", "f: tensor t")["scales"][0].any()
