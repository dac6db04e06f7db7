"""Engine outputs -> OpenAI bodies and SSE chunks (no server: the formatters are pure)."""

from __future__ import annotations

import msgspec
import pytest
from transformers import AutoTokenizer

from api.openai.formatting import ChatFormatter, CompletionFormatter, usage_of
from api.openai.streaming import sse_event
from api.server.errors import APIError
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def out(texts, tokens, finish=None, rid="r", cached=0, logprobs=None, prompt=(1, 2, 3)):
    outputs = [
        CompletionOutput(
            index=i,
            text=t,
            token_ids=list(tokens[i]),
            finish_reason=finish[i] if finish else None,
            logprobs=logprobs[i] if logprobs else None,
        )
        for i, t in enumerate(texts)
    ]
    done = finish is not None and all(f is not None for f in finish)
    return RequestOutput(rid, None, list(prompt), outputs, done, num_cached_tokens=cached)


def encode(obj):
    return msgspec.json.decode(msgspec.json.encode(obj))


def test_chat_stream_chunks_follow_openai_order(tok):
    fmt = ChatFormatter("chatcmpl-1", "m", tok, SamplingParams(n=1), logprobs=False)
    events = fmt.start_events(None)
    events += fmt.update_events(0, out(["He"], [[10]]), None)
    events += fmt.update_events(0, out(["Hello"], [[10, 11]]), None)
    events += fmt.update_events(0, out(["Hello!"], [[10, 11, 12]], finish=["stop"]), None)
    bodies = [encode(e) for e in events]
    assert [b["choices"][0]["delta"] for b in bodies] == [
        {"role": "assistant", "content": ""},
        {"content": "He"},
        {"content": "llo"},
        {"content": "!"},
        {},
    ]
    assert [b["choices"][0]["finish_reason"] for b in bodies] == [None] * 4 + ["stop"]
    assert all(b["object"] == "chat.completion.chunk" and b["id"] == "chatcmpl-1" for b in bodies)
    assert all(b["usage"] is None for b in bodies)  # include_usage: null until the last chunk
    # Without include_usage the field is absent, as OpenAI sends it.
    assert "usage" not in encode(fmt.start_events(msgspec.UNSET)[0])


def test_sse_framing():
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'


def test_usage_counts_every_choice_and_cached_tokens():
    outputs = [
        out(["a", "bc"], [[1], [2, 3]], finish=["stop", "length"], cached=16, prompt=range(20)),
        out(["d", "e"], [[4], [5]], finish=["stop", "stop"], cached=0, prompt=range(5)),
    ]
    usage = encode(usage_of(outputs, [list(range(20)), list(range(5))]))
    assert usage == {
        "prompt_tokens": 25,
        "completion_tokens": 5,
        "total_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 16},
    }


def test_completion_indices_and_echo_for_several_prompts(tok):
    fmt = CompletionFormatter("cmpl-1", "m", tok, SamplingParams(n=2), echo=["P0 ", "P1 "])
    outputs = [
        out(["a", "b"], [[1], [2]], finish=["length", "length"], prompt=[1]),
        out(["c", "d"], [[3], [4]], finish=["stop", "length"], prompt=[2, 3]),
    ]
    body = encode(fmt.response(outputs, [[1], [2, 3]]))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "P0 a", "length"),
        (1, "P0 b", "length"),
        (2, "P1 c", "stop"),
        (3, "P1 d", "length"),
    ]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 4
    starts = [encode(e)["choices"][0] for e in fmt.start_events(None)]
    assert [(c["index"], c["text"]) for c in starts] == [
        (0, "P0 "),
        (1, "P0 "),
        (2, "P1 "),
        (3, "P1 "),
    ]


