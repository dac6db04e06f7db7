"""gpt-oss's tool calls (harmony, the `openai` parser) on crafted output: whole, and streamed
in fixed and random chunkings (the deltas add up to the whole-text answer), after the
reasoning split of `openai_gptoss` hands the call on in the answer; detection from the
template."""

from __future__ import annotations

import json

import pytest

from api.openai.tools import HarmonyParser, detect_parser
from engine.reasoning import REASONING_FORMATS, StartState
from tests.api.openai.tools.test_mistral_pythonic_parsers import check

HARMONY = REASONING_FORMATS["openai_gptoss"]
CALL = (
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "note": "a } and <| text"}<|call|>'
)


# the recipient in the role header: the output's first message (the prompt wrote
# `<|start|>assistant`), or a later one whose role header repeats
ROLE_CALL = (
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
)
ROLE_CALL_CONSTRAIN = (
    "<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json"
    '<|message|>{"tz": "CET"}<|call|>'
)


def test_a_call_after_the_reasoning():
    output = f"<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant{CALL}"
    reasoning, answer = HARMONY.split(output, StartState.REASONING, final=True)
    assert reasoning == "Need the weather."
    content, calls = check(HarmonyParser, answer)
    assert content is None and [name for name, _ in calls] == ["get_weather"]
    assert json.loads(calls[0][1]) == {"city": "Paris", "note": "a } and <| text"}


def test_a_preamble_then_a_call_and_plain_answers():
    answer = "Let me check.<|start|>assistant" + CALL
    content, calls = check(HarmonyParser, answer)
    assert content == "Let me check." and calls[0][0] == "get_weather"
    assert check(HarmonyParser, "Paris is sunny.") == ("Paris is sunny.", [])


def test_a_call_addressed_in_the_role_header():
    """The whole output one call (no reasoning split), or after the reasoning, the role
    header repeated; with or without <|constrain|>."""
    content, calls = check(HarmonyParser, ROLE_CALL)
    assert content is None and calls == [("get_weather", '{"city": "Paris"}')]
    output = f"<|channel|>analysis<|message|>Need the time.<|end|>{ROLE_CALL_CONSTRAIN}"
    reasoning, answer = HARMONY.split(output, StartState.REASONING, final=True)
    assert reasoning == "Need the time."
    content, calls = check(HarmonyParser, answer)
    assert content is None and calls == [("get_time", '{"tz": "CET"}')]
    reasoning, answer = HARMONY.split(ROLE_CALL, StartState.REASONING, final=True)
    assert (reasoning, check(HarmonyParser, answer)[1]) == (
        "",
        [("get_weather", '{"city": "Paris"}')],
    )


def test_a_preamble_then_a_role_header_call_and_both_forms_in_one_text():
    content, calls = check(HarmonyParser, "Let me check." + ROLE_CALL_CONSTRAIN)
    assert content == "Let me check." and calls == [("get_time", '{"tz": "CET"}')]
    content, calls = check(HarmonyParser, ROLE_CALL + "<|start|>assistant" + CALL)
    assert content is None and [name for name, _ in calls] == ["get_weather", "get_weather"]
    # plain text that starts like a recipient is content once it is not one
    assert check(HarmonyParser, "to be or not") == ("to be or not", [])


@pytest.mark.parametrize(
    "output",
    [
        f"<|channel|>analysis<|message|>a < b<|end|><|start|>assistant{CALL}",
        ROLE_CALL,
        f"<|channel|>analysis<|message|>a < b<|end|>{ROLE_CALL_CONSTRAIN}",
        f"<|channel|>commentary<|message|>Checking.<|end|>{ROLE_CALL_CONSTRAIN}",
    ],
)
def test_streamed_split_and_parse_only_append(output):
    """Reasoning split then tool parse, character by character: every part only grows, to
    the whole output's call."""
    sent = ("", "", [])
    parser = HarmonyParser()
    for n in range(len(output) + 1):
        reasoning, answer = HARMONY.split(output[:n], StartState.REASONING, final=False)
        snap = parser.snapshot(answer, final=False)
        assert reasoning.startswith(sent[0]) and snap.content.startswith(sent[1])
        for old, new in zip(sent[2], snap.calls, strict=False):
            assert new.name == old.name and new.arguments.startswith(old.arguments)
        assert len(snap.calls) >= len(sent[2])
        sent = (reasoning, snap.content, [type(c)(c.name, c.arguments) for c in snap.calls])
    assert len(sent[2]) == 1 and json.loads(sent[2][0].arguments)
    assert "to=" not in sent[0] + sent[1]  # no header leaked into reasoning or content


def test_detect_harmony_template():
    template = "{% if tools %}...{% endif %}<|start|>assistant<|channel|>final<|message|>"
    assert detect_parser(template) == "openai"
