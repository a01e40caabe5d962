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

# A number without bounds lets a small model write digits until its tokens run out ("0.3333..."),
# so the grammar caps every number it writes at 20 significant digits: integers at 18 digits (the
# engine's integer ranges are 64-bit), other numbers at 14 before the point and 6 after. Only the
# grammar is narrowed: whatever it allows still validates against the schema as given.
INTEGER_LIMIT = 10**18 - 1
NUMBER_LIMIT = 10**14 - 1
NUMBER_STEP = 1e-6
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedProperties")


class GrammarError(FerrumError):
    """A schema or grammar the engine cannot compile; its message says what to change."""


class UnsupportedSchemaError(GrammarError):
    """A valid JSON schema using a keyword the grammar engine does not implement."""

    def __init__(self, message: str, keywords: Sequence[str]):
        super().__init__(message)
        self.keywords = tuple(keywords)


def json_schema_grammar(schema: Any, what: str = "the JSON schema") -> str:
    """The grammar of JSON text valid against `schema` (a dict or its JSON text)."""
    schema = bounded_numbers(_schema_object(schema, what))
    # as text: llguidance cannot take a dict holding an integer past 64 bits
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    check_grammar(grammar, what)
    return grammar


# Any JSON value, spelled out so that its numbers get the digit caps too.
ANY_JSON: dict = {
    "anyOf": [
        {"type": ["null", "boolean", "integer", "number", "string"]},
        {"type": "array", "items": {"$ref": "#/$defs/json"}},
        {"type": "object", "additionalProperties": {"$ref": "#/$defs/json"}},
    ]
}


ANY_OBJECT: dict = {"type": "object", "additionalProperties": {"$ref": "#/$defs/json"}}

# JSON mode's answer holds at least one member: `{}` is valid JSON that says nothing, and a small
# model asked for JSON takes it every time (as it would end a free answer at once). A schema is
# left as its author wrote it.
JSON_MODE_OBJECT: dict = {**ANY_OBJECT, "minProperties": 1}


def json_object_grammar() -> str:
    """Any JSON object with at least one member: `response_format` `{"type": "json_object"}`."""
    return json_schema_grammar({**JSON_MODE_OBJECT, "$defs": {"json": ANY_JSON}}, "json_object")


def bounded_numbers(schema: Any) -> Any:
    """`schema` with every number and integer it allows capped in digits (see INTEGER_LIMIT):
    a missing bound is added, and numbers without `multipleOf` take NUMBER_STEP. `not` is left
    alone (narrowing inside it would widen the schema). A copy; `schema` is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kinds = out.get("type")
    kinds = {k for k in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(k, str)}  # a client's schema
    if "number" in kinds:
        _cap(out, NUMBER_LIMIT)
        out.setdefault("multipleOf", NUMBER_STEP)
    elif "integer" in kinds:
        _cap(out, INTEGER_LIMIT)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_numbers(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_numbers(sub) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = bounded_numbers(out[key])
    return out


def _cap(schema: dict, limit: int) -> None:
    """Add the bounds `schema` lacks, unless the one it has lies past `limit` (then the cap
    would leave nothing)."""
    low = _bound(schema, "minimum", "exclusiveMinimum")
    high = _bound(schema, "maximum", "exclusiveMaximum")
    if low is None and (high is None or high >= -limit):
        schema["minimum"] = -limit
    if high is None and (low is None or low <= limit):
        schema["maximum"] = limit


def _bound(schema: dict, inclusive: str, exclusive: str) -> float | None:
    for key in (inclusive, exclusive):
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def tool_call_grammar(tools: Sequence[Mapping[str, Any]]) -> str:
    """One call of one of `tools`: `{"name": <its name>, "arguments": <its parameters schema>}`.

    Each tool is `{"name": ..., "parameters": {...}}` (OpenAI's `function` object); a tool
    without parameters takes any object.
    """
    return json_schema_grammar(_call_schema(tools), "the tool call")


def tool_calls_grammar(
    tools: Sequence[Mapping[str, Any]], head: str = "", between: str | None = None, tail: str = ""
) -> str:
    """Calls of `tools` in a family's markup: `head`, one call, then, when `between` is given,
    any number of further calls each after `between`, then `tail`. E.g. Hermes after a prompt
    that opened the first call: head "", between "\n</tool_call>\n<tool_call>\n"; each call's
    arguments validate against its tool's parameters."""
    schema = _call_schema(tools)
    json_schema_grammar(schema, "the tool call")  # a schema the engine cannot take is named here
    call = f"%json {json.dumps({**bounded_numbers(schema), 'x-guidance': JSON_OPTIONS})}"
    parts = [json.dumps(head)] if head else []
    parts.append("call")
    if between is not None:
        parts.append(f"({json.dumps(between)} call)*")
    if tail:
        parts.append(json.dumps(tail))
    grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {' '.join(parts)}\ncall: {call}")
    check_grammar(grammar, "the tool call")
    return grammar


def _call_schema(tools: Sequence[Mapping[str, Any]]) -> dict:
    if not tools:
        raise GrammarError("a tool call needs at least one tool; pass the tools the model may call")
    shapes = []
    for tool in tools:
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError("every tool needs a non-empty string 'name'")
        parameters = _schema_object(tool.get("parameters") or ANY_OBJECT, f"the parameters of tool {name!r}")
        shapes.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    return {**schema, "$defs": {"json": ANY_JSON}}


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
