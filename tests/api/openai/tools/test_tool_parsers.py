"""Tool-call parsers on crafted model output: whole, and streamed a character at a time (the
deltas must add up to exactly the whole-text answer), plus the envelope's JSON schema."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from api.openai.schemas import ChatCompletionRequest
from api.openai.tools import (
    EnvelopeParser,
    HermesParser,
    Llama3JsonParser,
    ToolStreamer,
    detect_parser,
)
from api.openai.tools.json_scan import partial_string
from api.openai.tools.plan import envelope_schema, plan_tools


def stream(parser, text: str, step: int = 1, max_calls=None):
    """Feed `text` in prefixes of `step` characters: (content, [(name, arguments)], ids,
    the streamer, the raw deltas)."""
    s = ToolStreamer(parser, max_calls=max_calls)
    deltas = []
    for end in range(step, len(text) + step, step):
        deltas += s.update(text[:end], final=end >= len(text))
    content = "".join(d.content for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.calls:
            if c.id is not None:
                assert c.index not in calls and c.name and c.arguments == ""
                calls[c.index] = [c.name, "", c.id]
            else:
                calls[c.index][1] += c.arguments
    return content, [tuple(calls[i][:2]) for i in sorted(calls)], s


def whole(parser, text: str, max_calls=None):
    content, calls = ToolStreamer(parser, max_calls=max_calls).parse(text)
    return content, [(c.name, c.arguments) for c in calls]


def check_stream_matches(parser_cls, text: str, max_calls=None):
    content, calls = whole(parser_cls(), text, max_calls)
    for step in (1, 3, 7):
        s_content, s_calls, _ = stream(parser_cls(), text, step, max_calls)
        assert s_calls == calls
        assert s_content == (content or "")
    return content, calls


HERMES = (
    "Let me look that up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris \\"CET\\""}}\n'
    "</tool_call>"
)


def test_hermes_text_then_two_calls():
    content, calls = check_stream_matches(HermesParser, HERMES)
    assert content == "Let me look that up.\n"
    assert calls == [
        ("get_weather", '{"city": "Paris", "days": [1, 2]}'),
        ("get_time", '{"tz": "Europe/Paris \\"CET\\""}'),
    ]
    assert json.loads(calls[1][1]) == {"tz": 'Europe/Paris "CET"'}


def test_hermes_only_calls_has_null_content_and_max_calls():
    text = HERMES[HERMES.index("<tool_call>") :]
    content, calls = check_stream_matches(HermesParser, "\n" + text, max_calls=1)
    assert content is None
    assert [c[0] for c in calls] == ["get_weather"]


def test_hermes_holds_back_a_partial_tag_and_releases_it_at_the_end():
    s = ToolStreamer(HermesParser())
    assert [d.content for d in s.update("Hi <tool")] == ["Hi "]
    assert s.update("Hi <tool") == []
    assert [d.content for d in s.update("Hi <tool", final=True)] == ["<tool"]


def test_hermes_unreadable_call_is_content():
    text = "Sure <tool_call> not json </tool_call>"
    assert check_stream_matches(HermesParser, text) == (text, [])


def test_hermes_call_without_arguments_gets_empty_object():
    text = '<tool_call>{"name": "ping"}</tool_call>'
    assert check_stream_matches(HermesParser, text) == (None, [("ping", "{}")])


def test_llama3_json_python_tag_and_semicolons():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    content, calls = check_stream_matches(Llama3JsonParser, text)
    assert content is None
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    bare = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert check_stream_matches(Llama3JsonParser, bare) == (
        None,
        [("get_weather", '{"city": "Rome"}')],
    )


def test_llama3_json_plain_text_and_json_that_is_no_call():
    assert check_stream_matches(Llama3JsonParser, "The capital is Paris.") == (
        "The capital is Paris.",
        [],
    )
    assert check_stream_matches(Llama3JsonParser, '{"answer": 4}') == ('{"answer": 4}', [])


def test_envelope_content_streams_decoded_text():
    answer = 'He said "hi" \\ café 😀 東京\nend'
    text = json.dumps({"content": answer})  # escapes é, the emoji (surrogate pair), quotes
    assert check_stream_matches(EnvelopeParser, text) == (answer, [])


def test_envelope_calls_and_non_envelope_text():
    text = json.dumps(
        {
            "tool_calls": [
                {"name": "a", "arguments": {"x": [1, {"y": "}"}]}},
                {"name": "b", "arguments": {}},
            ]
        }
    )
    content, calls = check_stream_matches(EnvelopeParser, text)
    assert content is None
    assert calls == [("a", '{"x": [1, {"y": "}"}]}'), ("b", "{}")]
    assert check_stream_matches(EnvelopeParser, "just text") == ("just text", [])


def test_partial_string_only_grows():
    literal = json.dumps('a\\b"c\u00e9\U0001f600\n\td')
    final = json.loads(literal)
    previous = ""
    for end in range(1, len(literal) + 1):
        got = partial_string(literal[:end])
        assert final.startswith(got) and got.startswith(previous)
        previous = got
    assert previous == final


QWEN2_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools>\nReturn <tool_call>...</tool_call><|im_end|>\n{% endif %}"
)
LLAMA3_LIKE = "<|start_header_id|>system<|end_header_id|>{% if tools %}{{ tools }}{% endif %}"


def test_detect_parser():
    assert detect_parser(QWEN2_LIKE) == "hermes"
    assert detect_parser(LLAMA3_LIKE) == "llama3_json"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"
    assert detect_parser(None) is None


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city", "unit"],
            "$defs": {"unit": {"enum": ["C", "F"]}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def plan(tool_choice, parallel=None, parser="generic"):
    import msgspec

    body = {"model": "m", "messages": [], "tools": [WEATHER, TIME], "tool_choice": tool_choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    data = msgspec.convert(body, ChatCompletionRequest)
    return plan_tools(data, parser)


def valid(schema, instance) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_envelope_schema_required_named_auto():
    good = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    bad_args = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}
    time_call = {"name": "get_time", "arguments": {}}

    required = envelope_schema(plan("required"))
    assert "$defs" in required and "unit" in required["$defs"]
    assert valid(required, {"tool_calls": [good, time_call]})
    assert not valid(required, {"tool_calls": []})
    assert not valid(required, {"tool_calls": [bad_args]})
    assert not valid(required, {"tool_calls": [{"name": "nope", "arguments": {}}]})
    assert not valid(required, {"content": "hi"})

    single = envelope_schema(plan("required", parallel=False))
    assert not valid(single, {"tool_calls": [good, time_call]})

    named = envelope_schema(plan({"type": "function", "function": {"name": "get_time"}}))
    assert valid(named, {"tool_calls": [time_call]})
    assert not valid(named, {"tool_calls": [good]})

    auto = envelope_schema(plan("auto"))
    assert valid(auto, {"content": "hi"}) and valid(auto, {"tool_calls": [good]})
    assert not valid(auto, {"content": "hi", "tool_calls": [good]})


def test_plan_refusals_name_the_field():
    from api.server.errors import APIError

    with pytest.raises(APIError) as e:
        plan({"type": "function", "function": {"name": "missing"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(APIError) as e:
        plan("sometimes")
    assert e.value.param == "tool_choice"
    with pytest.raises(APIError) as e:
        plan("auto", parser=None)
    assert e.value.param == "tools"
    assert plan("none", parser=None).active is False


def test_readme_parameter_table_names_every_field():
    """The README's Request parameters table lists every field the policy knows."""
    from pathlib import Path

    from api.openai.request_fields import known_fields

    readme = Path(__file__).resolve().parents[4] / "README.md"
    text = readme.read_text()
    table = text[text.index("## Request parameters") :]
    table = table[: table.index("\n## ")]
    missing = {
        name
        for endpoint in ("chat", "completion")
        for name in known_fields(endpoint)
        if f"`{name}`" not in table and f"`{name}:" not in table
    }
    assert not missing, f"README's Request parameters table lacks {sorted(missing)}"


