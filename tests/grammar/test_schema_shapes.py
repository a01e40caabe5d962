"""Schemas as agents and apps write them: `$defs` and `$ref` (local, nested, `definitions`,
recursive, `anyOf` of refs) as a tool's parameters exactly as a response format; answers that
always end (recursion, format strings and untyped numbers bounded); enums and consts exact;
`strict`; a tool without parameters; caps that stay cheap."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from grammar_walks import random_walk
from ferrum_mac.grammar import GrammarError, GrammarMatcher, compile_grammar, json_schema_grammar, tool_call_grammar
from ferrum_mac.grammar.refs import RECURSION_DEPTH
from ferrum_mac.grammar.schema import tool_calls_grammar

ITEM = {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}}}
ITEM_REQUIRED = {**ITEM, "required": ["sku", "n"], "additionalProperties": False}
NODE = {
    "type": "object",
    "properties": {"value": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}},
    "required": ["value", "next"],
    "additionalProperties": False,
}
REF_SCHEMAS = {
    "pydantic_defs": {
        "$defs": {"Item": ITEM_REQUIRED},
        "properties": {"items": {"items": {"$ref": "#/$defs/Item"}, "type": "array", "maxItems": 3}},
        "required": ["items"],
        "type": "object",
    },
    "definitions": {
        "definitions": {"Item": ITEM_REQUIRED},
        "type": "object",
        "properties": {"first": {"$ref": "#/definitions/Item"}},
        "required": ["first"],
        "additionalProperties": False,
    },
    "nested_refs": {
        "$defs": {
            "Order": {
                "type": "object",
                "properties": {"item": {"$ref": "#/$defs/Order/$defs/Line"}, "note": {"$ref": "#/properties/tag"}},
                "required": ["item"],
                "$defs": {"Line": {"$ref": "#/$defs/Item"}},
            },
            "Item": ITEM_REQUIRED,
        },
        "type": "object",
        "properties": {"order": {"$ref": "#/$defs/Order"}, "tag": {"type": "string", "maxLength": 6}},
        "required": ["order"],
    },
    "recursive_list": {"$defs": {"Node": NODE}, "$ref": "#/$defs/Node"},
    "any_of_refs": {
        "$defs": {
            "Cat": {"properties": {"meow": {"type": "boolean"}}, "required": ["meow"], "additionalProperties": False},
            "Dog": {"properties": {"bark": {"type": "boolean"}}, "required": ["bark"], "additionalProperties": False},
        },
        "type": "object",
        "properties": {"pet": {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
        "required": ["pet"],
        "additionalProperties": False,
    },
    "root_recursion": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 5},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["name", "children"],
    },
}


def texts_of(grammar_text: str, vocab, tokenizer, seed: int, walks: int = 3, max_tokens: int = 600) -> list[str]:
    grammar = compile_grammar(grammar_text, vocab)
    rng = np.random.default_rng(seed)
    return [tokenizer.decode(random_walk(GrammarMatcher(grammar), rng, max_tokens=max_tokens)) for _ in range(walks)]


def accepts(grammar_text: str, vocab, tokenizer, text: str) -> bool:
    matcher = GrammarMatcher(compile_grammar(grammar_text, vocab))
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.accept(token)
    except GrammarError:
        return False
    return matcher.is_complete()


@pytest.mark.parametrize("name", sorted(REF_SCHEMAS))
def test_refs_work_as_tool_parameters_as_they_do_as_a_response_format(name, smollm2_vocab, smollm2_tokenizer):
    schema = REF_SCHEMAS[name]
    for text in texts_of(json_schema_grammar(schema), smollm2_vocab, smollm2_tokenizer, seed=1):
        jsonschema.validate(json.loads(text), schema)
    tools = [{"name": "other", "parameters": REF_SCHEMAS["any_of_refs"]}, {"name": "f", "parameters": schema}]
    for text in texts_of(tool_call_grammar(tools), smollm2_vocab, smollm2_tokenizer, seed=2, walks=4):
        call = json.loads(text)
        jsonschema.validate(call["arguments"], tools[call["name"] == "f"]["parameters"])
    calls = tool_calls_grammar(tools, between="\n</tool_call>\n<tool_call>\n")
    for text in texts_of(calls, smollm2_vocab, smollm2_tokenizer, seed=3, walks=2):
        for piece in text.split("\n</tool_call>\n<tool_call>\n"):
            call = json.loads(piece)
            jsonschema.validate(call["arguments"], tools[call["name"] == "f"]["parameters"])


def test_a_ref_that_points_nowhere_is_named():
    with pytest.raises(GrammarError, match="'#/\\$defs/Missing' points nowhere"):
        json_schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}})


def test_recursion_nests_at_most_its_depth(smollm2_vocab, smollm2_tokenizer):
    schema = REF_SCHEMAS["recursive_list"]
    grammar = json_schema_grammar(schema)
    chain = None
    for depth in range(1, RECURSION_DEPTH + 2):
        chain = {"value": depth, "next": chain}
    deepest = json.dumps(chain["next"])  # RECURSION_DEPTH nodes
    assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, deepest)
    assert not accepts(grammar, smollm2_vocab, smollm2_tokenizer, json.dumps(chain))


def test_a_walk_that_always_nests_still_ends(smollm2_vocab, smollm2_tokenizer):
    # the walk below never takes `null` while a node is allowed: it must meet the depth's end
    matcher = GrammarMatcher(compile_grammar(json_schema_grammar(REF_SCHEMAS["recursive_list"]), smollm2_vocab))
    text = ""
    for depth in range(RECURSION_DEPTH + 1):
        piece = '{"value": 1, "next": '
        ids = smollm2_tokenizer.encode(piece, add_special_tokens=False)
        try:
            for token in ids:
                matcher.accept(token)
        except GrammarError:
            break
        text += piece
    assert text.count("{") == RECURSION_DEPTH


def test_format_strings_end(smollm2_vocab, smollm2_tokenizer):
    schema = {"type": "object", "properties": {"email": {"type": "string", "format": "email"}}, "required": ["email"]}
    grammar = json_schema_grammar(schema)
    assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, json.dumps({"email": "ann@example.com"}))
    assert not accepts(grammar, smollm2_vocab, smollm2_tokenizer, json.dumps({"email": "a" * 300 + "@example.com"}))


LONG = "1234567890123456789012345"


@pytest.mark.parametrize(
    "schema, number_at",
    [
        ({}, "{}"),
        (True, "{}"),
        ({"type": "object", "properties": {"a": {"type": "string"}}}, '{"x": {}}'),
        ({"minimum": 0}, "{}"),
        ({"type": "object", "properties": {"a": {}}}, '{"a": {}}'),
        ({"type": "array"}, "[{}]"),
    ],
)
def test_untyped_numbers_are_capped_too(schema, number_at, smollm2_vocab, smollm2_tokenizer):
    grammar = json_schema_grammar(schema)
    assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, number_at.replace("{}", "12.5"))
    assert not accepts(grammar, smollm2_vocab, smollm2_tokenizer, number_at.replace("{}", LONG))


def test_untyped_values_keep_their_other_types(smollm2_vocab, smollm2_tokenizer):
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"minimum": 0}}, "required": ["a"]})
    for value in ['"text"', "[1, 2]", '{"b": null}', "true", "3"]:
        assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, '{"a": ' + value + "}"), value
    assert not accepts(grammar, smollm2_vocab, smollm2_tokenizer, '{"a": -1}')


@pytest.mark.parametrize("values", [[0.1, 0.4], [0.1, 0.2, 0.3], [10**20, 3], [0.123456789]])
def test_enums_and_consts_survive_the_cap_exactly(values, smollm2_vocab, smollm2_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "number", "enum": values}}, "required": ["a"]}
    grammar = json_schema_grammar(schema)
    for value in values:
        assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, json.dumps({"a": value})), value
    const = json_schema_grammar({"type": "object", "properties": {"a": {"const": values[-1]}}, "required": ["a"]})
    assert accepts(const, smollm2_vocab, smollm2_tokenizer, json.dumps({"a": values[-1]}))


def test_strict_takes_no_undeclared_members(smollm2_vocab, smollm2_tokenizer):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
        "required": ["a"],
    }
    extra, nested_extra = '{"a": {"b": 1}, "z": 2}', '{"a": {"b": 1, "z": 2}}'
    loose = json_schema_grammar(schema)
    assert accepts(loose, smollm2_vocab, smollm2_tokenizer, extra)
    assert accepts(loose, smollm2_vocab, smollm2_tokenizer, nested_extra)
    strict = json_schema_grammar(schema, strict=True)
    assert accepts(strict, smollm2_vocab, smollm2_tokenizer, '{"a": {"b": 1}}')
    assert not accepts(strict, smollm2_vocab, smollm2_tokenizer, extra)
    assert not accepts(strict, smollm2_vocab, smollm2_tokenizer, nested_extra)
    tool = tool_call_grammar([{"name": "f", "parameters": schema, "strict": True}])
    assert not accepts(tool, smollm2_vocab, smollm2_tokenizer, '{"name": "f", "arguments": ' + extra + "}")


@pytest.mark.parametrize(
    "tool", [{"name": "now"}, {"name": "now", "parameters": None}, {"name": "now", "parameters": {}}]
)
def test_a_tool_without_parameters_takes_no_arguments(tool, smollm2_vocab, smollm2_tokenizer):
    grammar = tool_call_grammar([tool])
    assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, '{"name": "now", "arguments": {}}')
    assert not accepts(grammar, smollm2_vocab, smollm2_tokenizer, '{"name": "now", "arguments": {"time": 1}}')


def test_caps_stay_cheap_on_many_number_fields(smollm2_vocab):
    # each field's own cap once cost a lexer each: 600 such fields passed the engine's limit
    fields = {f"q{j}": {"type": ["number", "string", "integer"]} for j in range(20)}
    schema = {"type": "object", "properties": {f"p{i}": {"type": "object", "properties": fields} for i in range(30)}}
    compile_grammar(json_schema_grammar(schema), smollm2_vocab)
    plain = {f"n{i}": {"type": "number", "description": f"field {i}"} for i in range(400)}
    compile_grammar(json_schema_grammar({"type": "object", "properties": plain}), smollm2_vocab)


def test_the_caches_hold_sizes_not_counts():
    from ferrum_mac.grammar.lru import SizedLru

    cache = SizedLru(max_entries=10, max_bytes=100)
    cache.put("a", "A", 60)
    cache.put("b", "B", 30)
    assert cache.get("a") == "A"  # now the most recent
    cache.put("c", "C", 30)  # 120 bytes: the oldest ("b") goes
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == ("A", None, "C")
    cache.put("huge", "H", 101)
    assert cache.get("huge") is None and len(cache) == 2


def test_strict_leaves_an_allof_satisfiable(smollm2_vocab, smollm2_tokenizer):
    # each branch closed would refuse the other's member ('a' is unsatisfiable)
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ]
    }
    grammar = json_schema_grammar(schema, strict=True)
    assert accepts(grammar, smollm2_vocab, smollm2_tokenizer, '{"a": 1, "b": true}')
