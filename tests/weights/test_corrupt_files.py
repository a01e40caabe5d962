"""Damaged model files: each is refused with one line (a FerrumError), never a traceback.

Safetensors headers that are not what the format allows, config.json files that are not UTF-8
or not an object, weights behind dangling or looping links, GGUF files of another version or
cut inside their header; then seeded fuzzing of both header parsers on real files, and the CLI's
own output for one of them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest

import ferrum_mac
from ferrum_mac.errors import CorruptModelError, FerrumError, UnsupportedModelError
from ferrum_mac.store.completeness import missing_parts, safetensors_is_whole
from ferrum_mac.store.describe import describe
from ferrum_mac.weights.gguf import load_gguf
from ferrum_mac.text.loader import load_chat_template, load_tokenizer
from ferrum_mac.weights.gguf_header import _cached_info, read_gguf_info
from ferrum_mac.weights.safetensors import load_safetensors


def one_line(error: BaseException) -> str:
    message = str(error)
    assert isinstance(error, FerrumError), f"{type(error).__name__}: {message}"
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


def refused(exc_type, path) -> str:
    """Open `path` as a model, expect `exc_type` with a one-line message; return the message."""
    with pytest.raises(exc_type) as err:
        ferrum_mac.open_model(path, dtype="float32")
    return one_line(err.value)


@pytest.fixture
def tiny_copy(zoo, tmp_path) -> Path:
    """A private copy of a tiny llama checkpoint, free to damage."""
    folder = tmp_path / "model"
    shutil.copytree(zoo.path("llama"), folder)
    return folder


# -- safetensors headers ------------------------------------------------------------------------


def split_safetensors(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_safetensors(path: Path, header, tensor_bytes: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + tensor_bytes)


def _first(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _set(field, value):
    def change(header):
        header[_first(header)][field] = value
        return header

    return change


def _past_the_end(header):
    name = _first(header)
    start, end = header[name]["data_offsets"]
    far = 10**9
    header[name]["data_offsets"] = [far, far + end - start]  # the right size, beyond the file
    return header


HEADER_DAMAGE = {
    "a JSON list": lambda header: [header],
    "a JSON string": lambda header: "tensors",
    "an integer entry": lambda header: {**header, _first(header): 5},
    "offsets of one number": _set("data_offsets", [0]),
    "offsets of three numbers": _set("data_offsets", [0, 4, 8]),
    "negative offsets": _set("data_offsets", [-4, 0]),
    "end before start": lambda header: _set("data_offsets", header[_first(header)]["data_offsets"][::-1])(header),
    "offsets past the end": _past_the_end,
    "offsets as strings": _set("data_offsets", ["0", "4"]),
    "offsets as floats": _set("data_offsets", [0.0, 4.0]),
    "offsets as an object": _set("data_offsets", {"start": 0}),
    "an unknown dtype": _set("dtype", "Q9"),
    "a dtype that is a number": _set("dtype", 4),
    "a shape that is a string": _set("shape", "64x64"),
    "a shape of floats": _set("shape", [1.5, 2]),
    "a negative shape": _set("shape", [-1, 64]),
    "a shape the offsets do not hold": _set("shape", [3, 3, 3]),
    "no shape": lambda header: {**header, _first(header): {"dtype": "F32", "data_offsets": [0, 4]}},
    "metadata that is a list": lambda header: {**header, "__metadata__": ["x"]},
    "metadata with a number": lambda header: {**header, "__metadata__": {"format": 1}},
    "nesting past the stack": lambda header: b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("damage", list(HEADER_DAMAGE))
def test_damaged_safetensors_headers_are_one_line_errors(tiny_copy, damage):
    weights = tiny_copy / "model.safetensors"
    header, tensor_bytes = split_safetensors(weights)
    write_safetensors(weights, HEADER_DAMAGE[damage](header), tensor_bytes)
    refused(CorruptModelError, tiny_copy)
    # `ferrum list` and `show` read the same header: the model is incomplete, and shown
    assert not safetensors_is_whole(weights) and "model.safetensors" in missing_parts(tiny_copy)
    assert describe(tiny_copy).format == "safetensors"


# -- config.json ---------------------------------------------------------------------------------


CONFIG_DAMAGE = {
    "not UTF-8": lambda text: b"\xff\xfe" + text.encode("utf-16-le"),
    "a JSON list": lambda text: f"[{text}]".encode(),
    "a JSON number": lambda text: b"42",
    "a size that is a string": lambda text: json.dumps({**json.loads(text), "hidden_size": "big"}).encode(),
    "zero heads": lambda text: json.dumps({**json.loads(text), "num_attention_heads": 0}).encode(),
    "a negative vocabulary": lambda text: json.dumps({**json.loads(text), "vocab_size": -5}).encode(),
    "rope scaling that is a list": lambda text: json.dumps({**json.loads(text), "rope_scaling": [1]}).encode(),
    "an epsilon that is an object": lambda text: json.dumps({**json.loads(text), "rms_norm_eps": {}}).encode(),
}


@pytest.mark.parametrize("damage", list(CONFIG_DAMAGE))
def test_damaged_config_json_is_a_one_line_error(tiny_copy, damage):
    config = tiny_copy / "config.json"
    config.write_bytes(CONFIG_DAMAGE[damage](config.read_text()))
    refused(CorruptModelError, tiny_copy)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_side_files_that_are_not_objects_are_one_line_errors(tiny_copy, name):
    (tiny_copy / name).write_text("[1, 2, 3]")
    message = refused(CorruptModelError, tiny_copy)
    assert name in message and "not an object" in message


@pytest.mark.parametrize(
    "name, content",
    [
        ("tokenizer_config.json", b"[1, 2, 3]"),
        ("tokenizer_config.json", b"\xff\xfe{"),
        ("config.json", b"[]"),
        ("chat_template.jinja", b"\xff\xfe{{ x }}"),
    ],
)
def test_tokenizer_side_files_that_are_damaged_are_one_line_errors(name, content, tmp_path):
    from ferrum_mac.text.loader import chat_templates, load_tokenizer

    stories = helpers.ASSETS / "stories260K"
    if not stories.is_dir():
        pytest.skip("shared assets not found")
    folder = tmp_path / "stories"
    shutil.copytree(stories, folder)
    for path in folder.iterdir():
        path.chmod(0o644)  # the shared copy is read-only
    (folder / "tokenizer.json").unlink()  # the tokenizer.model path reads config.json too
    (folder / name).write_bytes(content)
    with pytest.raises(CorruptModelError, match=name) as err:
        load_tokenizer(folder)
        chat_templates(folder)
    one_line(err.value)


def test_show_names_a_config_that_is_not_utf8_or_not_an_object(tiny_copy):
    config = tiny_copy / "config.json"
    for content in (b"\xff\xfe\x00{", b"[]"):
        config.write_bytes(content)
        with pytest.raises(CorruptModelError, match="config.json") as err:
            describe(tiny_copy)
        one_line(err.value)


# -- weights behind broken links ------------------------------------------------------------------


def test_weights_behind_a_dangling_link(tiny_copy):
    weights = tiny_copy / "model.safetensors"
    weights.unlink()
    os.symlink(tiny_copy / "gone.safetensors", weights)
    assert "model.safetensors" in refused(CorruptModelError, tiny_copy)


def test_weights_behind_a_looping_link(tiny_copy):
    weights = tiny_copy / "model.safetensors"
    weights.unlink()
    os.symlink(tiny_copy / "model-loop.safetensors", weights)
    os.symlink(weights, tiny_copy / "model-loop.safetensors")
    refused(CorruptModelError, tiny_copy)


def test_a_gguf_behind_a_dangling_or_looping_link(tiny_gguf, tmp_path):
    folder = tmp_path / "gguf-model"
    folder.mkdir()
    link = folder / "model.gguf"
    os.symlink(tmp_path / "gone.gguf", link)
    for path in (link, folder):
        assert "link to a file that is missing" in refused(CorruptModelError, path)
    link.unlink()
    os.symlink(link, link)  # a link to itself
    for path in (link, folder):
        assert "loop of links" in refused(CorruptModelError, path)
    with pytest.raises(CorruptModelError, match="cannot be read") as err:
        describe(link)  # what `ferrum show` prints
    one_line(err.value)


def test_a_dangling_index_shard(tiny_copy):
    weights = tiny_copy / "model.safetensors"
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in split_safetensors(weights)[0]}}
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    weights.unlink()
    os.symlink(tiny_copy / "gone", weights)
    refused(FerrumError, tiny_copy)
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert "not a valid safetensors index" in refused(CorruptModelError, tiny_copy)


# -- GGUF ------------------------------------------------------------------------------------------


def write_gguf(path: Path) -> Path:
    """A small llama GGUF written by the `gguf` package: the metadata a converter writes
    (shape keys, a byte-level BPE vocabulary with merges, a chat template), F32 tensors."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in (
        (w.add_block_count, 1),
        (w.add_context_length, 128),
        (w.add_embedding_length, 64),
        (w.add_feed_forward_length, 128),
        (w.add_head_count, 4),
        (w.add_head_count_kv, 2),
        (w.add_layer_norm_rms_eps, 1e-5),
        (w.add_rope_freq_base, 10000.0),
        (w.add_vocab_size, 64),
    ):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(62)] + ["<|im_start|>", "<|im_end|>"]
    w.add_token_list(tokens)
    w.add_token_types([1] * 62 + [3, 3])
    w.add_token_merges(["a a", "b b", "aa a"])
    w.add_bos_token_id(62)
    w.add_eos_token_id(63)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (64, 64),
        "output_norm.weight": (64,),
        "blk.0.attn_norm.weight": (64,),
        "blk.0.ffn_norm.weight": (64,),
        "blk.0.attn_q.weight": (64, 64),
        "blk.0.attn_k.weight": (32, 64),
        "blk.0.attn_v.weight": (32, 64),
        "blk.0.attn_output.weight": (64, 64),
        "blk.0.ffn_gate.weight": (128, 64),
        "blk.0.ffn_up.weight": (128, 64),
        "blk.0.ffn_down.weight": (64, 128),
    }
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def header_length(path: Path) -> int:
    return min(read_gguf_info(path).offsets.values())


