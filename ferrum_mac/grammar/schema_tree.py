"""The subschemas of a JSON schema, by keyword: the one walk every rewrite of a schema takes.

Only keywords whose values are schemas are walked: a dict under `enum`, `const`, `default` or
`examples` is data, and a property named "$ref" is a name, not a reference. Definitions
(`$defs`, `definitions`) are not walked: they are reached through the references to them.
"""

from __future__ import annotations

from typing import Any, Callable

SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")  # name -> schema
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SCHEMA_SINGLES = (
    "additionalProperties",
    "items",  # a list of schemas in older drafts (walked as SCHEMA_LISTS are)
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
DEFINITIONS = ("$defs", "definitions")
# Keywords that say what a schema is about without narrowing what it accepts.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$schema", "$id"}
)


def is_schema(value: Any) -> bool:
    return isinstance(value, (dict, bool))


def with_subschemas(node: dict, change: Callable[[Any, str], Any]) -> dict:
    """A copy of `node` with each subschema `s` under keyword `k` replaced by `change(s, k)`."""
    out = dict(node)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: change(sub, key) if is_schema(sub) else sub for name, sub in out[key].items()}
    for key in (*SCHEMA_LISTS, *SCHEMA_SINGLES):
        value = out.get(key)
        if isinstance(value, list) and key in (*SCHEMA_LISTS, "items"):
            out[key] = [change(sub, key) if is_schema(sub) else sub for sub in value]
        elif is_schema(value) and key in SCHEMA_SINGLES:
            out[key] = change(value, key)
    return out


def subschemas(node: dict) -> list[Any]:
    """The schemas directly under `node` (not its definitions)."""
    found: list[Any] = []
    with_subschemas(node, lambda sub, key: found.append(sub))
    return found


def types_of(node: dict) -> frozenset[str] | None:
    """The JSON types `node` names; None when it names none (any type)."""
    kinds = node.get("type")
    if kinds is None:
        return None
    return frozenset(k for k in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(k, str))