def test_chat_formatter_streams_calls_per_choice_and_matches_the_whole_response():
    """Two samples (n=2) streamed token by token: one replies with text, one with two calls;
    the chunks follow OpenAI's shape and add up to the non-streaming message."""
    import msgspec

    from api.openai.formatting import ChatFormatter
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams

    texts = ["Just text.", HERMES[HERMES.index("<tool_call>") :]]
    tool_plan = plan("auto", parser="hermes")
    params = SamplingParams(n=2, max_tokens=300)

    def outputs(upto: int) -> RequestOutput:
        done = upto >= max(len(t) for t in texts)
        cs = [
            CompletionOutput(i, t[:upto], list(range(min(upto, len(t)))), "stop" if done else None)
            for i, t in enumerate(texts)
        ]
        return RequestOutput("r", None, [1], cs, done)

    fmt = ChatFormatter("r", "m", None, params, False, tool_plan)
    chunks = []
    for upto in range(1, max(len(t) for t in texts) + 1, 5):
        chunks += fmt.update_events(0, outputs(upto), msgspec.UNSET)
    chunks += fmt.update_events(0, outputs(10_000), msgspec.UNSET)
    chunks = [msgspec.json.decode(msgspec.json.encode(c)) for c in chunks]
    per_choice: dict[int, list] = {0: [], 1: []}
    for c in chunks:
        (choice,) = c["choices"]
        per_choice[choice["index"]].append(choice)
    assert "".join(ch["delta"].get("content", "") for ch in per_choice[0]) == "Just text."
    assert per_choice[0][-1]["finish_reason"] == "stop"
    assert per_choice[1][-1]["finish_reason"] == "tool_calls"
    streamed: dict[int, list] = {}
    for ch in per_choice[1]:
        for call in ch["delta"].get("tool_calls", []):
            if "id" in call:
                assert call["type"] == "function" and call["function"]["arguments"] == ""
                streamed[call["index"]] = [call["id"], call["function"]["name"], ""]
            else:
                streamed[call["index"]][2] += call["function"]["arguments"]
        assert "content" not in ch["delta"]
    whole = ChatFormatter("r", "m", None, params, False, tool_plan).response(
        [outputs(10_000)], [[1]]
    )
    message = whole.choices[1].message
    assert message.content is None and whole.choices[1].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (name, args) for _, name, args in (streamed[0], streamed[1])
    ]
    assert whole.choices[0].message.content == "Just text."