def test_the_tiny_gguf_is_a_model(tiny_gguf):
    model = ferrum_mac.open_model(tiny_gguf, dtype="float32")
    assert model.config.num_layers == 1 and model.prefill("t", [1, 2, 3]).shape[-1] == 64
    model.release("t")


@pytest.mark.parametrize(
    "version, error, message",
    [
        (1, UnsupportedModelError, "GGUF version 1; ferrum reads versions 2 and 3"),
        (4, UnsupportedModelError, "GGUF version 4"),
        (0x03000000, UnsupportedModelError, "big-endian"),
        (0, CorruptModelError, "GGUF version 0, which no GGUF file has"),
        (0xFFFFFFFF, CorruptModelError, "GGUF version 4294967295, which no GGUF file has"),
    ],
)
def test_a_gguf_of_another_version_is_refused(tiny_gguf, tmp_path, version, error, message):
    data = bytearray(tiny_gguf.read_bytes())
    data[4:8] = struct.pack("<I", version)
    path = tmp_path / "other.gguf"
    path.write_bytes(bytes(data))
    assert message in refused(error, path)


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_a_gguf_cut_inside_its_header(tiny_gguf, tmp_path, fraction):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: 4 + int(fraction * (header_length(tiny_gguf) - 4))])
    assert "truncated" in refused(CorruptModelError, cut)


