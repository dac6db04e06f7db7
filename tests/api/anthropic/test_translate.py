"""A Messages body as the chat request it asks for (no server, no model)."""

from __future__ import annotations

import msgspec
import pytest

from api.anthropic.schemas import CountTokensRequest, MessagesRequest
from api.anthropic.translate import chat_request, tool_use_id
from api.openai.inputs import chat_messages
from api.server.errors import APIError


def body(**fields) -> MessagesRequest:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return msgspec.convert({**base, **fields}, MessagesRequest)


def refused(**fields) -> str:
    with pytest.raises(APIError) as exc:
        chat_request(body(**fields))
    assert exc.value.status_code == 400
    return exc.value.message


def test_sampling_fields_map_onto_the_chat_request():
    chat = chat_request(
        body(
            stop_sequences=["\n\n"],
            temperature=0.5,
            top_p=0.9,
            top_k=20,
            metadata={"user_id": "u-1"},
            stream=True,
        )
    )
    assert (chat.model, chat.max_tokens, chat.stop) == ("m", 8, ["\n\n"])
    assert (chat.temperature, chat.top_p, chat.top_k) == (0.5, 0.9, 20)
    assert chat.user == "u-1" and chat.stream is True and chat.n is None


def test_system_and_blocks_become_template_messages():
    chat = chat_request(
        body(
            system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "is_error": True,
                            "content": [{"type": "text", "text": "down"}],
                        },
                        {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "x"}},
                    ],
                },
            ],
        )
    )
    assert chat_messages(chat.messages) == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "21 C", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: down", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "And tomorrow?"},
    ]


def test_tools_and_tool_choice():
    tool = {"name": "f", "description": "d", "input_schema": {"type": "object"}}
    chat = chat_request(body(tools=[tool]))
    fn = chat.tools[0].function
    assert (fn.name, fn.description, fn.parameters) == ("f", "d", {"type": "object"})
    assert chat.tool_choice is None and chat.parallel_tool_calls is None
    for choice, expected in [("auto", "auto"), ("any", "required"), ("none", "none")]:
        assert (
            chat_request(body(tools=[tool], tool_choice={"type": choice})).tool_choice == expected
        )
    named = chat_request(
        body(
            tools=[tool],
            tool_choice={"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        )
    )
    assert named.tool_choice.function.name == "f" and named.parallel_tool_calls is False
    assert "needs the name" in refused(tools=[tool], tool_choice={"type": "tool"})
    server_tool = {"name": "web_search", "type": "web_search_20250305"}
    assert "server tools" in refused(tools=[server_tool])


def test_refusals_say_what_to_change():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    message = refused(messages=[{"role": "user", "content": [image]}])
    assert message.startswith("messages[0].content[0]: image content blocks are not supported")
    in_result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    assert "messages[0].content[0].content[0]: image" in refused(
        messages=[{"role": "user", "content": [in_result]}]
    )
    assert "prefill" in refused(
        messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    )
    assert "thinking" in refused(thinking={"type": "enabled", "budget_tokens": 1024})
    assert "tool_use_id" in refused(
        messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]
    )
    with pytest.raises(msgspec.ValidationError, match="unknown field `n`"):
        body(n=2)


def test_count_tokens_body_has_no_sampling_fields():
    count = msgspec.convert(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, CountTokensRequest
    )
    chat = chat_request(count)
    assert chat.max_tokens is None and chat.stop is None
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"model": "m", "messages": [], "max_tokens": 1}, CountTokensRequest)


def test_tool_use_ids():
    assert tool_use_id("call_abc") == "toolu_abc"