def test_logprobs_in_both_formats(tok):
    ids = tok.encode("Hello world")[:2]
    lps = [
        TokenLogprobs(ids[0], -0.5, 1, [(ids[0], -0.5), (ids[1], -1.5)]),
        TokenLogprobs(ids[1], -0.25, 1, [(ids[1], -0.25), (ids[0], -2.0)]),
    ]
    text = tok.decode(ids)
    o = out([text], [ids], finish=["length"], logprobs=[lps])

    chat = encode(
        ChatFormatter("c", "m", tok, SamplingParams(logprobs=2), True).response([o], [[1]])
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5, -0.25]
    assert "".join(c["token"] for c in content) == text
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())

    comp = encode(
        CompletionFormatter("c", "m", tok, SamplingParams(logprobs=2), None).response([o], [[1]])
    )
    lp = comp["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.5, -0.25]
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [0, len(lp["tokens"][0])]
    assert all(len(t) == 2 for t in lp["top_logprobs"])


@pytest.mark.parametrize("reason, status", [("abort", 503), ("error", 500)])
def test_abort_and_error_are_not_openai_finish_reasons(tok, reason, status):
    fmt = ChatFormatter("c", "m", tok, SamplingParams(), logprobs=False)
    with pytest.raises(APIError) as exc:
        fmt.update_events(0, out(["x"], [[1]], finish=[reason]), None)
    assert exc.value.status_code == status
    with pytest.raises(APIError) as exc:
        fmt.response([out(["x"], [[1]], finish=[reason])], [[1]])
    assert exc.value.status_code == status
    # An output that never finished (the engine dropped it) is an error, not a success.
    with pytest.raises(APIError, match="aborted"):
        fmt.response([out(["x"], [[1]])], [[1]])


def _reasoning(state="reasoning", include=True):
    from api.openai.reasoning import ReasoningSplit
    from engine.reasoning import REASONING_FORMATS, StartState

    return ReasoningSplit(REASONING_FORMATS["deepseek_r1"], StartState(state), include)


def test_chat_reasoning_streams_apart_and_the_whole_reply_agrees(tok):
    """--reasoning-parser: the think section goes out as reasoning_content deltas (a cut-off
    `</think>` held back), the answer as content; the non-streaming reply says the same."""
    texts = [
        "Let me",
        "Let me think</th",
        "Let me think</think>\n\nPar",
        "Let me think</think>\n\nParis.",
    ]
    fmt = ChatFormatter("c", "m", tok, SamplingParams(), logprobs=False, reasoning=_reasoning())
    deltas = []
    for k, text in enumerate(texts):
        final = ["stop"] if k == len(texts) - 1 else None
        for e in fmt.update_events(0, out([text], [list(range(k + 1))], finish=final), None):
            deltas.append(encode(e)["choices"][0]["delta"])
    thinking = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (thinking, content) == ("Let me think", "Paris.")
    assert {"reasoning_content": "Let me"} in deltas and {"reasoning_content": " think"} in deltas
    whole = ChatFormatter("c", "m", tok, SamplingParams(), logprobs=False, reasoning=_reasoning())
    body = encode(whole.response([out([texts[-1]], [[1]], finish=["stop"])], [[1, 2, 3]]))
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me think", "Paris.")


def test_chat_reasoning_left_out_or_absent(tok):
    text = "hidden</think>shown"
    hidden = ChatFormatter(
        "c", "m", tok, SamplingParams(), False, reasoning=_reasoning(include=False)
    )
    message = encode(hidden.response([out([text], [[1]], finish=["stop"])], [[1]]))["choices"][0]
    assert (
        "reasoning_content" not in message["message"] and message["message"]["content"] == "shown"
    )
    closed = ChatFormatter("c", "m", tok, SamplingParams(), False, reasoning=_reasoning("answer"))
    message = encode(closed.response([out([text], [[1]], finish=["stop"])], [[1]]))["choices"][0]
    assert "reasoning_content" not in message["message"] and message["message"]["content"] == text
    # all thinking, cut off by max_tokens: no answer at all
    cut = ChatFormatter("c", "m", tok, SamplingParams(), False, reasoning=_reasoning())
    message = encode(cut.response([out(["still thinking"], [[1]], finish=["length"])], [[1]]))
    assert message["choices"][0]["message"] == {
        "content": None, "role": "assistant", "reasoning_content": "still thinking"
    }  # fmt: skip


def test_best_of_keeps_the_most_likely_and_counts_all(tok):
    o = out(["a", "b", "c"], [[5], [6, 7], [8]], finish=["stop", "length", "stop"])
    for c, lp in zip(o.outputs, (-3.0, -1.0, -2.0), strict=True):
        c.cumulative_logprob = lp
    fmt = CompletionFormatter(
        "c", "m", tok, SamplingParams(n=3, logprobs=0), None, n=2, logprobs=None
    )
    body = encode(fmt.response([o], [[1, 2, 3]]))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "b"), (1, "c")]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 4


def test_echo_with_logprobs_puts_the_prompt_first(tok):
    prompt = tok.encode("Hello world")[:3]
    gen = TokenLogprobs(prompt[0], -0.5, 2, [(prompt[1], -0.1)])
    o = out(["x"], [[prompt[0]]], finish=["length"], logprobs=[[gen]], prompt=prompt)
    o.prompt_logprobs = [
        None,
        TokenLogprobs(prompt[1], -1.0, 1, [(prompt[1], -1.0)]),
        TokenLogprobs(prompt[2], -2.0, 3, [(prompt[0], -0.2)]),
    ]
    params = SamplingParams(logprobs=1, prompt_logprobs=1)
    echo = ["<prompt>"]
    body = encode(
        CompletionFormatter("c", "m", tok, params, echo, n=1, logprobs=1).response([o], [prompt])
    )
    c = body["choices"][0]
    assert c["text"] == "<prompt>x"
    lp = c["logprobs"]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.5]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"]) == 4
    texts = [tok.decode([t], skip_special_tokens=False) for t in [*prompt, prompt[0]]]
    assert lp["tokens"] == texts
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(4)]
    assert "prompt_logprobs" not in c
    # echo with max_tokens 0: the prompt alone; vLLM's prompt_logprobs when asked
    fmt = CompletionFormatter(
        "c", "m", tok, params, echo, n=1, logprobs=1, echo_only=True, prompt_logprobs=True
    )
    c = encode(fmt.response([o], [prompt]))["choices"][0]
    assert c["text"] == "<prompt>" and c["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
    pl = c["prompt_logprobs"]
    assert pl[0] is None
    assert pl[1] == {str(prompt[1]): {"logprob": -1.0, "rank": 1, "decoded_token": texts[1]}}
    assert pl[2][str(prompt[2])]["rank"] == 3 and pl[2][str(prompt[0])]["rank"] == 1
