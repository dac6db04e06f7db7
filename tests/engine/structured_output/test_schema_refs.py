"""The $ref check a JSON schema passes before the grammar engine sees it (no model needed),
and llguidance's error reports cleaned into client-facing messages."""

from __future__ import annotations

import pytest

from engine.structured_output import GrammarError
from engine.structured_output.llguidance_backend import _clean
from engine.structured_output.schema_refs import check_schema_refs


def _cycle_of(schema: dict) -> str:
    with pytest.raises(GrammarError) as exc:
        check_schema_refs(schema)
    message = str(exc.value)
    assert message.startswith("the schema has a $ref cycle: "), message
    return message.removeprefix("the schema has a $ref cycle: ").split(" (")[0]


def _node(children: str = "children") -> dict:
    return {
        "type": "object",
        "properties": {children: {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    }


@pytest.mark.parametrize(
    "schema, cycle",
    [
        (  # the issue's own: two definitions that only point at each other
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            },
            "#/$defs/a → #/$defs/b → #/$defs/a",
        ),
        ({"$ref": "#"}, "# → #"),
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#/$defs/a → #/$defs/a"),
        (  # through allOf: every branch applies to the same value
            {
                "$defs": {"a": {"allOf": [{"type": "string"}, {"$ref": "#/$defs/a"}]}},
                "$ref": "#/$defs/a",
            },
            "#/$defs/a → #/$defs/a/allOf/1 → #/$defs/a",
        ),
        (  # anyOf / oneOf whose every branch leads back
            {
                "$defs": {
                    "a": {"anyOf": [{"$ref": "#/$defs/b"}, {"$ref": "#/$defs/a"}]},
                    "b": {"oneOf": [{"$ref": "#/$defs/a"}]},
                },
                "$ref": "#/$defs/a",
            },
            "#/$defs/a → #/$defs/a/anyOf/0 → #/$defs/b → #/$defs/b/oneOf/0 → #/$defs/a",
        ),
        (  # a cycle below a property is still one (llguidance compiles it, then never ends)
            {
                "type": "object",
                "properties": {"x": {"$ref": "#/definitions/loop"}},
                "definitions": {"loop": {"$ref": "#/definitions/loop"}},
            },
            "#/definitions/loop → #/definitions/loop",
        ),
        (  # pointers are escaped (RFC 6901) and percent-decoded
            {
                "$defs": {"a/b": {"$ref": "#/$defs/a~1b"}, "c%": {"$ref": "#/$defs/c%25"}},
                "$ref": "#/$defs/a~1b",
            },
            "#/$defs/a~1b → #/$defs/a~1b",
        ),
    ],
)
def test_unproductive_cycles_are_named(schema, cycle):
    assert _cycle_of(schema) == cycle


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"node": _node()}, "$ref": "#/$defs/node"},  # a tree: the array makes progress
        {  # a linked list: the object makes progress
            "$defs": {
                "item": {
                    "type": "object",
                    "properties": {"next": {"anyOf": [{"$ref": "#/$defs/item"}, {"type": "null"}]}},
                }
            },
            "$ref": "#/$defs/item",
        },
        {"type": "object", "properties": {"self": {"$ref": "#"}}},  # the root, recursively
        {
            "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}},
            "$ref": "#/$defs/a",
        },
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"},
        {
            "allOf": [{"$ref": "#/$defs/s"}, {"$ref": "#/$defs/s"}],
            "$defs": {"s": {"type": "string"}},
        },
        {"$ref": "#/properties/x", "properties": {"x": {"type": "integer"}}},
        {"$defs": {"t": True}, "$ref": "#/$defs/t"},
        {"$ref": "https://example.com/other.json"},  # not local: the engine's to refuse
        {"$defs": {"a": {"$id": "other", "$ref": "#/$defs/a"}}},  # a nested $id: left alone
        {"type": "object", "properties": {"k": {"const": {"$ref": "#"}}}},  # data, not a $ref
        {"type": "string"},
    ],
)
def test_schemas_that_make_progress_pass(schema):
    check_schema_refs(schema)


