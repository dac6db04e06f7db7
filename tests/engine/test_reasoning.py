"""Reasoning formats (engine.reasoning): where a think section starts and ends, split as the
text grows; and the engine holding a grammar until the thinking ends."""

from __future__ import annotations

import pytest

from engine.reasoning import REASONING_FORMATS, StartState

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"]
OPEN, ANSWER, UNDECIDED = StartState.REASONING, StartState.ANSWER, StartState.UNDECIDED


def test_start_state_from_the_prompts_end():
    assert QWEN3.start_state("<|im_start|>assistant\n<think>\n") is OPEN
    assert QWEN3.start_state("assistant\n<think>\n\n</think>\n\n") is ANSWER
    assert QWEN3.start_state("<|im_start|>assistant\n") is UNDECIDED
    assert R1.start_state("<|im_start|>assistant\n") is OPEN  # R1 thinks unprompted
    assert R1.start_state("<think>\n\n</think>\n\n") is ANSWER


@pytest.mark.parametrize(
    ("fmt", "state", "text", "want"),
    [
        (R1, OPEN, "plan it</think>\n\nThe answer.", ("plan it", "The answer.")),
        (R1, OPEN, "<think>plan</think>ok", ("plan", "ok")),  # a repeated opening tag
        (R1, OPEN, "never ends", ("never ends", "")),  # cut off by max_tokens: all thinking
        (QWEN3, UNDECIDED, "<think>a</think>b", ("a", "b")),
        (QWEN3, UNDECIDED, "  <think>a</think>b", ("a", "b")),
        (QWEN3, UNDECIDED, "just an answer", (None, "just an answer")),
        (QWEN3, ANSWER, "<think>not a section</think>", (None, "<think>not a section</think>")),
    ],
)
def test_split_of_a_whole_output(fmt, state, text, want):
    assert fmt.split(text, state, final=True) == want


@pytest.mark.parametrize(
    ("fmt", "state", "text"),
    [
        (R1, OPEN, "let me think</think>\n\nParis."),
        (QWEN3, UNDECIDED, "<think>hmm, </thin not yet</think> Answer </think> after"),
        (QWEN3, UNDECIDED, "<thought>no section"),
        (R1, OPEN, "a < b and </ c </think>x"),
    ],
)
def test_streamed_splits_only_append(fmt, state, text):
    """Every prefix's split extends the previous one, and the last equals the whole split:
    a cut-off tag is held back, never sent and taken back."""
    before = (None, "")
    for n in range(len(text) + 1):
        reasoning, answer = fmt.split(text[:n], state, final=False)
        assert answer.startswith(before[1])
        if before[0] is not None:
            assert reasoning is not None and reasoning.startswith(before[0])
        before = (reasoning, answer)
    whole = fmt.split(text, state, final=True)
    assert whole[1].startswith(before[1])
    assert before[0] is None or whole[0].startswith(before[0])


def test_a_cut_off_end_tag_is_held_until_final():
    assert R1.split("thinking</thi", OPEN, final=False) == ("thinking", "")
    assert R1.split("thinking</thi", OPEN, final=True) == ("thinking</thi", "")