@pytest.mark.timeout(60)  # a hang guard: counting to 2**64 would never end
@pytest.mark.parametrize("field, offset, size", [("tensor count", 8, 8), ("metadata count", 16, 8)])
def test_a_gguf_with_an_impossible_count_fails_at_once(tiny_gguf, tmp_path, field, offset, size):
    data = bytearray(tiny_gguf.read_bytes())
    data[offset : offset + size] = b"\xff" * size
    path = tmp_path / "count.gguf"
    path.write_bytes(bytes(data))
    refused(CorruptModelError, path)


# -- fuzzing both header parsers ------------------------------------------------------------------


WEIRD = [
    [],
    [1],
    [1, 2, 3],
    -1,
    1.5,
    "x",
    None,
    {},
    True,
    [-1, 4],
    [10**20, 10**20 + 4],
    [4, 0],
    ["a", "b"],
    2**64,
    [0, 2**63],
    "F32",
    "BF16",
    "I64",
    [2, 2],
    [0],
    [1, 0],
]


def mutate_safetensors(data: bytes, rng: random.Random) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    kind = rng.randrange(5)
    if kind == 0:  # cut anywhere
        return data[: rng.randrange(len(data))]
    if kind == 1:  # a byte of the header
        at = rng.randrange(8, 8 + n)
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
    if kind == 2:  # the header's length
        length = rng.choice([0, 1, n - 1, n + 1, len(data), 2**63, rng.randrange(2**64)])
        return struct.pack("<Q", length) + data[8:]
    header = json.loads(data[8 : 8 + n])
    name = rng.choice(list(header))
    if kind == 3:  # one field of one entry
        if name == "__metadata__":
            header[name] = rng.choice(WEIRD)
        else:
            header[name][rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(WEIRD)
    else:  # a field dropped, an entry replaced, or the same numbers moved
        choice = rng.randrange(3)
        if choice == 0 and name != "__metadata__":
            del header[name][rng.choice(["dtype", "shape", "data_offsets"])]
        elif choice == 1:
            header[name] = rng.choice(WEIRD)
        else:
            other = rng.choice([k for k in header if k != "__metadata__"])
            if name != "__metadata__":
                header[name]["data_offsets"] = header[other]["data_offsets"]
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


@pytest.mark.timeout(120)  # a hang guard: no case may read or allocate what the header claims
def test_fuzzed_safetensors_headers_load_or_fail_in_one_line(tmp_path):
    from safetensors.numpy import save_file

    folder = tmp_path / "fuzz"
    folder.mkdir()
    rng_np = np.random.default_rng(0)
    tensors = {
        "embed.weight": rng_np.standard_normal((8, 4)).astype(np.float32),
        "norm.weight": np.ones(4, dtype=np.float16),
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
        "flag": np.array([True, False]),
    }
    weights = folder / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "np"})
    real = weights.read_bytes()
    rng = random.Random(1234)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(300):
        weights.write_bytes(mutate_safetensors(real, rng))
        assert isinstance(safetensors_is_whole(weights), bool)
        try:
            loaded = load_safetensors(folder)
        except FerrumError as e:
            one_line(e)
            outcomes["refused"] += 1
            continue
        except Exception as e:  # the one thing this test forbids
            raise AssertionError(f"case {case}: {type(e).__name__}: {e}") from e
        header, _ = split_safetensors(weights)
        assert {name: tuple(array.shape) for name, array in loaded.items()} == {
            name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"
        }, f"case {case}"
        outcomes["loaded"] += 1
    assert outcomes["loaded"] > 10 and outcomes["refused"] > 100, outcomes


