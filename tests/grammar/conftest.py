"""Real vocabularies in the grammar engine, built once per session."""

from __future__ import annotations

import pytest

import helpers
from ferrum_mac.grammar import GrammarVocab
from ferrum_mac.text.loader import load_tokenizer
from ferrum_mac.text.spm_tokenizer import SentencePieceTokenizer


def shared(*parts: str):
    path = helpers.ASSETS.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path.name} not found (the shared assets live next to the repository)")
    return path


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    return load_tokenizer(shared("tokenizers", "qwen3"))


@pytest.fixture(scope="session")
def qwen3_vocab(qwen3_tokenizer):
    # Qwen3's embeddings are padded to 151,936 rows past its 151,669 tokens.
    return GrammarVocab(qwen3_tokenizer, width=151936)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_vocab(smollm2_tokenizer):
    return GrammarVocab(smollm2_tokenizer)


@pytest.fixture(scope="session")
def llama2_tokenizer():
    return SentencePieceTokenizer(shared("tokenizers", "llama2-spm", "tokenizer.model"))
