"""Tokenizers rebuilt from GGUF metadata: the real SmolLM2 GGUF against transformers reading
the same file, and GGUF vocabularies written from real tokenizers against those tokenizers."""

from __future__ import annotations

import unicodedata

import pytest

from vocab_gguf_files import byte_level_gguf, sentencepiece_gguf, write_gguf
from text_samples import TRICKY_TEXTS
from ferrum_mac.errors import CorruptModelError, UnsupportedModelError
from ferrum_mac.text import chat_templates, load_chat_template, load_tokenizer
from ferrum_mac.text.gguf_vocab import byte_level_pre_tokenizer

CHAT_TEXTS = TRICKY_TEXTS + ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi 🙂"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "日本語で答えて"},
    ],
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    return tokenizer, load_chat_template(smollm2_path, tokenizer)


@pytest.mark.parametrize("specials", [True, False], ids=["specials", "plain"])
def test_smollm2_encode_decode_match_transformers(smollm2, hf_smollm2, specials):
    tokenizer, _ = smollm2
    for text in CHAT_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=specials)
        assert ids == hf_smollm2.encode(text, add_special_tokens=specials), text
        assert tokenizer.decode(ids) == hf_smollm2.decode(ids, skip_special_tokens=True), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_smollm2.decode(ids), text


def test_smollm2_special_tokens_match_transformers(smollm2, hf_smollm2):
    tokenizer, template = smollm2
    assert tokenizer.template_tokens() == hf_smollm2.special_tokens_map
    assert tokenizer.eos_ids == {hf_smollm2.eos_token_id}
    assert tokenizer.vocab_size == len(hf_smollm2)
    assert template.name == "default" and template.source == hf_smollm2.chat_template


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["gen", "no-gen"])
def test_smollm2_chat_template_matches_transformers(smollm2, hf_smollm2, index, generation_prompt):
    tokenizer, template = smollm2
    messages = CONVERSATIONS[index]
    ours = template.render(messages, add_generation_prompt=generation_prompt)
    assert ours == hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    reference_ids = hf_smollm2.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=generation_prompt
    )
    assert tokenizer.encode(ours, add_special_tokens=False) == list(reference_ids)


def test_smollm2_splits_digits_one_by_one(smollm2):
    """SmolLM2's own tokenizer.json (and llama.cpp's 'smollm' pre-tokenizer) cut every digit apart."""
    tokenizer, _ = smollm2
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2024")] == ["2", "0", "2", "4"]


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("llama-bpe", ["hello", "Ġ", "123", "45", "Ġworld", "'s", "ĊĊ", "Ġ", "Ġend"]),
        ("qwen2", ["hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "'s", "ĊĊ", "Ġ", "Ġend"]),
        ("smollm", ["hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "'s", "ĊĊĠ", "Ġend"]),
        ("gpt2", ["hello", "Ġ12345", "Ġworld", "'s", "ĊĊĠ", "Ġend"]),
        ("some-new-pre", ["hello", "Ġ12345", "Ġworld", "'s", "ĊĊĠ", "Ġend"]),  # unknown: GPT-2's
    ],
)
def test_pre_tokenizer_regex_per_gguf_pre(pre, pieces):
    split = byte_level_pre_tokenizer(pre).pre_tokenize_str("hello 12345 world's\n\n  end")
    assert [piece for piece, _ in split] == pieces


@pytest.fixture(scope="module")
def llama2_gguf(llama2_model, tmp_path_factory):
    return sentencepiece_gguf(llama2_model, tmp_path_factory.mktemp("gguf") / "llama2-vocab.gguf")


def test_sentencepiece_gguf_encodes_like_sentencepiece(llama2_gguf, llama2_model):
    import sentencepiece as spm

    reference = spm.SentencePieceProcessor(model_file=str(llama2_model))
    tokenizer = load_tokenizer(llama2_gguf)
    texts = TRICKY_TEXTS + ["The quick brown fox. Once upon a time, there was a girl named Lily.", " ", ""]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == reference.decode(ids), text
    assert tokenizer.encode("Hi")[0] == reference.bos_id()  # llama vocabularies add BOS by default
    # llama.cpp puts the dummy-prefix space after a special token too
    assert tokenizer.encode("<s>Hi", add_special_tokens=False) == [reference.bos_id(), *reference.encode("Hi")]


def test_byte_level_gguf_encodes_like_its_tokenizer_json(qwen3_dir, tmp_path):
    """Qwen3's vocabulary and merges written the way llama.cpp converts them (pre 'qwen2')."""
    gguf_tokenizer = load_tokenizer(byte_level_gguf(qwen3_dir / "tokenizer.json", tmp_path / "qwen3.gguf", "qwen2"))
    json_tokenizer = load_tokenizer(qwen3_dir)
    # tokenizer.json also NFC-normalizes, which llama.cpp does not; compare on NFC-stable text.
    texts = [t for t in CHAT_TEXTS if unicodedata.normalize("NFC", t) == t] + ["<think>\nhmm\n</think>\n\nok"]
    for text in texts:
        ids = gguf_tokenizer.encode(text)
        assert ids == json_tokenizer.encode(text), text
        assert gguf_tokenizer.decode(ids) == json_tokenizer.decode(ids), text
    think = gguf_tokenizer.encode("<think>", add_special_tokens=False)
    assert len(think) == 1 and gguf_tokenizer.decode(think) == "<think>"  # user-defined: one token, plain text
    assert gguf_tokenizer.decode(gguf_tokenizer.encode("<|im_end|>")) == ""  # control: special


def test_named_gguf_chat_templates(tmp_path):
    path = write_gguf(
        tmp_path / "named.gguf",
        model="llama",
        tokens=["<unk>", "<s>", "</s>", "▁", "a", "▁a"],
        types=[2, 3, 3, 1, 1, 1],
        scores=[0, 0, 0, -1, -2, -3],
        bos=1,
        eos=2,
        chat_template=[{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}],
    )
    assert chat_templates(path) == {"default": "D", "tool_use": "T"}
    tokenizer = load_tokenizer(path)
    assert load_chat_template(path, tokenizer, name="tool_use").render([]) == "T"


def test_unsupported_and_broken_gguf_vocabularies(tmp_path):
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        load_tokenizer(write_gguf(tmp_path / "bert.gguf", model="bert", tokens=["[CLS]", "a"], types=[3, 1]))
    with pytest.raises(CorruptModelError, match="merges"):
        load_tokenizer(write_gguf(tmp_path / "nomerges.gguf", model="gpt2", tokens=["a", "b"], types=[1, 1]))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(CorruptModelError):
        load_tokenizer(junk)
