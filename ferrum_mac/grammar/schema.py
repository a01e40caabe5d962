"""JSON schemas, `json_object` and tool-call shapes as grammars, with errors that name what is unsupported.

A schema becomes a grammar in three steps: its references are hoisted into one table of
definitions (`refs.hoist`; a tool's parameters keep resolving inside the call's wrapper),
everything it lets a model write is bounded (`bounds`), and each cycle of references is
unrolled to a bounded depth (`refs.unroll`). Making the text is cheap and cached by schema;
compiling it against a vocabulary is `engine.compile_grammar`'s (cached by text).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

import llguidance

from ferrum_mac.errors import FerrumError
from ferrum_mac.grammar.lru import SizedLru
from ferrum_mac.grammar.bounds import RESERVED, SHARED_DEFS, bounded, strict
from ferrum_mac.grammar.refs import RefError, hoist, reachable, unroll

# Compact JSON with a space after ',' and ':' (how models write it), and no free whitespace:
# flexible whitespace lets a small model pad its output with newlines until it runs out of tokens.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
# What a function without `parameters` takes: no arguments (OpenAI's reading).
NO_ARGUMENTS: dict = {"type": "object", "properties": {}, "additionalProperties": False}
# JSON mode's answer holds at least one member: `{}` is valid JSON that says nothing, and a small
# model asked for JSON takes it every time (as it would end a free answer at once). A schema is
# left as its author wrote it.
JSON_MODE_OBJECT: dict = {"type": "object", "minProperties": 1}
# Grammar texts by what they were made from: agents send the same schemas every step.
_TEXTS = SizedLru(max_entries=512, max_bytes=64 * 2**20)


class GrammarError(FerrumError):
    """A schema or grammar the engine cannot compile; its message says what to change."""


class UnsupportedSchemaError(GrammarError):
    """A valid JSON schema using a keyword the grammar engine does not implement."""

    def __init__(self, message: str, keywords: Sequence[str]):
        super().__init__(message)
        self.keywords = tuple(keywords)


def json_schema_grammar(schema: Any, what: str = "the JSON schema", strict: bool = False) -> str:
    """The grammar of JSON text valid against `schema` (a dict or its JSON text), checked here
    (`schema_grammar` leaves that to the compile)."""
    grammar = schema_grammar(schema, what, strict)
    check_grammar(grammar, what)
    return grammar


def schema_grammar(schema: Any, what: str = "the JSON schema", strict: bool = False) -> str:
    """The grammar of JSON text valid against `schema`, not yet checked; `strict`: objects take
    only the members they name (OpenAI's strict mode)."""
    schema_json = schema if isinstance(schema, str) else json.dumps(schema)

    def make() -> str:
        taken = set(RESERVED)
        root, defs = _hoisted(_schema_object(schema_json, what), what, strict, "", taken)
        return _grammar(_document(root, defs, taken))

    return _cached(f"schema\0{what}\0{strict}\0{schema_json}", make)


def json_object_grammar() -> str:
    """Any JSON object with at least one member: `response_format` `{"type": "json_object"}`."""
    return _cached("json_object", lambda: _grammar(_document(JSON_MODE_OBJECT, {}, set(RESERVED))))


def _cached(key: str, make) -> str:
    text = _TEXTS.get(key)
    if text is None:
        text = make()
        _TEXTS.put(key, text, len(key) + len(text))
    return text


def tool_call_grammar(tools: Sequence[Mapping[str, Any]]) -> str:
    """One call of one of `tools`: `{"name": <its name>, "arguments": <its parameters schema>}`,
    checked here.

    Each tool is `{"name": ..., "parameters": {...}}` (OpenAI's `function` object, `strict`
    honoured); a tool without parameters takes none (`{}`).
    """
    grammar = call_grammar(tools)
    check_grammar(grammar, "the tool call")
    return grammar


def call_grammar(tools: Sequence[Mapping[str, Any]]) -> str:
    """`tool_call_grammar`, not yet checked (the compile, or `guard`, says what is wrong)."""
    tools_json = json.dumps(list(tools))
    return _cached(f"call\0{tools_json}", lambda: _grammar(call_document(json.loads(tools_json))))


def tool_calls_grammar(
    tools: Sequence[Mapping[str, Any]], head: str = "", between: str | None = None, tail: str = ""
) -> str:
    """Calls of `tools` in a family's markup: `head`, one call, then, when `between` is given,
    any number of further calls each after `between`, then `tail`. E.g. Hermes after a prompt
    that opened the first call: head "", between "\n</tool_call>\n<tool_call>\n"; each call's
    arguments validate against its tool's parameters. Not checked: the compile says what is wrong."""
    tools_json = json.dumps(list(tools))

    def make() -> str:
        call = f"%json {json.dumps({**call_document(json.loads(tools_json)), 'x-guidance': JSON_OPTIONS})}"
        parts = [json.dumps(head)] if head else []
        parts.append("call")
        if between is not None:
            parts.append(f"({json.dumps(between)} call)*")
        if tail:
            parts.append(json.dumps(tail))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {' '.join(parts)}\ncall: {call}")

    return _cached(json.dumps(["calls", tools_json, head, between, tail]), make)


def call_document(tools: Sequence[Mapping[str, Any]]) -> dict:
    """The JSON schema of one call of one of `tools`, each tool's definitions hoisted into its
    own part of the document's `$defs` (so its `$ref`s resolve inside the wrapper)."""
    if not tools:
        raise GrammarError("a tool call needs at least one tool; pass the tools the model may call")
    taken = set(RESERVED)
    shapes, defs = [], {}
    for tool in tools:
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError("every tool needs a non-empty string 'name'")
        what = f"the parameters of tool {name!r}"
        parameters = tool.get("parameters")
        parameters = NO_ARGUMENTS if parameters in (None, {}) else _schema_object(parameters, what)
        root, own = _hoisted(parameters, what, tool.get("strict") is True, f"{name}_", taken)
        defs.update(own)
        shapes.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": root},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return _document(shapes[0] if len(shapes) == 1 else {"anyOf": shapes}, defs, taken)


def _hoisted(schema: Any, what: str, strictly: bool, prefix: str, taken: set[str]) -> tuple[Any, dict]:
    try:
        root, defs = hoist(schema, prefix, taken)
    except RefError as e:
        raise GrammarError(f"{what} cannot be compiled: {e}") from None
    if strictly:
        root, defs = strict(root), {name: strict(d) for name, d in defs.items()}
    return root, defs


def _document(root: Any, defs: dict, taken: set[str]) -> dict:
    """`root` with `defs` as its `$defs`, everything bounded and recursion unrolled."""
    root = bounded(root)
    if not isinstance(root, dict):
        root = {"not": {}}  # `false`: nothing is valid (a bounded `true` is a reference)
    table = {name: bounded(d) for name, d in defs.items()}
    table.update(SHARED_DEFS)
    table = {name: table[name] for name in reachable(root, table)}  # the engine compiles every definition
    return {**root, "$defs": unroll(table, taken=taken)}


def _grammar(document: dict) -> str:
    # as text: llguidance cannot take a dict holding an integer past 64 bits
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(document), overrides=JSON_OPTIONS)


def check_grammar(grammar: str, what: str) -> None:
    """Raise a `GrammarError` naming the problem when the engine cannot compile `grammar`."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise grammar_error(messages[0] if messages else "the grammar engine rejected it", what)


def grammar_error(message: str, what: str) -> GrammarError:
    """The engine's `message` about `what` as an error that names what to change."""
    found = _UNIMPLEMENTED.search(message)
    if found:
        keywords = [k.strip().strip('"') for k in found.group(1).split(",") if k.strip()]
        names = ", ".join(f"'{k}'" for k in keywords)
        return UnsupportedSchemaError(
            f"{what} uses {names}, which constrained decoding does not support; remove or rewrite that keyword",
            keywords,
        )
    return GrammarError(f"{what} cannot be compiled: {one_line(message)}")


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


def one_line(text: str) -> str:
    """The engine's message without the parser state it dumps after it."""
    lines = [line for line in text.splitlines() if line.strip().startswith("Error:")]
    return " ".join((lines[0] if lines else text).split())[:300]
