"""The generic tool mode on the bundled default model (SmolLM2, whose ChatML template cannot
render tools): the tools are described in the prompt and the grammar holds the reply to the
JSON envelope, so real text still yields calls whose arguments parse and match."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.openai.tools.test_tool_calls_http import raw_stream, reassemble

pytestmark = pytest.mark.slow

KEY = "sk-generic"
MODEL = "smol"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(start_server, default_model_dir):
    return start_server(default_model_dir, "--served-model-name", MODEL, "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def create(client, messages, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=100, **kwargs
    )


def check_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


def test_models_reports_generic(client):
    assert client.models.list().data[0].model_extra["tool_call_parser"] == "generic"


def test_required_call_parses_and_streams_the_same(client, server):
    r = create(client, ASK, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    check_call(call)
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 100,
    }
    content, calls, finish = reassemble(raw_stream(server, body, KEY))
    assert finish == "tool_calls" and content == ""
    assert [(n, a) for _, n, a in calls] == [(call.function.name, call.function.arguments)]


def test_auto_reply_is_an_answer_or_a_valid_call(client):
    choice = create(client, ASK).choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            check_call(call)
    else:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.content, str) and choice.message.content.strip()


def test_round_trip_final_answer(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21}'},
    ]
    choice = create(client, messages).choices[0]
    assert choice.finish_reason in ("stop", "tool_calls")
    if choice.message.tool_calls:
        for call in choice.message.tool_calls:
            check_call(call)
    else:
        assert choice.message.content.strip()
    # Without tools the history still renders (calls and results as text): a plain answer.
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
