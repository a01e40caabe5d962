"""A schema the engine cannot compile is a one-line FerrumError naming what to change."""

from __future__ import annotations

import pytest

from ferrum_mac.errors import FerrumError
from ferrum_mac.grammar import GrammarError, UnsupportedSchemaError, json_schema_grammar, tool_call_grammar


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        (
            {"type": "object", "properties": {"a": {"type": "object", "propertyNames": {"maxLength": 3}}}},
            "propertyNames",
        ),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ],
)
def test_unsupported_keyword_is_named(schema, keyword):
    with pytest.raises(UnsupportedSchemaError) as raised:
        json_schema_grammar(schema)
    assert isinstance(raised.value, FerrumError)
    assert raised.value.keywords == (keyword,)
    message = str(raised.value)
    assert f"'{keyword}'" in message and "\n" not in message


def test_every_unsupported_keyword_is_named():
    with pytest.raises(UnsupportedSchemaError) as raised:
        json_schema_grammar({"if": {"type": "string"}, "then": {"minLength": 2}})
    assert set(raised.value.keywords) == {"if", "then"}


@pytest.mark.parametrize(
    "schema, says",
    [
        ({"type": "strin"}, "Invalid type: strin"),
        ({"type": "string", "format": "bogus"}, "Unknown format: bogus"),
        ({"$ref": "https://example.com/schema.json"}, "example.com"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_invalid_schema_is_a_clear_error(schema, says):
    with pytest.raises(GrammarError, match=None) as raised:
        json_schema_grammar(schema)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    assert not isinstance(raised.value, UnsupportedSchemaError)


def test_schema_as_json_text_compiles():
    assert json_schema_grammar('{"type": "object", "properties": {"a": {"type": "integer"}}}')


def test_tool_errors_name_the_tool():
    with pytest.raises(GrammarError, match="at least one tool"):
        tool_call_grammar([])
    with pytest.raises(GrammarError, match="'name'"):
        tool_call_grammar([{"parameters": {"type": "object"}}])
    with pytest.raises(UnsupportedSchemaError, match="tool call.*'uniqueItems'"):
        tool_call_grammar(
            [
                {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
                }
            ]
        )
    with pytest.raises(GrammarError, match="parameters of tool 'f'"):
        tool_call_grammar([{"name": "f", "parameters": "[]"}])
