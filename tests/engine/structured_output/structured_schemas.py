"""JSON schemas the structured-output tests generate against: every string bounded, so a
random-weight model can close them within max_tokens."""

from __future__ import annotations

NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "admin": {"type": "boolean"},
            },
            "required": ["name", "admin"],
            "additionalProperties": False,
        }
    },
    "required": ["user"],
    "additionalProperties": False,
}
ARRAY = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["tags"],
    "additionalProperties": False,
}
ENUM_RANGE = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 50},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["color", "score"],
    "additionalProperties": False,
}
OPTIONAL = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "note": {"type": "string", "maxLength": 5},
    },
    "required": ["id"],
    "additionalProperties": False,
}
REFS = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 9},
                "y": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "start": {"$ref": "#/$defs/point"},
        "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
    },
    "required": ["start", "path"],
    "additionalProperties": False,
}
PATTERN = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
    "required": ["code"],
    "additionalProperties": False,
}
ALL = {
    "nested": NESTED,
    "array": ARRAY,
    "enum_range": ENUM_RANGE,
    "optional": OPTIONAL,
    "refs": REFS,
    "pattern": PATTERN,
}
