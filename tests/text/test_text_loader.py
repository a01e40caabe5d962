"""Which tokenizer a model path gets, the errors for paths that have none, and that the text
layer runs without transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from ferrum_mac.errors import CorruptModelError, FerrumError, ModelFileError, ModelNotFoundError
from ferrum_mac.text import HfTokenizer, SentencePieceTokenizer, load_tokenizer


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFileError, match="no tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage\xff" * 10)
    with pytest.raises(CorruptModelError, match="sentencepiece"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").unlink()
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(CorruptModelError, match="not valid JSON"):
        load_tokenizer(tmp_path)


def test_errors_are_one_line(tmp_path):
    for make in (lambda: load_tokenizer(tmp_path / "x"), lambda: load_tokenizer(tmp_path)):
        with pytest.raises(FerrumError) as info:
            make()
        assert "\n" not in str(info.value)


def test_tokenizer_json_is_preferred_over_tokenizer_model(stories_dir):
    tokenizer = load_tokenizer(stories_dir)
    assert isinstance(tokenizer, HfTokenizer)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.bos_id, tokenizer.eos_id) == ("<s>", "</s>", 1, 2)
    assert tokenizer.encode("Once")[0] == 1  # its post-processor adds BOS


def test_stories_tokenizer_json_matches_transformers(stories_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(stories_dir)
    tokenizer = load_tokenizer(stories_dir)
    for text in ["Once upon a time, Lily saw a big dog.", "  two spaces", "<s>x</s> y", "日本 🙂"]:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_folder_reads_tokenizer_config(tmp_path, llama2_model):
    shutil.copy(llama2_model, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "add_eos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    ids = tokenizer.encode("Hello")
    assert ids[0] != tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.eos_ids == {2, 7}
    # special tokens written as text are cut out before sentencepiece sees the text
    ids = tokenizer.encode("<s>Hi</s>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and tokenizer.decode(ids[1:-1]) == "Hi"
    # after a special token no dummy-prefix space (transformers' legacy=False)
    assert not tokenizer.id_to_piece(ids[1]).startswith("▁")


def test_runs_without_transformers(qwen3_dir, stories_dir):
    code = f"""
import sys
from ferrum_mac.text import load_tokenizer, load_chat_template, StreamingDetokenizer
for path in ({str(qwen3_dir)!r}, {str(stories_dir)!r}):
    tok = load_tokenizer(path)
    prompt = load_chat_template(path, tok).render([{{"role": "user", "content": "hi"}}])
    detok = StreamingDetokenizer(tok)
    text = "".join(detok.add(i) for i in tok.encode(prompt, add_special_tokens=False)) + detok.finish()
heavy = [m for m in ("transformers", "torch") if m in sys.modules]
print("loaded:", heavy)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout
