"""The mistral and pythonic parsers end to end: a real `tessera serve` of a tiny model trained
to call tools in each style (tests/api/openai/tools/tool_styles.py), driven by the openai SDK,
whole and streamed. Mistral's parser is detected from its template and its markers are
special tokens (kept in the text for it); pythonic is named with --tool-call-parser."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.api.openai.tools.tool_model import PARIS, ROME, TIME, TOOLS, build_tool_model
from tests.api.openai.tools.tool_styles import (
    HELLO,
    HELLO_Q,
    PARALLEL_Q,
    STYLES,
    WEATHER_Q,
)

pytestmark = pytest.mark.slow

KEY = "sk-styles"
MODEL = "styled"


@pytest.fixture(scope="module", params=sorted(STYLES))
def style(request):
    return request.param


@pytest.fixture(scope="module")
def client(style, start_server, tmp_path_factory):
    template, special, conversations, _ = STYLES[style]
    model_dir = build_tool_model(
        tmp_path_factory.mktemp(f"{style}-model"), template, conversations, special
    )
    args = ["--served-model-name", MODEL, "--api-key", KEY]
    if style == "pythonic":
        args += ["--tool-call-parser", "pythonic"]  # never guessed from a template
    server = start_server(model_dir, *args)
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def create(client, messages, **kwargs):
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def streamed(client, messages, **kwargs):
    """(content, [(id, name, arguments)], finish_reason) of a streamed reply, via the SDK."""
    content, calls, finish = "", {}, None
    for chunk in create(client, messages, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.function.arguments == ""
                    calls[call.index] = [call.id, call.function.name, ""]
                else:
                    calls[call.index][2] += call.function.arguments
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def id_ok(style: str, call_id: str) -> bool:
    if style == "mistral":
        return re.fullmatch(r"[A-Za-z0-9]{9}", call_id) is not None
    return call_id.startswith("call_")


def test_parser_is_the_style(client, style):
    assert client.models.list().data[0].model_extra["tool_call_parser"] == style


def test_call_after_text_whole_and_streamed(client, style):
    r = create(client, WEATHER_Q)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == STYLES[style][3]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and id_ok(style, call.id)
    assert json.loads(call.function.arguments) == PARIS
    content, calls, finish = streamed(client, WEATHER_Q)
    assert finish == "tool_calls" and content == choice.message.content
    assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]
    assert id_ok(style, calls[0][0])


def test_two_calls_and_a_text_answer(client, style):
    r = create(client, PARALLEL_Q)
    message = r.choices[0].message
    assert message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [PARIS, ROME]
    assert all(id_ok(style, c.id) for c in message.tool_calls)
    content, calls, finish = streamed(client, PARALLEL_Q)
    assert content == "" and finish == "tool_calls"
    assert [json.loads(a) for _, _, a in calls] == [PARIS, ROME]
    hello = create(client, HELLO_Q)
    # The eos token is special: kept out of the text even where special tokens are kept.
    assert hello.choices[0].message.content == HELLO
    assert hello.choices[0].message.tool_calls is None
    assert hello.choices[0].finish_reason == "stop"


def test_forced_call_and_history_with_foreign_ids(client, style):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = create(client, PARALLEL_Q, tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and id_ok(style, call.id)
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    # A history whose ids came from elsewhere ("call_1"): Mistral's template takes only
    # 9-character ids, so the server maps them (the same way for the call and its result).
    history = [
        *WEATHER_Q,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(PARIS)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = create(client, history, max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
