"""Engine outputs -> the Responses shape with --reasoning-parser (no server: the formatter is
pure): the think section becomes a reasoning item, whole and streamed alike, and the events
are ones the official SDK's types accept."""

from __future__ import annotations

import msgspec
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from transformers import AutoTokenizer

from api.openai.reasoning import ReasoningSplit
from api.openai.responses.events import EventStream
from api.openai.responses.formatting import ResponseFormatter
from api.openai.responses.schemas import ResponsesRequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.reasoning import REASONING_FORMATS, StartState
from engine.sampling_params import SamplingParams

TEXTS = [
    "Let me",
    "Let me think</th",
    "Let me think</think>\n\nPar",
    "Let me think</think>\n\nParis.",
]
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def formatter(tok) -> ResponseFormatter:
    body = msgspec.convert({"model": "m", "input": "Capital of France?"}, ResponsesRequest)
    split = ReasoningSplit(REASONING_FORMATS["deepseek_r1"], StartState.REASONING)
    return ResponseFormatter(
        "resp_1", "m", tok, SamplingParams(), body, tools=None, reasoning=split, store=False
    )


def output(text: str, k: int, finish: str | None) -> RequestOutput:
    c = CompletionOutput(index=0, text=text, token_ids=list(range(k + 1)), finish_reason=finish)
    return RequestOutput("resp_1", None, [1, 2, 3], [c], finish is not None)


def test_reasoning_is_an_item_whole(tok):
    fmt = formatter(tok)
    body = msgspec.to_builtins(fmt.response([output(TEXTS[-1], 9, "stop")], [[1, 2, 3]]))
    parsed = Response.model_validate(body)
    assert [i.type for i in parsed.output] == ["reasoning", "message"]
    assert parsed.output[0].content[0].text == "Let me think"
    assert parsed.output_text == "Paris."
    thought = len(tok.encode("Let me think", add_special_tokens=False))
    assert parsed.usage.output_tokens_details.reasoning_tokens == thought


def test_reasoning_streams_as_reasoning_text_events(tok):
    fmt = formatter(tok)
    stream = EventStream(fmt, None, None)  # type: ignore[arg-type]
    raw: list[bytes] = []
    for k, text in enumerate(TEXTS):
        finish = "stop" if k == len(TEXTS) - 1 else None
        for chunk in fmt.chat.update_events(0, output(text, k, finish), msgspec.UNSET):
            raw += stream._translate(chunk)
    events = []
    for blob in raw:
        head, data = blob.decode().strip().split("\n")
        event = msgspec.json.decode(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        STREAM_EVENT.validate_python(event)
        events.append(event)
    types = [e["type"] for e in events]
    assert types[:2] == ["response.output_item.added", "response.content_part.added"]
    assert events[0]["item"]["type"] == "reasoning"
    thinking = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thinking, answer) == ("Let me think", "Paris.")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["type"] for d in done] == ["reasoning", "message"]
    assert done[0]["content"] == [{"type": "reasoning_text", "text": "Let me think"}]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
