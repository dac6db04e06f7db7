"""The mistral and pythonic tool-call parsers on crafted output: whole, and streamed in fixed
and random chunkings (the deltas must add up to exactly the whole-text answer); malformed
calls fall back to content; Mistral's 9-character ids; the plan's hooks for them."""

from __future__ import annotations

import json
import random
import re

import msgspec
import pytest

from api.openai.schemas import ChatCompletionRequest
from api.openai.tools import MistralParser, PythonicParser, ToolStreamer, detect_parser
from api.openai.tools.mistral import mistral_history_id
from api.openai.tools.plan import plan_tools, template_input
from engine.sampling_params import SamplingParams
from tests.api.openai.tools.test_tool_parsers import check_stream_matches, whole


def random_chunks(parser_cls, text: str, seed: int):
    """Feed `text` cut at random places (some chunks empty): (content, [(name, arguments)])."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    s = ToolStreamer(parser_cls())
    deltas = []
    for end in [*cuts, len(text)]:
        deltas += s.update(text[:end], final=end == len(text))
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.calls:
            if c.id is not None:
                calls[c.index] = [c.name, ""]
            else:
                calls[c.index][1] += c.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


def check(parser_cls, text: str):
    """Whole == streamed by 1, 3, 7 characters == streamed in random chunkings."""
    content, calls = check_stream_matches(parser_cls, text)
    for seed in range(5):
        assert random_chunks(parser_cls, text, seed) == (content or "", calls)
    return content, calls


# --- mistral ---------------------------------------------------------------------------------

V03 = (
    'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": [1, 2]}}, {"name": "get_time", "arguments": {"tz": "[ARGS] \\"CET\\""}}]'
)
V11 = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "note": "a } and [TOOL_CALLS]"}'
    "[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}"
)


def test_mistral_v03_list_with_text_before():
    content, calls = check(MistralParser, V03)
    assert content == "Checking."
    assert calls == [
        ("get_weather", '{"city": "Paris", "days": [1, 2]}'),
        ("get_time", '{"tz": "[ARGS] \\"CET\\""}'),
    ]


def test_mistral_v11_named_calls_and_call_id():
    content, calls = check(MistralParser, V11)
    assert content is None
    assert calls == [
        ("get_weather", '{"city": "Paris", "note": "a } and [TOOL_CALLS]"}'),
        ("get_time", "{}"),
    ]
    assert json.loads(calls[0][1])["note"] == "a } and [TOOL_CALLS]"


def test_mistral_holds_a_partial_marker_then_releases_it():
    s = ToolStreamer(MistralParser())
    assert [d.content for d in s.update("Hi [TOOL_")] == ["Hi "]
    assert [d.content for d in s.update("Hi [TOOL_", final=True)] == ["[TOOL_"]
    assert check(MistralParser, "Prices [in EUR] are up.") == ("Prices [in EUR] are up.", [])


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS] not json at all",
        "[TOOL_CALLS][1, 2]",
        '[TOOL_CALLS] [{"arguments": {}}]',
        "[TOOL_CALLS]get_weather[ARGS]oops",
        "Sure [TOOL_CALLS]",
    ],
)
def test_mistral_malformed_is_content(text):
    assert check(MistralParser, text) == (text, [])


def test_mistral_ids_and_history_ids():
    _, calls = ToolStreamer(MistralParser()).parse(V11)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)
    assert len({c.id for c in calls}) == 2
    assert mistral_history_id("abcDEF123") == "abcDEF123"
    mapped = mistral_history_id("call_1")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mapped) and mapped == mistral_history_id("call_1")
    assert mapped != mistral_history_id("call_2")


def _plan(parser, tool_choice="auto"):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    body = {"model": "m", "messages": [], "tools": [tool], "tool_choice": tool_choice}
    return plan_tools(msgspec.convert(body, ChatCompletionRequest), parser)


def test_mistral_plan_maps_history_ids_keeps_special_tokens_and_forced_ids():
    import asyncio

    from api.openai.tools.plan import constrain

    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    messages, extra = template_input(history, _plan("mistral"), "mistral")
    assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"]
    assert messages[2]["tool_call_id"] == mistral_history_id("call_1")
    assert history[2]["tool_call_id"] == "call_1"  # the request's own list is not changed
    assert "tools" in extra
    # auto under mistral: [TOOL_CALLS] must survive detokenizing; other parsers: unchanged.
    params = SamplingParams(max_tokens=5)
    got = asyncio.run(constrain(params, _plan("mistral"), engine=None))
    assert got.skip_special_tokens is False
    assert asyncio.run(constrain(params, _plan("pythonic"), engine=None)) is params
    assert asyncio.run(constrain(params, _plan("mistral", "none"), engine=None)) is params
    # A forced call (the envelope) still gets a Mistral-shaped id.
    forced = _plan("mistral", "required").streamer()
    _, calls = forced.parse('{"tool_calls": [{"name": "get_weather", "arguments": {}}]}')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].id)


MISTRAL_LIKE = "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}[TOOL_CALLS]"


def test_detect_mistral():
    assert detect_parser(MISTRAL_LIKE) == "mistral"


# --- pythonic --------------------------------------------------------------------------------

PYTHONIC = (
    "Let me check. "
    "[get_weather(city='Paris', days=[1, -2], opts={'deep': True, 'note': \"a ) ] ,\"}), "
    'get_time(tz="CET", when=None, scale=1.5e3, flags=(true, null)), ping()]'
    " trailing text is dropped"
)


def test_pythonic_text_then_calls():
    content, calls = check(PythonicParser, PYTHONIC)
    assert content == "Let me check. "
    assert [c[0] for c in calls] == ["get_weather", "get_time", "ping"]
    assert json.loads(calls[0][1]) == {
        "city": "Paris",
        "days": [1, -2],
        "opts": {"deep": True, "note": "a ) ] ,"},
    }
    assert json.loads(calls[1][1]) == {
        "tz": "CET",
        "when": None,
        "scale": 1500.0,
        "flags": [True, None],
    }
    assert calls[2][1] == "{}"


def test_pythonic_only_calls_and_escapes():
    text = r'[say(text="He said \"hi\" \\ café", n=3)]'
    content, calls = check(PythonicParser, text)
    assert content is None
    assert json.loads(calls[0][1]) == {"text": 'He said "hi" \\ café', "n": 3}


def test_pythonic_holds_a_possible_start():
    s = ToolStreamer(PythonicParser())
    assert [d.content for d in s.update("Ok [get_wea")] == ["Ok "]
    assert [d.content for d in s.update("Ok [get_wea", final=True)] == ["[get_wea"]
    assert check(PythonicParser, "See [1] and [note] (here).") == ("See [1] and [note] (here).", [])


@pytest.mark.parametrize(
    "text",
    [
        "[get_weather('Paris')]",  # positional
        "[get_weather(city=open('/etc/passwd').read())]",  # not a literal: never run
        "[get_weather(city=__import__('os').system('true'))]",
        "[f(x=1, x=2)]",  # repeated keyword
        "[f(**{'x': 1})]",
        "[f(x={1: 2})]",  # non-string key
        "[f(x=1e999)]",  # not finite
        "[f(x=b'raw')]",
        "[f(x=1",  # cut short
        "[f(x=-'a')]",  # a sign before a string
        "[f(x=[1)]]",  # brackets that do not pair
    ],
)
def test_pythonic_malformed_is_content(text):
    assert check(PythonicParser, text) == (text, [])


def test_pythonic_keeps_calls_before_a_malformed_one():
    text = "[a(x=1), b(2), c(y=3)]"
    assert whole(PythonicParser(), text) == (None, [("a", '{"x": 1}')])
