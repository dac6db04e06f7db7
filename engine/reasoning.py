"""Reasoning models' think sections: where the reasoning ends and the answer begins.

Qwen3 and DeepSeek-R1 style models write their reasoning between `<think>` and `</think>`
before the answer. `--reasoning-parser NAME` (vLLM's flag) names the format: the API splits
the output into `reasoning_content` and `content` (ReasoningFormat.split), and the engine
holds a request's grammar (structured output, forced tool calls) until the reasoning has
ended, so the constraint applies to the answer and not to the thinking (StartState,
RequestGrammar.wait_for).

Whether the output starts inside a think section is read from the end of the prompt, as the
chat template left it: a template that opened `<think>` for the model (DeepSeek-R1, Qwen3's
thinking variants) starts it inside; one that closed an empty section (Qwen3 with
`enable_thinking: false`) starts it in the answer; with neither, `deepseek_r1` assumes the
model thinks first and `qwen3` waits to see whether the output opens `<think>` itself.

gpt-oss writes OpenAI's harmony format instead (`openai_gptoss`, vLLM's name): messages on
channels, `<|channel|>analysis<|message|>...<|end|>` (the reasoning), then
`<|start|>assistant<|channel|>final<|message|>...<|return|>` (the answer). Its markers are
special tokens, so the API keeps special tokens in the text it splits (keeps_special_tokens);
the parts it returns hold none, but a tool call (a commentary message to `functions.NAME`, the
recipient in its channel header or in its role header: `<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>`), which it passes on whole (headers included) in the
answer for the `openai` tool parser (api/openai/tools/harmony.py).
A new format is one entry in REASONING_FORMATS. No torch here.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

# How many of the prompt's last tokens are read for an opened or closed think section: the
# generation prompt's tags, not a think section in an earlier turn of the conversation.
PROMPT_TAIL_TOKENS = 16


class StartState(enum.Enum):
    REASONING = "reasoning"  # the output starts inside the think section
    ANSWER = "answer"  # the prompt closed the section: no reasoning in the output
    UNDECIDED = "undecided"  # reasoning only if the output opens the section itself


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # With no tag in the prompt's tail: does the model think first (DeepSeek-R1's older
    # templates did not write the opening tag) or only when it writes `start` (Qwen3)?
    thinks_unprompted: bool = False
    # whether split reads special tokens (harmony's markers): the text must keep them
    keeps_special_tokens: bool = False

    def start_state(self, prompt_tail: str) -> StartState:
        """The output's start state from the prompt's last PROMPT_TAIL_TOKENS tokens' text."""
        opened, closed = prompt_tail.rfind(self.start), prompt_tail.rfind(self.end)
        if opened > closed:
            return StartState.REASONING
        if closed >= 0:
            return StartState.ANSWER
        return StartState.REASONING if self.thinks_unprompted else StartState.UNDECIDED

    def split(self, text: str, state: StartState, final: bool) -> tuple[str | None, str]:
        """(reasoning, answer) of the output text so far; reasoning None where the output has
        no think section. Until `final`, a tag cut off at the end is held back (it is neither
        part yet), so successive splits of a growing text only ever append to both parts."""
        if state is StartState.ANSWER:
            return None, text
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start) :]
        elif not final and self.start.startswith(body):  # nothing yet, or a cut-off tag
            return ("" if state is StartState.REASONING else None), ""
        elif state is StartState.UNDECIDED:
            return None, text
        else:
            body = text
        i = body.find(self.end)
        if i >= 0:
            return body[:i], body[i + len(self.end) :].lstrip()
        if not final:
            body = body[: len(body) - _cut_off(body, self.end)]
        return body, ""


def _cut_off(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper beginning of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# One harmony message: its role header (`<|start|>assistant`, maybe with a recipient: ` to=
# functions.f`; the output's first message has only what follows the prompt's `<|start|>
# assistant`), its channel header (channel, then maybe a recipient and a constraint) and its
# body up to the marker that ends it (a next `<|start|>` is left to the next message), or the
# end of the text so far.
_HARMONY_MESSAGE = re.compile(
    r"(?:(?:^|<\|start\|>)(?P<role>[^<]*))?"
    r"<\|channel\|>(?P<channel>[^<\s]*)(?P<header>[^<]*(?:<\|constrain\|>[^<]*)?)<\|message\|>"
    r"(?P<body>.*?)(?P<stop><\|end\|>|<\|return\|>|<\|call\|>|(?=<\|start\|>)|$)",
    re.DOTALL,
)


def role_recipient_ahead(text: str) -> bool:
    """Whether the output text starts, or may still start, with its first message's role
    header naming a recipient (" to=functions.f<|channel|>...": the prompt wrote the
    `<|start|>assistant` before it); such a beginning is a call's, not answer text."""
    head = text.lstrip()
    return bool(head) and (head.startswith("to=") or "to=".startswith(head))


_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def strip_special_markers(text: str) -> str:
    """text without harmony's special-token markers (`<|channel|>`, `<|end|>`, ...)."""
    return _SPECIAL.sub("", text)


@dataclass(frozen=True, slots=True)
class HarmonyFormat(ReasoningFormat):
    """gpt-oss's channels: analysis messages are the reasoning, final ones the answer."""

    def start_state(self, prompt_tail: str) -> StartState:
        return StartState.REASONING  # every reply opens with a channel header

    def split(self, text: str, state: StartState, final: bool) -> tuple[str | None, str]:
        if not final:  # a marker still being written is held back
            cut = text.rfind("<|")
            if cut >= 0 and text.find("|>", cut) < 0:
                text = text[:cut]
            elif text.endswith("<"):
                text = text[:-1]
        if "<|channel|>" not in text:  # no harmony (yet): plain text is the answer
            if not final and (
                "<|channel|>".startswith(text.lstrip()) or role_recipient_ahead(text)
            ):
                return "", ""
            return "", strip_special_markers(text)
        reasoning, answer = [], []
        for m in _HARMONY_MESSAGE.finditer(text):
            role = m["role"] or ""
            if "to=" in role + m["header"]:  # a tool call: passed on whole for the tool
                # parser, from its role header where the recipient is there
                start = m.start() if "to=" in role else m.start("channel") - len("<|channel|>")
                answer.append(text[start : m.end()])
                continue
            if m["channel"] == "analysis":
                reasoning.append(m["body"])
            elif m["channel"] in ("final", "commentary"):  # commentary: a preamble
                answer.append(m["body"])
        return "".join(reasoning), "".join(answer)


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", thinks_unprompted=True),
    "openai_gptoss": HarmonyFormat(
        "openai_gptoss",
        start="<|channel|>analysis<|message|>",
        end="<|channel|>final<|message|>",  # the grammar of structured outputs applies after
        keeps_special_tokens=True,
    ),
}
REASONING_PARSER_CHOICES = tuple(REASONING_FORMATS)
