"""Our tokenizers map exactly into the grammar engine's token table: every id of each real
tokenizer we ship or test with, and ids past the tokenizer (padded embeddings) are never allowed."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest

from conftest import shared
from ferrum_mac.grammar import GrammarMatcher, GrammarVocab, compile_grammar, json_object_grammar
from ferrum_mac.text.loader import load_tokenizer
from ferrum_mac.text.spm_tokenizer import SentencePieceTokenizer
from grammar_walks import allowed_ids

SAMPLE = 'Hello, world! {"naïve": "café – 東京", "n": -12.5e3}\n\tthe  end 🙂'


def unk_id(tokenizer):
    return tokenizer.piece_to_id(tokenizer.unk_token) if tokenizer.unk_token is not None else None


def never_text(tokenizer, token_id: int) -> bool:
    """Special ids, `<unk>`, and bytes no UTF-8 text holds (0xFF, which the engine uses to mark specials)."""
    return (
        token_id in tokenizer.special_ids or token_id == unk_id(tokenizer) or b"\xff" in tokenizer.token_bytes(token_id)
    )


def assert_table_matches(tokenizer, vocab: GrammarVocab) -> None:
    """Every text id: the engine holds the bytes our detokenizer gives it; every special id
    (and `<unk>`) is special to the engine."""
    mismatched = []
    for token_id in range(tokenizer.vocab_size):
        special = never_text(tokenizer, token_id)
        if special:
            if not vocab.engine_tokenizer.is_special_token(token_id):
                mismatched.append((token_id, "not special"))
        elif vocab.engine_bytes(token_id) != tokenizer.token_bytes(token_id):
            mismatched.append((token_id, tokenizer.token_bytes(token_id), vocab.engine_bytes(token_id)))
    assert not mismatched, mismatched[:10]


def assert_same_as_engine_reading(tokenizer_json: str, tokenizer, vocab: GrammarVocab) -> None:
    """The engine's own reading of the tokenizer.json agrees with our bytes for every text id."""
    reference = llguidance.LLTokenizer(tokenizer_json, eos_token=sorted(vocab.eos_ids))
    texts = [i for i in range(tokenizer.vocab_size) if not never_text(tokenizer, i)]
    mismatched = [
        (i, reference.decode_bytes([i]), vocab.engine_bytes(i))
        for i in texts
        if reference.decode_bytes([i]) != vocab.engine_bytes(i)
    ]
    assert not mismatched, mismatched[:10]


def assert_sample_round_trips(tokenizer, vocab: GrammarVocab) -> None:
    ids = tokenizer.encode(SAMPLE, add_special_tokens=False)
    joined = b"".join(vocab.engine_bytes(i) for i in ids).decode("utf-8")
    decoded = tokenizer.decode(ids)  # the text, after the tokenizer's own normalisation
    # A sentencepiece text starts with the space its first word carries.
    assert joined in (decoded, " " + decoded), (joined, decoded)


def test_qwen3_byte_level_bpe(qwen3_tokenizer, qwen3_vocab):
    assert_table_matches(qwen3_tokenizer, qwen3_vocab)
    text = (shared("tokenizers", "qwen3") / "tokenizer.json").read_text()
    assert_same_as_engine_reading(text, qwen3_tokenizer, qwen3_vocab)
    assert_sample_round_trips(qwen3_tokenizer, qwen3_vocab)


def test_smollm2_gguf_vocabulary(smollm2_tokenizer, smollm2_vocab):
    assert_table_matches(smollm2_tokenizer, smollm2_vocab)
    assert_same_as_engine_reading(smollm2_tokenizer.backend.to_str(), smollm2_tokenizer, smollm2_vocab)
    assert_sample_round_trips(smollm2_tokenizer, smollm2_vocab)


def test_stories_sentencepiece_model():
    folder = shared("stories260K")
    tokenizer = SentencePieceTokenizer(folder / "tokenizer.model")
    vocab = GrammarVocab(tokenizer, width=512)
    assert_table_matches(tokenizer, vocab)
    # The same vocabulary as a tokenizer.json (what load_tokenizer picks for this folder).
    assert_same_as_engine_reading((folder / "tokenizer.json").read_text(), tokenizer, vocab)
    via_json = load_tokenizer(folder)
    assert_table_matches(via_json, GrammarVocab(via_json))
    assert_sample_round_trips(tokenizer, vocab)


def test_llama2_sentencepiece_model():
    tokenizer = SentencePieceTokenizer(shared("tokenizers", "llama2-spm", "tokenizer.model"))
    vocab = GrammarVocab(tokenizer)
    assert_table_matches(tokenizer, vocab)
    assert_sample_round_trips(tokenizer, vocab)
    byte_0a = tokenizer.piece_to_id("<0x0A>")
    assert vocab.engine_bytes(byte_0a) == b"\n"


def test_ids_past_the_tokenizer_are_never_allowed(qwen3_tokenizer, qwen3_vocab):
    assert qwen3_vocab.width == 151936 and qwen3_vocab.words == 151936 // 32
    padding = np.arange(qwen3_tokenizer.vocab_size, qwen3_vocab.width)
    matcher = GrammarMatcher(compile_grammar(json_object_grammar(), qwen3_vocab), start_after=[1, 2])
    assert not np.isin(allowed_ids(matcher), padding).any()  # before the grammar starts
    assert len(allowed_ids(matcher)) == qwen3_tokenizer.vocab_size
    for token in (1, 2, *qwen3_tokenizer.encode('{"a": [', add_special_tokens=False)):
        matcher.accept(token)
        allowed = allowed_ids(matcher)
        assert len(allowed) and not np.isin(allowed, padding).any()


def test_special_tokens_are_never_text(qwen3_tokenizer, qwen3_vocab):
    matcher = GrammarMatcher(compile_grammar(json_object_grammar(), qwen3_vocab))
    for token in qwen3_tokenizer.encode('{"k": "', add_special_tokens=False):
        matcher.accept(token)
    allowed = set(allowed_ids(matcher).tolist())  # inside a string: almost anything
    assert len(allowed) > 100_000
    assert not allowed & set(qwen3_tokenizer.special_ids)


def test_a_vocabulary_without_eos_is_refused(qwen3_tokenizer):
    with pytest.raises(ValueError, match="end-of-sequence"):
        GrammarVocab(qwen3_tokenizer, eos_ids=[])


def test_json_text_is_what_the_table_spells(smollm2_tokenizer, smollm2_vocab):
    text = json.dumps({"name": "Ada", "tags": ["x", "y"]}, separators=(", ", ": "))
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(smollm2_vocab.table[i] for i in ids).decode() == text
