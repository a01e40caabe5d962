"""The store's pure parts: names, file selection, completeness, header facts. No server."""

from __future__ import annotations

import json

import pytest

from tiny_repo import write_gguf_header, write_safetensors_header
from ferrum_mac.errors import ModelNotFoundError, UnsupportedModelError
from ferrum_mac.store.aliases import ALIASES, BundledRef, RepoRef, alias_for_repo, parse_name
from ferrum_mac.store.completeness import missing_parts
from ferrum_mac.store.describe import count_parameters, describe
from ferrum_mac.store.resolve import resolve_model
from ferrum_mac.store.select import gguf_quant_of, needed_files
from ferrum_mac.store.units import human_age, human_bytes


@pytest.mark.parametrize(
    "name, backend, expected",
    [
        ("qwen3:0.6b", "mlx", RepoRef("mlx-community/Qwen3-0.6B-4bit")),
        ("qwen3:0.6b", "torch", RepoRef("Qwen/Qwen3-0.6B")),
        ("Qwen3:8B-8bit", "mlx", RepoRef("mlx-community/Qwen3-8B-8bit")),
        ("qwen3:30b-a3b", "mlx", RepoRef("mlx-community/Qwen3-30B-A3B-4bit")),
        ("llama3.1:8b-bf16", "mlx", RepoRef("meta-llama/Llama-3.1-8B-Instruct")),
        ("smollm2:135m", "mlx", BundledRef("smollm2:135m")),
        ("smollm2:135m", "torch", RepoRef("HuggingFaceTB/SmolLM2-135M-Instruct")),
        ("phi4", "mlx", RepoRef("mlx-community/phi-4-4bit")),
        ("phi4:14b", "torch", RepoRef("microsoft/phi-4")),
        ("phi4-mini", "torch", RepoRef("microsoft/Phi-4-mini-instruct")),
        ("phi4-mini-8bit", "mlx", RepoRef("mlx-community/Phi-4-mini-instruct-8bit")),
        ("smollm3:3b", "mlx", RepoRef("mlx-community/SmolLM3-3B-4bit")),
        ("smollm3", "torch", RepoRef("HuggingFaceTB/SmolLM3-3B")),
        ("gpt-oss:20b", "mlx", RepoRef("openai/gpt-oss-20b")),  # (no affine MLX conversion)
        ("gpt-oss:120b", "torch", RepoRef("openai/gpt-oss-120b")),
        ("org/model", "mlx", RepoRef("org/model")),
        ("org/model@v1.0", "mlx", RepoRef("org/model", "v1.0")),
        ("org/Model-GGUF:Q8_0", "mlx", RepoRef("org/Model-GGUF", gguf_quant="Q8_0")),
    ],
)
def test_names(name, backend, expected):
    assert parse_name(name, backend) == expected


@pytest.mark.parametrize(
    "name, error, message",
    [
        (
            "qwen3:7b",
            ModelNotFoundError,
            r"unknown model 'qwen3:7b' \(did you mean qwen3:[\d.]+b\?\); `ferrum list --available`",
        ),
        ("qwen3:8b-8bit", UnsupportedModelError, "torch backend runs the original bf16 weights"),
        ("gpt-oss:20b-4bit", ModelNotFoundError, "'gpt-oss:20b-4bit' has no 4bit conversion; use gpt-oss:20b-bf16,"),
        ("not a name", ModelNotFoundError, "is not a model name"),
    ],
)
def test_bad_names(name, error, message):
    with pytest.raises(error, match=message):
        parse_name(name, "torch" if "8bit" in name else "mlx")


def test_issue_aliases_exist_and_map_back():
    names = {a.name for a in ALIASES}
    for required in (
        "qwen3:0.6b",
        "qwen3:1.7b",
        "qwen3:4b",
        "qwen3:8b",
        "qwen3:30b-a3b",
        "qwen2.5:0.5b",
        "qwen2.5:1.5b",
        "qwen2.5:3b",
        "qwen2.5:7b",
        "llama3.2:1b",
        "llama3.2:3b",
        "llama3.1:8b",
        "mistral:7b",
        "smollm2:135m",
        "phi4:14b",
        "phi4-mini:3.8b",
        "smollm3:3b",
        "gpt-oss:20b",
        "gpt-oss:120b",
    ):
        assert required in names
    assert alias_for_repo("mlx-community/Qwen3-0.6B-4bit") == "qwen3:0.6b"
    assert alias_for_repo("Qwen/Qwen3-0.6B") == "qwen3:0.6b-bf16"
    assert alias_for_repo("openai/gpt-oss-20b") == "gpt-oss:20b-bf16"


def test_every_alias_has_a_row_on_every_backend():
    """`ferrum list --available`: an alias without an MLX conversion lists its original."""
    from ferrum_mac.store.aliases import BACKENDS, alias_table

    for backend in BACKENDS:
        rows = dict(alias_table(backend))
        assert len(rows) == len(ALIASES) and rows["gpt-oss:20b"] == "openai/gpt-oss-20b"