def mutate_gguf(data: bytes, header_end: int, rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0:  # cut, mostly inside the header
        return data[: rng.randrange(header_end if rng.random() < 0.8 else len(data))]
    at = rng.randrange(4, header_end)
    if kind == 1:  # one byte
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
    width = rng.choice([4, 8])  # a count, length, type or offset field's worth of bytes
    value = rng.choice([0, 1, 2, 3, 4, 5, 8, 9, 12, 13, 255, 2**31, 2**32 - 1, rng.randrange(2 ** (8 * width))])
    value %= 2 ** (8 * width)
    return data[:at] + value.to_bytes(width, "little") + data[at + width :]


@pytest.mark.timeout(120)  # a hang guard: no case may read or allocate what the header claims
def test_fuzzed_gguf_headers_load_or_fail_in_one_line(tiny_gguf, tmp_path):
    real = tiny_gguf.read_bytes()
    header_end = header_length(tiny_gguf)
    path = tmp_path / "fuzz.gguf"
    rng = random.Random(7)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(600):
        path.write_bytes(mutate_gguf(real, header_end, rng))
        _cached_info.cache_clear()  # same name, same size: the cache would answer for the last case
        try:
            info = read_gguf_info(path, arrays=True)
            config, _, _ = load_gguf(path)  # the config from the header; tensors stay unread
            tokenizer = load_tokenizer(path)  # and the vocabulary and template that came with it
            load_chat_template(path, tokenizer).render([{"role": "user", "content": "hi"}])
        except FerrumError as e:
            one_line(e)
            outcomes["refused"] += 1
            continue
        except Exception as e:  # the one thing this test forbids
            raise AssertionError(f"case {case}: {type(e).__name__}: {e}") from e
        assert all(isinstance(name, str) and len(shape) <= 4 for name, shape, _ in info.tensors), f"case {case}"
        assert config.num_layers >= 1 and config.vocab_size >= 1, f"case {case}"
        outcomes["loaded"] += 1
    assert outcomes["loaded"] > 10 and outcomes["refused"] > 100, outcomes


# -- what the CLI prints --------------------------------------------------------------------------


def ferrum(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ferrum_mac.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_the_cli_prints_one_line_for_a_damaged_model(tiny_copy, tmp_path):
    config = tiny_copy / "config.json"
    good = config.read_bytes()
    config.write_bytes(b"[1, 2]")
    show = ferrum("show", str(tiny_copy), cwd=tmp_path)
    assert show.returncode == 1 and not show.stdout
    assert show.stderr.count("\n") == 1 and show.stderr.startswith("ferrum: ") and "not an object" in show.stderr

    config.write_bytes(good)
    weights = tiny_copy / "model.safetensors"
    header, tensor_bytes = split_safetensors(weights)
    write_safetensors(weights, [header], tensor_bytes)
    run = ferrum("run", str(tiny_copy), "hello", cwd=tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().count("\n") == 0 and run.stderr.startswith("ferrum: "), run.stderr
