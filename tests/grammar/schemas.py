"""JSON schemas of the shapes agents and apps ask for: nested objects, arrays with item bounds,
enums, bounded numbers, required and optional fields, anyOf, $defs."""

from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "flat_required": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"title": {"type": "string"}, "subtitle": {"type": "string"}, "pages": {"type": "integer"}},
        "required": ["title"],
        "additionalProperties": False,
    },
    "bounded_integer": {
        "type": "object",
        "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["rating"],
    },
    "bounded_number": {
        "type": "object",
        "properties": {
            "probability": {"type": "number", "minimum": 0, "maximum": 1},
            "temp": {"type": "number", "exclusiveMinimum": -273.15},
        },
        "required": ["probability", "temp"],
    },
    "string_enum": {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"],
        "additionalProperties": False,
    },
    "mixed_enum_const": {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3, "max", None]}, "kind": {"const": "report"}},
        "required": ["level", "kind"],
    },
    "array_min_max": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4}
        },
        "required": ["tags"],
    },
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 100},
        "minItems": 1,
        "maxItems": 6,
    },
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 20},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
    "any_of_types": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}, {"type": "null"}]}
        },
        "required": ["value"],
    },
    "any_of_objects": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"circle": {"type": "number", "minimum": 0}},
                "required": ["circle"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"w": {"type": "number", "minimum": 0}, "h": {"type": "number", "minimum": 0}},
                "required": ["w", "h"],
                "additionalProperties": False,
            },
        ]
    },
    "booleans_and_null": {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 15}},
        "required": ["done", "note"],
    },
    "string_lengths": {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}},
        "required": ["code"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^\\+?[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"],
    },
    "string_formats": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"}},
        "required": ["day", "id"],
    },
    "defs_and_refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "recursive_tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 8},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["label"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "additional_properties_typed": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "all_of_merge": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ]
    },
    "multiple_of": {
        "type": "object",
        "properties": {"step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}},
        "required": ["step"],
    },
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 5}, {"type": "integer"}],
        "items": False,
    },
    "pydantic_style": {
        "title": "Event",
        "type": "object",
        "properties": {
            "name": {"title": "Name", "type": "string"},
            "date": {"title": "Date", "type": "string"},
            "participants": {"title": "Participants", "type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["name", "date", "participants"],
        "additionalProperties": False,
    },
}

TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
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
    {"name": "now"},
]
