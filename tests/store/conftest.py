"""Fixtures for the store tests: a tiny Llama repository, a fake Hub serving it, an isolated cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fake_hub import FakeHub, FakeRepo

from tiny_repo import REPO_ID

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
STORIES = SHARED / "assets" / "stories260K"
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}<|assistant|>"
README = "---\nlicense: mit\nlibrary_name: transformers\n---\n# tiny-llama\nRandom weights for tests.\n"


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    """A tiny random Llama saved by transformers, the stories260K tokenizer, and decoy files."""
    if not STORIES.is_dir():
        pytest.skip("shared assets not found (looked for shared/assets/stories260K next to the repository)")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(STORIES / name, folder / name)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "README.md").write_text(README)
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert "model.safetensors" in files
    # Decoys a pull must leave on the server: pickled weights, another format, a subfolder copy.
    files["pytorch_model.bin"] = b"\x80\x04 pickled decoy " * 1000
    files["tiny-llama-Q8_0.gguf"] = b"GGUF decoy " * 1000
    files["original/consolidated.00.pth"] = b"decoy " * 1000
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    return files


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face home and ferrum data dir; no stored login, not offline."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # the bundled model's folder
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(home / ".agent_harnesses.json"))
    return home


@pytest.fixture
def hub(hf_home, tiny_files, monkeypatch):
    """The fake Hub with the tiny repository, set as the endpoint (HF_ENDPOINT), stopped afterwards."""
    from huggingface_hub import constants

    server = FakeHub()
    server.add(FakeRepo(REPO_ID, dict(tiny_files)))
    server.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    # huggingface_hub hands bytes over in 10 MB chunks; smaller ones let a cut-off half of a
    # sub-megabyte file reach the disk, as the first gigabytes of a real model would.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    yield server
    server.stop()
