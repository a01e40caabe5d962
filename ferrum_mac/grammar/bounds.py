"""What a grammar lets a model write, bounded so an answer always ends: numbers in digits, strings under a `format` in length.

A number without bounds lets a small model write digits until its tokens run out ("0.3333..."),
so every place a number can appear is capped at 20 significant digits: integers at 18 digits
(the engine's integer ranges are 64-bit), other numbers at 14 before the point and 6 after. That
covers untyped values too (`{}`, `true`, an object's unnamed members, `{"minimum": 0}`), which
may be numbers. A string under a `format` (an email's local part, a URI) can grow forever, so it
gets a `maxLength`. An `enum` or `const` is left exact; `not` and `if` are left alone (narrowing
inside them would widen the schema). Only the grammar is narrowed: whatever it allows still
validates against the schema as given.

A plain number, integer or any-value is a reference to one shared definition: the engine builds
a definition's lexer once, where a bound written into each of many fields costs a lexer each.
"""

from __future__ import annotations

from typing import Any

from ferrum_mac.grammar.schema_tree import ANNOTATIONS, types_of, with_subschemas

INTEGER_LIMIT = 10**18 - 1
NUMBER_LIMIT = 10**14 - 1
NUMBER_STEP = 1e-6
FORMAT_MAX_LENGTH = 256  # characters: RFC 5321 allows 254 for an email address

JSON_DEF, NUMBER_DEF, INTEGER_DEF = "ferrum_json", "ferrum_number", "ferrum_integer"
JSON_REF, NUMBER_REF, INTEGER_REF = (f"#/$defs/{name}" for name in (JSON_DEF, NUMBER_DEF, INTEGER_DEF))
RESERVED = frozenset({JSON_DEF, NUMBER_DEF, INTEGER_DEF})

# Any JSON value, its numbers capped.
SHARED_DEFS: dict[str, Any] = {
    JSON_DEF: {
        "anyOf": [
            {"type": ["null", "boolean", "string"]},
            {"$ref": NUMBER_REF},
            {"type": "array", "items": {"$ref": JSON_REF}},
            {"type": "object", "additionalProperties": {"$ref": JSON_REF}},
        ]
    },
    NUMBER_DEF: {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT, "multipleOf": NUMBER_STEP},
    INTEGER_DEF: {"type": "integer", "minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT},
}
_SKIPPED = ("not", "if", "propertyNames")  # narrowing inside would widen the schema, or cannot matter
_COMBINED = ("anyOf", "oneOf", "allOf")


def bounded(schema: Any, merged: bool = False) -> Any:
    """`schema` (a subschema; its references point at definitions bounded the same way) with
    every number, untyped value and format string bounded. A copy; `schema` is not changed.
    The result refers to SHARED_DEFS, which the document must hold. `merged`: a branch of an
    `allOf`, whose open members and items are bounded once, on the `allOf`'s own schema (the
    engine merges each branch's reference to the any-value at great cost)."""
    if schema is True:
        return schema if merged else {"$ref": JSON_REF}
    if not isinstance(schema, dict) or "enum" in schema or "const" in schema:
        return schema
    out = with_subschemas(schema, lambda sub, key: sub if key in _SKIPPED else bounded(sub, key == "allOf"))
    plain = set(out) <= ANNOTATIONS | {"type"}
    kinds = types_of(out)
    if plain and kinds is None:
        return out if merged else {"$ref": JSON_REF}
    if plain and kinds in (frozenset({"number"}), frozenset({"integer"})):
        return {"$ref": NUMBER_REF if "number" in kinds else INTEGER_REF}
    if plain and kinds and len(kinds) > 1 and kinds & {"number", "integer"}:
        return {"anyOf": [bounded({"type": kind}, merged) for kind in out["type"] if kind in kinds]}
    if "$ref" in out:
        return out  # its target is bounded
    if out.get("allOf"):
        return _bound_members(out, kinds)  # its branches bound its numbers and strings
    if kinds is None and any(out.get(k) for k in _COMBINED):
        return out  # each of its branches is bounded
    _bound_numbers(out, kinds)
    if (kinds is None or "string" in kinds) and "format" in out:
        out.setdefault("maxLength", FORMAT_MAX_LENGTH)
    return out if merged else _bound_members(out, kinds)


def _bound_members(schema: dict, kinds: frozenset[str] | None) -> dict:
    """`schema` with its unnamed object members and array items any capped value."""
    if kinds is None or "object" in kinds:
        schema.setdefault("additionalProperties", {"$ref": JSON_REF})
    if (kinds is None or "array" in kinds) and not isinstance(schema.get("items"), list):
        schema.setdefault("items", {"$ref": JSON_REF})
    return schema


def _bound_numbers(schema: dict, kinds: frozenset[str] | None) -> None:
    if kinds is None or "number" in kinds:
        _cap(schema, NUMBER_LIMIT)
        schema.setdefault("multipleOf", NUMBER_STEP)
    elif "integer" in kinds:
        _cap(schema, INTEGER_LIMIT)


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


def strict(schema: Any, merged: bool = False) -> Any:
    """`schema` as OpenAI's strict mode reads it: every object without `additionalProperties`
    takes no members but those it names. An `allOf` is left open: its branches name their
    members together, and a bound on one would refuse the others' (OpenAI's strict mode takes
    no `allOf`). `merged`: within an `allOf`."""
    if not isinstance(schema, dict):
        return schema
    out = with_subschemas(schema, lambda sub, key: strict(sub, merged or key == "allOf"))
    kinds = types_of(out)
    names_members = any(k in out for k in ("properties", "patternProperties", "required"))
    if merged or "allOf" in out:
        return out
    if (kinds is not None and "object" in kinds) or (kinds is None and names_members):
        out.setdefault("additionalProperties", False)
    return out