def test_paths_are_never_taken_for_names(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    assert resolve_model(tmp_path) == tmp_path


SIDE = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"]


def test_selection_prefers_safetensors_and_skips_copies():
    repo = SIDE + [
        "model.safetensors",
        "pytorch_model.bin",
        "model-Q4_0.gguf",
        "original/consolidated.00.pth",
        "original/params.json",
        ".gitattributes",
        "flax_model.msgpack",
        "onnx/model.onnx",
    ]
    assert needed_files(repo) == sorted(SIDE) + ["model.safetensors"]


def test_selection_takes_transformers_shards_over_mistral_consolidated():
    repo = SIDE + [
        "consolidated.safetensors",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "params.json",
    ]
    assert needed_files(repo)[-3:] == [
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_selection_of_gguf_repositories():
    repo = ["README.md", "x-Q4_K_M.gguf", "x-Q8_0.gguf", "x-f16.gguf"]
    assert needed_files(repo) == ["README.md", "x-Q8_0.gguf"]
    assert needed_files(repo, "q4_k_m") == ["README.md", "x-Q4_K_M.gguf"]
    with pytest.raises(UnsupportedModelError, match="no GGUF of a type ferrum loads"):
        needed_files(["a-Q4_K_M.gguf", "a-Q6_K.gguf"])
    assert [
        gguf_quant_of(n) for n in ("SmolLM2-135M-Instruct.Q4_1.gguf", "m-IQ4_XS.gguf", "m-bf16.gguf", "m.gguf")
    ] == ["Q4_1", "IQ4_XS", "BF16", None]


def test_pickle_only_repositories_are_refused():
    with pytest.raises(UnsupportedModelError, match="only pickled PyTorch weights"):
        needed_files(SIDE + ["pytorch_model.bin"])


def _model_folder(folder, shards=("model.safetensors",), index=False, truncate=0):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (folder / "tokenizer.json").write_text("{}")
    for shard in shards:
        write_safetensors_header(folder / shard, {"w": ("F32", (4, 4))}, truncate=truncate)
    if index:
        weight_map = {f"w{i}": s for i, s in enumerate(["model-1.safetensors", "model-2.safetensors"])}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def test_completeness(tmp_path):
    assert missing_parts(_model_folder(tmp_path / "whole")) == []
    assert missing_parts(_model_folder(tmp_path / "short", truncate=8)) == ["model.safetensors"]
    assert missing_parts(_model_folder(tmp_path / "shard", ("model-1.safetensors",), index=True)) == [
        "model-2.safetensors"
    ]
    dangling = _model_folder(tmp_path / "dangling")
    (dangling / "tokenizer.json").unlink()
    (dangling / "tokenizer.json").symlink_to(tmp_path / "gone")
    assert missing_parts(dangling) == ["tokenizer.json", "tokenizer"]


def test_parameters_of_an_mlx_quantized_checkpoint(tmp_path):
    folder = tmp_path / "q"
    folder.mkdir()
    # a 4-bit (256, 512) matrix packs into (256, 64) uint32 with group size 64: 8 groups per row
    write_safetensors_header(
        folder / "model.safetensors",
        {
            "embed.weight": ("BF16", (100, 512)),
            "proj.weight": ("U32", (256, 64)),
            "proj.scales": ("BF16", (256, 8)),
            "proj.biases": ("BF16", (256, 8)),
        },
    )
    config = {"quantization": {"group_size": 64, "bits": 4}}
    assert count_parameters(folder, config) == 100 * 512 + 256 * 512


def test_gguf_facts(tmp_path):
    path = write_gguf_header(
        tmp_path / "m.gguf",
        {
            "general.architecture": "llama",
            "general.license": "apache-2.0",
            "llama.context_length": 8192,
            "tokenizer.ggml.tokens": ["<s>", "</s>", "hello"],
            "tokenizer.chat_template": "{{ messages }}",
        },
        [
            ("token_embd.weight", (1000, 64), 8),
            ("blk.0.attn_q.weight", (64, 64), 3),
            ("blk.0.ffn_up.weight", (256, 64), 3),
            ("blk.0.ffn_down.weight", (64, 256), 3),
        ],
    )
    facts = describe(path)
    assert (facts.format, facts.architecture, facts.context_length, facts.license) == (
        "gguf",
        "llama",
        8192,
        "apache-2.0",
    )
    assert facts.chat_template and facts.parameters == 1000 * 64 + 64 * 64 + 2 * 256 * 64
    assert facts.quantization == "Q8_0"  # the embedding holds most of this toy's weights


def test_units():
    assert [human_bytes(n) for n in (12, 1234, 5_600_000, 7.25e9)] == ["12 B", "1.2 kB", "5.6 MB", "7.2 GB"]
    assert human_age(0, now=3 * 86400 + 5) == "3 days ago" and human_age(100, now=110) == "just now"


def test_a_damaged_gguf_is_listed_as_unfinished_not_as_a_model(hf_home):
    from ferrum_mac.store import bundled, list_models

    gguf = bundled.models_dir() / bundled.SMOLLM2.name / bundled.SMOLLM2.filename
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF\x03\x00")  # cut inside the header
    [model] = list_models()
    assert model.name == "smollm2:135m" and not model.complete


def test_a_family_of_one_size_is_named_by_its_family_alone():
    """`ferrum run phi4-mini "Hi"` as with Ollama; a family of several sizes stays a prompt word."""
    from ferrum_mac.cli.run import split_model_and_prompt

    assert split_model_and_prompt(["phi4-mini", "Hi"]) == ("phi4-mini", "Hi")
    assert split_model_and_prompt(["qwen3", "Hi"]) == (None, "qwen3 Hi")