def test_every_schema_field_is_in_the_policy():
    """A field added to the wire schema but not to api/openai/request_fields.py would get 400 as
    unknown: the decoded fields must be exactly the implemented ones."""
    import msgspec

    from api.openai.request_fields import CHAT_IMPLEMENTED, COMPLETION_IMPLEMENTED
    from api.openai.schemas import CompletionRequest

    def names(struct) -> set[str]:
        return {f.name for f in msgspec.structs.fields(struct)}

    assert names(ChatCompletionRequest) == CHAT_IMPLEMENTED
    assert names(CompletionRequest) == COMPLETION_IMPLEMENTED


def test_envelope_closes_open_argument_objects():
    """Arguments hold the schema's keys only (additionalProperties false where unset), also
    in nested objects and $defs; an explicit additionalProperties is kept."""
    required = envelope_schema(plan("required"))
    extra = {"name": "get_weather", "arguments": {"city": "P", "unit": "C", "type": "object"}}
    assert not valid(required, {"tool_calls": [extra]})
    assert not valid(required, {"tool_calls": [{"name": "get_time", "arguments": {"x": 1}}]})
    assert WEATHER["function"]["parameters"].get("additionalProperties") is None  # not mutated
    from api.openai.tools.plan import _close_objects

    nested = {"type": "object", "properties": {"a": {"type": "integer"}}}
    free = {"type": "object"}
    mapping = {"type": "object", "additionalProperties": nested}
    root = {"type": "object", "properties": {"n": nested, "f": free, "m": mapping}}
    closed = _close_objects(copy.deepcopy(root))
    assert closed["additionalProperties"] is False
    assert closed["properties"]["n"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["f"]  # free-form stays open
    assert closed["properties"]["m"]["additionalProperties"]["additionalProperties"] is False
