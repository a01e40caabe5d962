"""JSON schemas, `json_object` and tool-call shapes as grammars, with errors that name what is unsupported."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

import llguidance

from ferrum_mac.errors import FerrumError

# Compact JSON with a space after ',' and ':' (how models write it), and no free whitespace:
# flexible whitespace lets a small model pad its output with newlines until it runs out of tokens.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


class GrammarError(FerrumError):
    """A schema or grammar the engine cannot compile; its message says what to change."""


class UnsupportedSchemaError(GrammarError):
    """A valid JSON schema using a keyword the grammar engine does not implement."""

    def __init__(self, message: str, keywords: Sequence[str]):
        super().__init__(message)
        self.keywords = tuple(keywords)


def json_schema_grammar(schema: Any, what: str = "the JSON schema") -> str:
    """The grammar of JSON text valid against `schema` (a dict or its JSON text)."""
    schema = _schema_object(schema, what)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    check_grammar(grammar, what)
    return grammar


def json_object_grammar() -> str:
    """Any JSON object: `response_format` `{"type": "json_object"}`."""
    return json_schema_grammar({"type": "object"}, "json_object")


def tool_call_grammar(tools: Sequence[Mapping[str, Any]]) -> str:
    """One call of one of `tools`: `{"name": <its name>, "arguments": <its parameters schema>}`.

    Each tool is `{"name": ..., "parameters": {...}}` (OpenAI's `function` object); a tool
    without parameters takes any object.
    """
    if not tools:
        raise GrammarError("a tool call needs at least one tool; pass the tools the model may call")
    shapes = []
    for tool in tools:
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError("every tool needs a non-empty string 'name'")
        parameters = _schema_object(tool.get("parameters") or {"type": "object"}, f"the parameters of tool {name!r}")
        shapes.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    return json_schema_grammar(schema, "the tool call")


def marked_tool_call_grammar(tools: Sequence[Mapping[str, Any]], opener: str, closer: str) -> str:
    """One call of one of `tools` written between the family's markers, e.g. `<tool_call>\n` and
    `\n</tool_call>`: for an answer that reasons first, so the markers cannot be put in the prompt."""
    schema = json.loads(tool_call_grammar(tools))["grammars"][0]["json_schema"]
    lark = f"start: {json.dumps(opener)} call {json.dumps(closer)}\ncall: %json {json.dumps(schema)}"
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    check_grammar(grammar, "the tool call")
    return grammar


def check_grammar(grammar: str, what: str) -> None:
    """Raise a `GrammarError` naming the problem when the engine cannot compile `grammar`."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return
    message = messages[0] if messages else "the grammar engine rejected it"
    found = _UNIMPLEMENTED.search(message)
    if found:
        keywords = [k.strip().strip('"') for k in found.group(1).split(",") if k.strip()]
        names = ", ".join(f"'{k}'" for k in keywords)
        raise UnsupportedSchemaError(
            f"{what} uses {names}, which constrained decoding does not support; remove or rewrite that keyword",
            keywords,
        )
    raise GrammarError(f"{what} cannot be compiled: {_one_line(message)}")


def _schema_object(schema: Any, what: str) -> dict:
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"{what} is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object (a schema), not {type(schema).__name__}")
    return schema


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]