def test_a_tree_of_many_definitions_is_linear():
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
    defs["d3000"] = {"type": "string"}
    check_schema_refs({"$defs": defs, "$ref": "#/$defs/d0"})
    defs["d3000"] = {"$ref": "#/$defs/d0"}
    assert _cycle_of({"$defs": defs, "$ref": "#/$defs/d0"}).count("→") == 3001


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"$ref": "#/$defs/missing"}, 'the $ref "#/$defs/missing" at the root points to nothing'),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/definitions/b"}}},
            'the $ref "#/definitions/b" at #/properties/a points to nothing',
        ),
        (
            {"$ref": "#/required/0", "required": ["x"]},
            'the $ref "#/required/0" at the root does not point to a schema',
        ),
    ],
)
def test_dangling_refs_are_named(schema, words):
    with pytest.raises(GrammarError, match="^" + words.replace("$", r"\$")):
        check_schema_refs(schema)


# What llguidance 1.9 reports (shortened), and what the client is told instead.
_STATE_DUMP = (
    'NoExtensionBias\n<state>\nTokens: ⟦⟧\n0 tokens, 0 bytes; grm_prefix: ""\nFlags:\n'
    'Parser: {\n  "compute_time_us": 5,\n  "lexer_cost": 1436\n}\nStop: NoExtensionBias\n'
    'Error: None\n</state><grammar>\n{"grammars":[{"name":"json_schema","json_schema":'
    '{"$ref":"#/$defs/a"}}]}\n</grammar>'
)


@pytest.mark.parametrize(
    "raw, kind, cleaned",
    [
        (
            _STATE_DUMP,
            "json",
            "the schema matches no output at all (look for a $ref or allOf that leads back to "
            "itself, or constraints that contradict each other)",
        ),
        (
            _STATE_DUMP.replace("json_schema", "lark"),
            "grammar",
            "the grammar matches no output at all (look for rules that only refer to each "
            "other, with no text to end on)",
        ),
        (
            'at 1(8): unknown name: "missing_rule"\n   1 | start: missing_rule\n              ^',
            "grammar",
            'line 1, column 8: unknown name: "missing_rule"',
        ),
        (
            'at 1(8): invalid regex "(ab" (in regex): regex parse error:\n    (ab\n    ^\n'
            "error: unclosed group\n   1 | start: /(ab/\n              ^",
            "regex",
            "the regex does not parse: unclosed group",
        ),
        (
            "regex parse error:\n    (ab\n    ^\nerror: unclosed group",
            "json",
            'invalid regex "(ab": unclosed group',
        ),
        (
            'at 2(4): invalid regex "[" (in regex): regex parse error:\n    [\n    ^\n'
            "error: unclosed character class\n   2 | x: /[/\n       ^",
            "grammar",
            'line 2, column 4: invalid regex "[": unclosed character class',
        ),
        (
            "Resource 'http://x/y.json' is not present in a registry and retrieving it "
            "failed: Default retriever does not fetch resources",
            "json",
            'the $ref "http://x/y.json" points outside the schema; only references within it '
            '("#/$defs/...") are resolved',
        ),
        ("Invalid type: nonsense", "json", "Invalid type: nonsense"),
        ("LexerTooComplex\n<state>\nlots\n</state>", "regex", "the regex is too complex"),
        ("<state>\nunterminated", "json", "the schema is invalid"),
    ],
)
def test_engine_errors_are_cleaned(raw, kind, cleaned):
    message = _clean(raw, kind)
    assert message.startswith(cleaned), message
    for internal in ("<state>", "<grammar>", "Parser:", "grammars", "compute_time", " | "):
        assert internal not in message


def test_cleaned_messages_are_capped():
    message = _clean("Unsatisfiable schema: " + "x" * 5000, "json")
    assert len(message) <= 300 and message.endswith("…")
