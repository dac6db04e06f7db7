"""gpt-oss's tool calls (harmony, the `openai` parser) on crafted output: whole, and streamed
in fixed and random chunkings (the deltas add up to the whole-text answer), after the
reasoning split of `openai_gptoss` hands the call on in the answer; detection from the
template."""

from __future__ import annotations

import json

from api.openai.tools import HarmonyParser, detect_parser
from engine.reasoning import REASONING_FORMATS, StartState
from tests.api.openai.tools.test_mistral_pythonic_parsers import check

HARMONY = REASONING_FORMATS["openai_gptoss"]
CALL = (
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "note": "a } and <| text"}<|call|>'
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


def test_streamed_split_and_parse_only_append():
    """Reasoning split then tool parse, character by character: every part only grows."""
    output = f"<|channel|>analysis<|message|>a < b<|end|><|start|>assistant{CALL}"
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


def test_detect_harmony_template():
    template = "{% if tools %}...{% endif %}<|start|>assistant<|channel|>final<|message|>"
    assert detect_parser(template) == "openai"
