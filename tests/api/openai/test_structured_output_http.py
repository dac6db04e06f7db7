"""Structured output over HTTP, end to end: a real `tessera serve` on loopback (tiny random
Llama) driven by the real openai SDK. response_format (json_object, json_schema), vLLM's
structured_outputs and guided_* on chat and completions, streaming and n=2; bad specs are
400s naming the parameter, and the server goes on serving."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine" / "structured_output"))
from structured_schemas import ALL  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "sk-structured"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    return start_server(tiny_llama_dir, "--served-model-name", MODEL, "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


CHAT = [{"role": "user", "content": "Describe a user as JSON."}]


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def _assert_valid(texts_and_reasons, schema) -> None:
    stopped = [t for t, reason in texts_and_reasons if reason == "stop"]
    assert all(reason in ("stop", "length") for _, reason in texts_and_reasons)
    assert len(stopped) * 2 > len(texts_and_reasons), texts_and_reasons
    for text in stopped:
        jsonschema.validate(json.loads(text), schema)


def assert_serves(client) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_models_lists_the_forms(server):
    r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    forms = r.json()["data"][0]["structured_outputs"]
    assert {"json_object", "json_schema", "regex", "choice", "grammar"} <= set(forms)


@pytest.mark.parametrize("name", sorted(ALL))
def test_chat_json_schema_validates(client, name):
    schema = ALL[name]
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        response_format=_json_format(schema),
        max_tokens=120,
        temperature=1.0,
        seed=11,
        n=2,
    )
    _assert_valid([(c.message.content, c.finish_reason) for c in r.choices], schema)


def test_chat_json_schema_streaming_n2(client):
    schema = ALL["refs"]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        response_format=_json_format(schema),
        max_tokens=120,
        temperature=0.8,
        seed=2,
        n=2,
        stream=True,
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    _assert_valid(list(zip(texts, reasons, strict=True)), schema)


def test_json_object_and_text(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, response_format={"type": "text"}, max_tokens=4
    )
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, r"[0-9]{3}-[a-z]{2}"),
        ({"guided_choice": ["alpha", "beta", "gamma ray"]}, r"alpha|beta|gamma ray"),
        ({"guided_grammar": 'start: "id-" /[0-9]{2}/'}, r"id-[0-9]{2}"),
        ({"structured_outputs": {"regex": r"(yes|no)!"}}, r"(yes|no)!"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, r"left|right"),
        ({"structured_outputs": {"grammar": 'start: "a"+ "b"'}}, r"a+b"),
    ],
)
def test_regex_choice_grammar_on_chat_and_completions(client, extra, pattern):
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, n=2, temperature=1.0, extra_body=extra
    )
    comp = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=40, n=2, temperature=1.0, extra_body=extra
    )
    texts = [c.message.content for c in chat.choices] + [c.text for c in comp.choices]
    reasons = [c.finish_reason for c in chat.choices] + [c.finish_reason for c in comp.choices]
    assert reasons == ["stop"] * 4, texts
    for text in texts:
        assert re.fullmatch(pattern, text), text


def test_completions_guided_json_and_structured_outputs_json_streaming(client):
    schema = ALL["enum_range"]
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        stream = client.completions.create(
            model=MODEL,
            prompt="JSON:",
            max_tokens=100,
            temperature=0.9,
            seed=4,
            n=2,
            stream=True,
            extra_body=extra,
        )
        texts, reasons = ["", ""], [None, None]
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
                reasons[c.index] = c.finish_reason or reasons[c.index]
        _assert_valid(list(zip(texts, reasons, strict=True)), schema)


def _bad(client, param: str, fragment: str, chat: bool = True, **kwargs) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        if chat:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, **kwargs)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=8, **kwargs)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == param, exc.value.body
    assert fragment in exc.value.body["message"], exc.value.body
    assert_serves(client)


def test_invalid_schema(client):
    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    _bad(
        client, "response_format.json_schema.schema", "nonsense", response_format=_json_format(bad)
    )


def test_invalid_regex_and_grammar(client):
    _bad(client, "guided_regex", "regex", extra_body={"guided_regex": "(ab"})
    _bad(client, "structured_outputs.grammar", "", chat=False,
         extra_body={"structured_outputs": {"grammar": "start: missing_rule"}})  # fmt: skip
    _bad(client, "guided_json", "not valid JSON", chat=False, extra_body={"guided_json": "{"})


def test_catastrophic_regex_and_huge_enum(client):
    _bad(client, "guided_regex", "repeats", extra_body={"guided_regex": "(a|b){300}{300}"})
    huge = {"type": "object", "properties": {"k": {"enum": [f"v{i}" for i in range(5000)]}}}
    _bad(client, "response_format.json_schema.schema", "enum", response_format=_json_format(huge))
    _bad(client, "guided_choice", "choices", extra_body={"guided_choice": list(map(str, range(5000)))})  # fmt: skip


def test_conflicting_or_malformed_constraints(client):
    _bad(
        client,
        "guided_regex",
        "at most one",
        response_format={"type": "json_object"},
        extra_body={"guided_regex": "a"},
    )
    _bad(client, "response_format.type", "json_schema", response_format={"type": "xml"})
    _bad(
        client,
        "structured_outputs",
        "exactly one",
        extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}},
    )
    _bad(
        client,
        "response_format.json_schema",
        "json_schema",
        response_format={"type": "json_schema"},
    )


def test_sdk_parse_with_a_pydantic_model(client):
    """The SDK's own structured-output helper: it sends a strict json_schema built from the
    model and parses the reply into it."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Point(BaseModel):
        x: int = Field(ge=0, le=9)
        y: int = Field(ge=0, le=9)

    class Shape(BaseModel):
        kind: Literal["circle", "square"]
        label: str = Field(max_length=5)
        corners: list[Point] = Field(max_length=2)

    parsed = []
    for seed in range(4):
        try:
            r = client.chat.completions.parse(
                model=MODEL,
                messages=CHAT,
                response_format=Shape,
                max_tokens=120,
                temperature=1.0,
                seed=seed,
            )
        except openai.LengthFinishReasonError:
            continue
        assert r.choices[0].finish_reason == "stop"
        parsed.append(r.choices[0].message.parsed)
    assert len(parsed) >= 2 and all(isinstance(p, Shape) for p in parsed)