def test_the_grammar_waits_for_the_thinking_to_end(tiny_reasoning_dir):
    """With --reasoning-parser and a prompt that opens the think section, the grammar lets
    the thinking pass (here one `</think>` token, pushed by logit_bias) and holds the answer
    to the choice; without it, the grammar applies from the first token, and </think> never
    comes out."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams, StructuredOutputsParams

    choices = ["yes", "no"]
    results = {}
    for parser in ("deepseek_r1", None):
        llm = LLM(
            str(tiny_reasoning_dir),
            dtype="float32",
            num_kv_blocks=64,
            max_model_len=256,
            reasoning_parser=parser,
        )
        end = llm.tokenizer.encode("</think>", add_special_tokens=False)
        assert len(end) == 1
        params = SamplingParams(
            max_tokens=12,
            temperature=0.0,
            logit_bias={end[0]: 100.0},
            structured_outputs=StructuredOutputsParams(choice=choices),
        )
        prompt = llm.tokenizer.encode("Is it? <think>\n", add_special_tokens=False)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        results[parser] = (list(out.token_ids), out.finish_reason)
        text = llm.tokenizer.decode(out.token_ids, skip_special_tokens=False)
        results[parser] += (text,)
        llm.shutdown()
    ids, reason, text = results["deepseek_r1"]
    assert ids[0] == end[0] and reason == "stop"
    assert text.split("</think>", 1)[1] in choices
    ids, reason, text = results[None]
    assert end[0] not in ids and text in choices and reason == "stop"


HARMONY = REASONING_FORMATS["openai_gptoss"]
_A = "<|channel|>analysis<|message|>"
_F = "<|start|>assistant<|channel|>final<|message|>"
_CALL = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1}<|call|>'
# the recipient in the role header (gpt-oss writes both forms); the output's first message
# starts after the prompt's `<|start|>assistant`, at " to="
_ROLE_CALL = ' to=functions.f<|channel|>commentary json<|message|>{"x": 1}<|call|>'
_ROLE_CALL_CONSTRAIN = (
    "<|start|>assistant to=functions.f<|channel|>commentary <|constrain|>json<|message|>"
    '{"x": 1}<|call|>'
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (f"{_A}User asks: 2 < 3?<|end|>{_F}Yes, 2 < 3.<|return|>", ("User asks: 2 < 3?", "Yes, 2 < 3.")),
        (f"{_A}still thinking", ("still thinking", "")),  # cut off by max_tokens
        (f"{_A}a<|end|><|start|>assistant{_A}b<|end|>{_F}c", ("ab", "c")),  # two analyses
        # a tool call on the commentary channel is passed on whole (for the openai tool
        # parser); a preamble is answer
        (f"{_A}t<|end|><|start|>assistant{_CALL}", ("t", _CALL)),
        (f"{_A}t<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>",
         ("t", "Checking.")),
        ("no channels at all<|return|>", ("", "no channels at all")),
        (_ROLE_CALL, ("", _ROLE_CALL)),  # the whole output one call
        (f"{_A}t<|end|><|start|>assistant{_ROLE_CALL}", ("t", f"<|start|>assistant{_ROLE_CALL}")),
        (f"{_A}t<|end|>{_ROLE_CALL_CONSTRAIN}", ("t", _ROLE_CALL_CONSTRAIN)),
        # a preamble (no recipient), then a call whose role header repeats after it
        (f"<|channel|>commentary<|message|>Checking.<|end|>{_ROLE_CALL_CONSTRAIN}",
         ("", f"Checking.{_ROLE_CALL_CONSTRAIN}")),
        ("to be or not", ("", "to be or not")),  # plain text that starts like a recipient
    ],
)  # fmt: skip
def test_harmony_split_of_a_whole_output(text, want):
    """gpt-oss's harmony messages: analysis is the reasoning, final (and a commentary
    preamble) the answer; no special token in either part but a tool call's."""
    assert HARMONY.split(text, OPEN, final=True) == want
    assert HARMONY.keeps_special_tokens and HARMONY.start_state("<|start|>assistant") is OPEN


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (f"{_A}2 < 3, so<|end|>{_F}yes <| not a marker |> done<|return|>",
         ("2 < 3, so", "yes <| not a marker |> done")),
        (_ROLE_CALL, ("", _ROLE_CALL)),
        (f"{_A}t<|end|>{_ROLE_CALL_CONSTRAIN}", ("t", _ROLE_CALL_CONSTRAIN)),
    ],
)  # fmt: skip
def test_harmony_streamed_splits_only_append(text, want):
    """Character by character, both parts only grow, up to the whole output's split: a
    call's role header is never answer text first."""
    before = ("", "")
    for n in range(len(text) + 1):
        reasoning, answer = HARMONY.split(text[:n], OPEN, final=False)
        assert reasoning.startswith(before[0]) and answer.startswith(before[1]), text[:n]
        before = (reasoning, answer)
    assert HARMONY.split(text, OPEN, final=True) == before == want
