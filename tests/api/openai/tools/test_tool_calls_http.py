"""Tool calling end to end: a real `tessera serve` of a tiny model trained to call tools
(tests/api/openai/tools/tool_model.py: Hermes template, so the hermes parser is detected), driven by the
real openai SDK, and raw SSE where the exact delta shape matters. Also the request-field
policy (unknown / unsupported fields -> 400, --lenient-request-fields)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.api.openai.tools.tool_model import PARIS, ROME, TIME, TOOLS, WEATHER

pytestmark = pytest.mark.slow

KEY = "sk-tools"
MODEL = "tool"


@pytest.fixture(scope="module")
def server(start_server, tool_model_dir):
    return start_server(tool_model_dir, "--served-model-name", MODEL, "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def create(client, messages, **kwargs):
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def raw_stream(server, body: dict, key: str = KEY) -> list[dict]:
    """The chunks of a streamed chat completion, as JSON (no SDK in between)."""
    body = {"model": MODEL, "temperature": 0, "max_tokens": 120, "stream": True, **body}
    headers = {"Authorization": f"Bearer {key}"}
    url = server.base_url + "/v1/chat/completions"
    chunks = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def reassemble(chunks: list[dict]) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """(content, [(id, name, arguments)], finish_reason), checking OpenAI's delta shape: a
    call's first delta has index, id, type, name and arguments ""; later ones only index
    and an arguments fragment."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                i = call["index"]
                if i not in calls:
                    assert set(call) == {"index", "id", "type", "function"}, call
                    assert call["type"] == "function" and call["id"].startswith("call_")
                    assert call["function"] == {"name": call["function"]["name"], "arguments": ""}
                    calls[i] = [call["id"], call["function"]["name"], ""]
                else:
                    assert set(call) == {"index", "function"}, call
                    assert set(call["function"]) == {"arguments"}, call
                    calls[i][2] += call["function"]["arguments"]
            finish = choice.get("finish_reason") or finish
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_models_names_the_detected_parser(client):
    card = client.models.list().data[0]
    assert card.model_extra["tool_call_parser"] == "hermes"


def test_auto_call_with_text_before_it(client):
    r = create(client, ask("What is the weather in Paris?"))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == PARIS


def test_streamed_call_reassembles_to_the_non_streaming_one(client, server):
    whole = create(client, ask("What is the weather in Paris?")).choices[0]
    chunks = raw_stream(server, {"messages": ask("What is the weather in Paris?"), "tools": TOOLS})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content, calls, finish = reassemble(chunks)
    assert finish == "tool_calls"
    assert content == whole.message.content
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(name, args) for _, name, args in calls] == expected
    # How many argument fragments arrive depends on timing (a stream sends the output as it
    # stands when the client is ready: steps made meanwhile come as one delta), so that the
    # arguments stream piece by piece is the parser tests' (tests/api/openai/tools/
    # test_tool_parsers.py: fed 1, 3, 7 characters at a time); here, that they add up.


def test_parallel_calls_streamed_and_whole(client, server):
    r = create(client, ask("Weather in Paris and Rome?"))
    message = r.choices[0].message
    assert message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [PARIS, ROME]
    assert len({c.id for c in message.tool_calls}) == 2
    content, calls, finish = reassemble(
        raw_stream(server, {"messages": ask("Weather in Paris and Rome?"), "tools": TOOLS})
    )
    assert content == "" and finish == "tool_calls"
    assert [json.loads(args) for _, _, args in calls] == [PARIS, ROME]


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    r = create(client, ask("Weather in Paris and Rome?"), parallel_tool_calls=False)
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [PARIS]


def test_auto_text_reply_has_no_calls(client):
    r = create(client, ask("Say hello."))
    assert r.choices[0].message.content == "Hello! How can I help?"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_round_trip_with_tool_result(client):
    first = create(client, ask("What is the weather in Paris?")).choices[0].message
    call = first.tool_calls[0]
    messages = [
        *ask("What is the weather in Paris?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    r = create(client, messages)
    assert r.choices[0].message.content == "It is 21 C in Paris."
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_none_reads_no_calls(client):
    r = create(client, ask("What is the weather in Paris?"), tool_choice="none", max_tokens=20)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def _arguments_schema(tool):
    return tool["function"]["parameters"]


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_is_enforced(client, server, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    body = {"messages": ask("Weather in Paris and Rome?"), "tools": TOOLS, "tool_choice": choice}
    if stream:
        content, calls, finish = reassemble(raw_stream(server, body))
        pairs = [(name, args) for _, name, args in calls]
    else:
        r = create(client, body["messages"], tool_choice=choice)
        content, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        pairs = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls" and content == ""
    ((name, args),) = pairs
    assert name == "get_time"
    jsonschema.validate(json.loads(args), _arguments_schema(TIME))


def test_required_is_enforced_on_a_text_prompt(client):
    r = create(client, ask("Say hello."), tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), _arguments_schema(tool))


# --- refusals --------------------------------------------------------------------------------


def post(server, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


CHAT = {"model": MODEL, "messages": ask("Say hello."), "max_tokens": 2}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, None),
    ],
)
def test_bad_tool_fields(server, extra, param):
    body = {**CHAT, "tools": TOOLS, **extra}
    err = error_of(post(server, body))
    assert err["param"] == (param or "tools[0].function.name")


def test_tool_choice_without_tools_and_tool_message_without_id(server):
    assert error_of(post(server, {**CHAT, "tool_choice": "required"}))["param"] == "tool_choice"
    messages = [*ask("hi"), {"role": "tool", "content": "21"}]
    err = error_of(post(server, {**CHAT, "messages": messages}))
    assert err["param"] == "messages[1].tool_call_id"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("functions", [{"name": "f"}]),
        ("use_beam_search", True),
        ("truncate_prompt_tokens", 5),
    ],
)
def test_unsupported_parameters_are_refused_by_name(server, field, value):
    if field == "web_search_options":
        value = {"search_context_size": "low"}
    err = error_of(post(server, {**CHAT, field: value}))
    assert err["param"] == field and err["code"] == "unsupported_parameter"


def test_unknown_field_is_refused_and_harmless_values_pass(server, client):
    err = error_of(post(server, {**CHAT, "temprature": 0.5}))
    assert err["param"] == "temprature" and err["code"] == "unknown_parameter"
    err = error_of(post(server, {"model": MODEL, "prompt": "hi", "bogus": 1}, "/v1/completions"))
    assert err["param"] == "bogus"
    # Documented as accepted and ignored, or harmless values of refused ones: 200.
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask("Say hello."),
        max_tokens=2,
        metadata={"a": "b"},
        store=False,
        service_tier="auto",
        modalities=["text"],
        extra_body={"priority": 0, "use_beam_search": False},
    )
    assert r.choices[0].finish_reason in ("stop", "length")


def test_lenient_flag_lets_unknown_fields_through(start_server, tool_model_dir):
    lenient = start_server(
        tool_model_dir,
        "--api-key",
        KEY,
        "--served-model-name",
        MODEL,
        env={"TESSERA_LENIENT_REQUEST_FIELDS": "1"},
    )
    r = post(lenient, {**CHAT, "temprature": 0.5, "x_vendor": {"a": 1}})
    assert r.status_code == 200, r.text
    # Refused parameters stay refused: leniency is for unknown names only.
    assert error_of(post(lenient, {**CHAT, "audio": {"voice": "alloy"}}))["param"] == "audio"