# --- invalid schemas, regexes and grammars: client-facing messages, the right param ----------

_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
_CYCLE_NAMED = "$ref cycle: #/$defs/a → #/$defs/b → #/$defs/a"
# What llguidance's own report holds and the client must never see.
_INTERNALS = ("<state>", "<grammar>", "NoExtensionBias", "Parser:", "grammars", "x-guidance", "\n")


def _refused(server, path: str, body: dict) -> dict:
    r = httpx.post(
        server.base_url + path,
        json={"model": MODEL, "max_tokens": 8, **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert len(error["message"]) < 400, error["message"]
    for internal in _INTERNALS:
        assert internal not in error["message"], error["message"]
    return error


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": _json_format(_CYCLE)},
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", {"prompt": "x", "guided_json": _CYCLE}, "guided_json"),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"json": json.dumps(_CYCLE)}},
            "structured_outputs.json",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "ok", "parameters": {"type": "object"}},
                    },
                    {"type": "function", "function": {"name": "loop", "parameters": _CYCLE}},
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
    ],
)
def test_a_ref_cycle_is_named_in_the_clients_terms(server, client, path, body, param):
    error = _refused(server, path, body)
    assert error["param"] == param, error
    assert _CYCLE_NAMED in error["message"], error
    assert_serves(client)


def test_a_recursive_schema_that_makes_progress_still_works(client):
    node = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 3},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
        },
        "required": ["name", "children"],
        "additionalProperties": False,
    }
    schema = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, response_format=_json_format(schema), max_tokens=60, seed=3
    )
    text = r.choices[0].message.content
    assert text.startswith("{"), text
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
            "guided_json",
            'the $ref "#/$defs/missing" at #/properties/a points to nothing in the schema',
        ),
        ({"guided_json": "[1, 2]"}, "guided_json", "the JSON schema must be a JSON object"),
        ({"guided_json": "{"}, "guided_json", "not valid JSON"),
        (
            {"guided_json": {"type": "string", "pattern": "(ab"}},
            "guided_json",
            'invalid regex "(ab": unclosed group',
        ),
        (
            {"guided_json": {"$ref": "https://example.com/s.json"}},
            "guided_json",
            "points outside the schema",
        ),
        ({"guided_regex": "(ab"}, "guided_regex", "the regex does not parse: unclosed group"),
        (
            {"guided_regex": "a{3,1}"},
            "guided_regex",
            "the regex does not parse: invalid repetition",
        ),
        (
            {"guided_grammar": "start: missing_rule"},
            "guided_grammar",
            'line 1, column 8: unknown name: "missing_rule"',
        ),
        (
            {"guided_grammar": 'start: "x" /[/'},
            "guided_grammar",
            'line 1, column 8: invalid regex "[": unclosed character class',
        ),
        (
            {"guided_grammar": "start: a\na: b\nb: a"},
            "guided_grammar",
            "the grammar matches no output at all",
        ),
        (
            {"structured_outputs": {"grammar": "%%%"}},
            "structured_outputs.grammar",
            "line 1, column 2: lexer error",
        ),
    ],
)
def test_invalid_specs_get_clean_messages(server, body, param, words):
    error = _refused(server, "/v1/completions", {"prompt": "x", **body})
    assert error["param"] == param, error
    assert words in error["message"], error
    assert error["message"].startswith(f"Invalid {param}: "), error


def test_a_schema_that_is_not_an_object(server):
    body = {"messages": CHAT, "response_format": _json_format([])}  # type: ignore[arg-type]
    error = _refused(server, "/v1/chat/completions", body)
    assert error["param"] == "response_format.json_schema.schema", error
    assert "object" in error["message"], error
