"""/v1/responses end to end: a real `tessera serve` in keys mode (SQLite) of the tiny model
trained to call tools (tests/api/openai/tools/tool_model.py), driven by the official `openai`
SDK with database keys of two tenants, and raw SSE where the exact event lines matter.
Text, streaming, instructions, structured output, function calls, stored conversations
(previous_response_id, GET, DELETE, tenant isolation, store false), refusals, incomplete
answers and the usage ledger."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from sqlalchemy import func, select

from api.db.models import StoredResponse
from api.db.session import Database
from engine.tokenizer import Tokenizer
from tests.api.keys_http import MODEL, Admin, start_keys_server
from tests.api.openai.tools.tool_model import JSON_GREETING, PARIS, ROUND_TRIP, TOOLS
from tests.api.usage.test_usage_http import ledger

pytestmark = pytest.mark.slow

# The tool model's tools in the Responses' flat shape.
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
GREEDY = {"temperature": 0}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def env(start_server, tool_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    url = f"sqlite+aiosqlite:///{tmp / 'tessera.db'}"
    server = start_keys_server(start_server, tool_model_dir, tmp, url)
    admin = Admin(server)
    limits = {"rpm_limit": 10**6, "token_budget": 10**12}
    key_id, key = admin.create_key("responses", **limits)
    tenant = admin.key(key_id)["tenant_id"]
    _, teammate = admin.create_key("teammate", tenant_id=tenant, **limits)
    _, stranger = admin.create_key("stranger", **limits)  # a tenant of its own
    return server, {"owner": key, "teammate": teammate, "stranger": stranger}, url


def sdk(env, who: str = "owner") -> openai.OpenAI:
    server, keys, _ = env
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=keys[who], max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def client(env):
    return sdk(env)


@pytest.fixture(scope="module")
def tok(tool_model_dir):
    return Tokenizer.from_pretrained(tool_model_dir)


def create(client, input, extra: dict | None = None, **kwargs):
    kwargs.setdefault("tools", FLAT_TOOLS)
    kwargs.setdefault("max_output_tokens", 120)
    extra_body = {**GREEDY, **(extra or {})}
    return client.responses.create(model=MODEL, input=input, extra_body=extra_body, **kwargs)


def raw_events(env, body: dict) -> list[dict]:
    """The data of a streamed /v1/responses, checking each `event:` line names the type of
    the `data:` line after it, the sequence numbers count from 0, and each event is one the
    SDK's types accept."""
    server, keys, _ = env
    body = {"model": MODEL, "temperature": 0, "stream": True, "tools": FLAT_TOOLS, **body}
    headers = {"Authorization": f"Bearer {keys['owner']}"}
    events, name = [], None
    url = server.base_url + "/v1/responses"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name, (name, data)
                assert data["sequence_number"] == len(events)
                STREAM_EVENT.validate_python(data)
                events.append(data)
                name = None
    return events


def stored_count(url: str) -> int:
    async def count() -> int:
        db = Database.from_url(url)
        try:
            async with db.session() as s:
                return (await s.execute(select(func.count()).select_from(StoredResponse))).scalar()
        finally:
            await db.dispose()

    return asyncio.run(count())


# --- text --------------------------------------------------------------------------------------


def test_text_reply_is_a_completed_response(client, tok):
    r = create(client, "Say hello.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text == "Hello! How can I help?"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], tools=TOOLS)
    assert r.usage.input_tokens == len(prompt)
    assert r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_stream_helper_gives_the_greedy_text(client):
    whole = create(client, "Say hello.")
    with client.responses.stream(
        model=MODEL, input="Say hello.", tools=FLAT_TOOLS, max_output_tokens=120, extra_body=GREEDY
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text == "".join(deltas) == "Hello! How can I help?"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_events_follow_openais_order(env):
    events = raw_events(env, {"input": "Say hello."})
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress"
    text_deltas = types.count("response.output_text.delta")
    assert text_deltas > 0
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * text_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "Hello! How can I help?"
    assert events[-4]["text"] == "Hello! How can I help?"


def test_instructions_are_the_system_message(client, tok):
    r = create(client, "Say hello.", instructions="You are terse.", max_output_tokens=1)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]
    assert r.usage.input_tokens == len(tok.apply_chat_template(messages, tools=TOOLS))
    assert r.instructions == "You are terse."


def test_json_schema_output_parses(client):
    schema = {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "unit", "schema": schema, "strict": True}}
    r = create(client, "Say hello.", tools=None, text=text, max_output_tokens=60)
    assert r.status == "completed"
    assert json.loads(r.output_text)["unit"] in ("C", "F")
    assert r.text.format.type == "json_schema"
    # the model learned a JSON reply to this prompt (with the tools): the format lets it through
    r = create(client, "Greet me in JSON.", text={"format": {"type": "json_object"}})
    assert r.status == "completed" and r.output_text == JSON_GREETING, r.output_text
    assert r.text.format.type == "json_object"


# --- function tools ------------------------------------------------------------------------------


def test_the_model_calls_a_function(client):
    r = create(client, "What is the weather in Paris?")
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == PARIS
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")


