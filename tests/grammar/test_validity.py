"""Random walks through each schema's matcher produce JSON that parses and validates."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from grammar_walks import random_walk
from ferrum_mac.grammar import (
    GrammarVocab,
    GrammarMatcher,
    compile_grammar,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from schemas import SCHEMAS, TOOLS

jsonschema = pytest.importorskip("jsonschema")
WALKS = 3


def walk_texts(grammar_text: str, vocab, tokenizer, seed: int) -> list[str]:
    grammar = compile_grammar(grammar_text, vocab)
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(WALKS):
        ids = random_walk(GrammarMatcher(grammar), rng)
        texts.append(b"".join(vocab.table[i] for i in ids).decode("utf-8"))
    return texts


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_walks_validate_against_schema(name, smollm2_vocab, smollm2_tokenizer):
    schema = SCHEMAS[name]
    for text in walk_texts(
        json_schema_grammar(schema), smollm2_vocab, smollm2_tokenizer, seed=zlib.crc32(name.encode())
    ):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", ["nested_objects", "any_of_objects", "array_of_objects"])
def test_walks_validate_with_qwen3_vocabulary(name, qwen3_vocab, qwen3_tokenizer):
    schema = SCHEMAS[name]
    for text in walk_texts(json_schema_grammar(schema), qwen3_vocab, qwen3_tokenizer, seed=7):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", ["flat_required", "all_of_merge", "string_enum", "array_of_objects"])
def test_walks_validate_with_sentencepiece_vocabulary(name, llama2_tokenizer):
    # Text the grammar forces is tokenized without sentencepiece's leading space.
    vocab = GrammarVocab(llama2_tokenizer)
    schema = SCHEMAS[name]
    for text in walk_texts(json_schema_grammar(schema), vocab, llama2_tokenizer, seed=11):
        jsonschema.validate(json.loads(text), schema)


def test_json_object_walks_are_objects(smollm2_vocab, smollm2_tokenizer):
    for text in walk_texts(json_object_grammar(), smollm2_vocab, smollm2_tokenizer, seed=3):
        assert isinstance(json.loads(text), dict)


def test_tool_call_walks_name_a_tool_and_fit_its_parameters(smollm2_vocab, smollm2_tokenizer):
    by_name = {tool["name"]: tool.get("parameters") or {"type": "object"} for tool in TOOLS}
    seen = set()
    for seed in range(4):
        for text in walk_texts(tool_call_grammar(TOOLS), smollm2_vocab, smollm2_tokenizer, seed=seed):
            call = json.loads(text)
            assert set(call) == {"name", "arguments"}
            jsonschema.validate(call["arguments"], by_name[call["name"]])
            seen.add(call["name"])
    assert len(seen) >= 2, seen
