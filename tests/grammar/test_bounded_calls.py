"""Numbers the grammar lets a model write are bounded in digits, and a call grammar with a
separator lets the model make several calls, each valid against its tool."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from grammar_walks import random_walk
from ferrum_mac.grammar import GrammarError, GrammarMatcher, compile_grammar, json_object_grammar, json_schema_grammar
from ferrum_mac.grammar.bounds import bounded as bounded_numbers
from ferrum_mac.grammar.schema import tool_calls_grammar
from ferrum_mac.text.tool_calls import FORMATS, HERMES, parse_tool_calls

UNBOUNDED = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "n": {"type": "integer"}, "low": {"type": "number", "minimum": 0}},
    "required": ["x", "n"],
    "additionalProperties": False,
}
HERMES_BETWEEN = "\n</tool_call>\n<tool_call>\n"
TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
]
TWO_CALLS = (
    '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    + HERMES_BETWEEN
    + '{"name": "add", "arguments": {"a": 1.5, "b": -2}}'
)


def accepts(grammar_text: str, vocab, tokenizer, text: str) -> bool:
    """Whether the grammar takes `text` whole (its tokens one by one, then EOS)."""
    matcher = GrammarMatcher(compile_grammar(grammar_text, vocab))
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.accept(token)
    except GrammarError:
        return False
    return matcher.is_complete()


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"x": 0.333333, "n": -12}', True),
        ('{"x": 0.3333333, "n": 1}', False),  # a seventh decimal
        ('{"x": 12345678901234, "n": 1}', True),
        ('{"x": 123456789012345, "n": 1}', False),  # a fifteenth digit before the point
        ('{"x": 1, "n": 123456789012345678}', True),
        ('{"x": 1, "n": 1234567890123456789}', False),  # a nineteenth digit
        ('{"x": 1e300, "n": 1}', False),
        ('{"x": 1, "n": 2, "low": -1}', False),  # the schema's own bound still holds
    ],
)
def test_numbers_are_capped_in_digits(text, ok, smollm2_vocab, smollm2_tokenizer):
    assert accepts(json_schema_grammar(UNBOUNDED), smollm2_vocab, smollm2_tokenizer, text) is ok


def test_json_object_numbers_are_capped_too(smollm2_vocab, smollm2_tokenizer):
    grammar = json_object_grammar()
    assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, '{"a": [1.5, {"b": null}], "c": "x", "d": true}')
    assert not accepts(grammar, smollm2_vocab, smollm2_tokenizer, '{"a": [0.12345678]}')


def test_json_object_has_a_member(smollm2_vocab, smollm2_tokenizer):
    # JSON mode's answer carries content; a schema that allows `{}` keeps allowing it
    grammar = json_object_grammar()
    assert not accepts(grammar, smollm2_vocab, smollm2_tokenizer, "{}")
    assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, '{"colours": ["red", "green", "blue"]}')
    assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, '{"a": {}}')
    assert accepts(json_schema_grammar({"type": "object"}), smollm2_vocab, smollm2_tokenizer, "{}")


def test_bounds_narrow_the_schema_and_leave_it_unchanged():
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": -(10**19)}}, "not": UNBOUNDED}
    capped = bounded_numbers(schema)
    assert schema["properties"]["a"] == {"type": "integer", "maximum": -(10**19)}  # a copy was changed
    assert capped["properties"]["a"] == {"type": "integer", "maximum": -(10**19)}  # a cap would leave nothing
    assert capped["not"] == UNBOUNDED  # narrowing inside `not` would widen the schema


def test_random_walks_of_unbounded_numbers_end_and_validate(smollm2_vocab, smollm2_tokenizer):
    grammar = compile_grammar(json_schema_grammar(UNBOUNDED), smollm2_vocab)
    rng = np.random.default_rng(5)
    for _ in range(4):
        ids = random_walk(GrammarMatcher(grammar), rng, max_tokens=120)
        jsonschema.validate(json.loads(smollm2_tokenizer.decode(ids)), UNBOUNDED)


def test_parallel_call_grammar_takes_two_calls_each_valid(smollm2_vocab, smollm2_tokenizer):
    many = tool_calls_grammar(TOOLS, between=HERMES_BETWEEN)
    assert accepts(many, smollm2_vocab, smollm2_tokenizer, TWO_CALLS)
    one = tool_calls_grammar(TOOLS)
    assert not accepts(one, smollm2_vocab, smollm2_tokenizer, TWO_CALLS)
    bad = TWO_CALLS.replace('"b": -2', '"c": -2')
    assert not accepts(many, smollm2_vocab, smollm2_tokenizer, bad)  # the second call is checked too
    content, calls = parse_tool_calls("<tool_call>\n" + TWO_CALLS, FORMATS[HERMES])
    assert not content.strip() and [c.name for c in calls] == ["get_weather", "add"]
    for call in calls:
        schema = next(t["parameters"] for t in TOOLS if t["name"] == call.name)
        jsonschema.validate(json.loads(call.arguments), schema)


def test_random_walks_of_a_parallel_grammar_parse_as_calls(smollm2_vocab, smollm2_tokenizer):
    grammar = compile_grammar(tool_calls_grammar(TOOLS, between=HERMES_BETWEEN), smollm2_vocab)
    rng = np.random.default_rng(2)
    counts = set()
    for _ in range(6):
        ids = random_walk(GrammarMatcher(grammar), rng, max_tokens=300, eos_weight=0.5)
        _, calls = parse_tool_calls("<tool_call>\n" + smollm2_tokenizer.decode(ids), FORMATS[HERMES])
        counts.add(len(calls))
        for call in calls:
            schema = next(t["parameters"] for t in TOOLS if t["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), schema)
    assert max(counts) >= 2, counts