def test_tool_choice_forces_a_function(client):
    r = create(client, "Say hello.", tool_choice={"type": "function", "name": "get_time"})
    calls = [item for item in r.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
    r = create(client, "Say hello.", tool_choice="required")
    assert any(item.type == "function_call" for item in r.output)
    r = create(client, "What is the weather in Paris?", tool_choice="none")
    assert not any(item.type == "function_call" for item in r.output)


def test_streamed_function_call_matches_the_whole_one(env, client):
    whole = create(client, "What is the weather in Paris?")
    events = raw_events(env, {"input": "What is the weather in Paris?", "max_output_tokens": 120})
    added = [e for e in events if e["type"] == "response.output_item.added"]
    call = next(e["item"] for e in added if e["item"]["type"] == "function_call")
    args = "".join(
        e["delta"]
        for e in events
        if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == call["id"]
    )
    assert json.loads(args) == PARIS
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == args and done["name"] == "get_weather"
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    strip = ("id", "call_id")
    assert [{k: v for k, v in i.items() if k not in strip} for i in final["output"]] == [
        {k: v for k, v in i.model_dump(exclude_none=True).items() if k not in strip}
        for i in whole.output
    ]


# --- stored conversations ------------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation(client, tok):
    first = create(client, "What is the weather in Paris?")
    call = next(item for item in first.output if item.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    second = create(client, [result], previous_response_id=first.id)
    # What the model learned for ROUND_TRIP: it needs the call's result from the first turn.
    assert second.output_text.startswith("It is 21 C in Paris")
    assert second.previous_response_id == first.id
    history = [{**m, "content": m.get("content") or ""} for m in ROUND_TRIP]
    history[1]["content"] = first.output_text  # the first turn's text before its call
    assert second.usage.input_tokens == len(tok.apply_chat_template(history, tools=TOOLS))
    # The same conversation sent whole (the first output items sent back as input).
    sent_back = [item.model_dump(exclude_none=True) for item in first.output]
    whole = create(
        client, [{"role": "user", "content": ROUND_TRIP[0]["content"]}, *sent_back, result]
    )
    assert whole.output_text == second.output_text
    assert whole.usage.input_tokens == second.usage.input_tokens


def test_get_and_delete_belong_to_the_tenant(env, client):
    r = create(client, "Say hello.", metadata={"topic": "greeting"}, user="u-1")
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    assert got.metadata == {"topic": "greeting"} and got.user == "u-1"
    assert sdk(env, "teammate").responses.retrieve(r.id).id == r.id  # same tenant
    stranger = sdk(env, "stranger")
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        create(stranger, "Say hello.", previous_response_id=r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        create(client, "Say hello.", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_store_false_stores_nothing(env, client):
    url = env[2]
    before = stored_count(url)
    r = create(client, "Say hello.", store=False, max_output_tokens=2)
    assert stored_count(url) == before
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    create(client, "Say hello.", max_output_tokens=2)  # store defaults to true
    assert stored_count(url) == before + 1
    with client.responses.stream(
        model=MODEL, input="Say hello.", tools=FLAT_TOOLS, max_output_tokens=120, extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == "Hello! How can I help?"
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text


# --- refusals and limits -------------------------------------------------------------------------


def test_unsupported_parts_are_400s_that_store_nothing(env, client):
    url = env[2]
    before = stored_count(url)
    with pytest.raises(openai.BadRequestError) as e:
        create(client, "Say hello.", tools=[{"type": "web_search"}, *FLAT_TOOLS])
    assert "web_search" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        create(client, "Say hello.", background=True)
    assert e.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as e:
        create(client, [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    assert "input_image" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        create(client, "Say hello.", extra={"frequency_penalty": 1})
    assert "frequency_penalty" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        create(client, "Say hello.", max_output_tokens=10**6)  # past the context
    assert stored_count(url) == before


def test_max_output_tokens_makes_it_incomplete(env, client):
    r = create(client, "Say hello.", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"
    events = raw_events(env, {"input": "Say hello.", "max_output_tokens": 2})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_usage_rows_as_chat(env, client):
    r = create(client, "Say hello.", user="ledger-user", max_output_tokens=3)
    deadline = time.monotonic() + 20
    while r.id not in (rows := ledger(env[2])) and time.monotonic() < deadline:
        time.sleep(0.2)  # the ledger is written in batches
    row = rows[r.id]
    assert row.status_code == 200 and row.model == MODEL and row.end_user == "ledger-user"
    assert row.prompt_tokens == r.usage.input_tokens
    assert row.completion_tokens == r.usage.output_tokens


def test_openapi_documents_the_routes(env):
    server = env[0]
    doc = httpx.get(server.base_url + "/docs/openapi.json", timeout=30).json()
    post = doc["paths"]["/v1/responses"]["post"]
    assert {"400", "401", "403", "404", "429", "503"} <= set(post["responses"])
    item = doc["paths"]["/v1/responses/{response_id}"]
    assert {"get", "delete"} <= set(item) and "404" in item["get"]["responses"]
