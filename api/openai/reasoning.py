"""--reasoning-parser in chat replies: the think section as `reasoning_content`.

The format and the split are the engine's (engine.reasoning: the engine also holds a
grammar until the thinking ends); here a request gets its ReasoningSplit: where its output
starts, read from its prompt's last tokens, and whether the reply carries the thinking
(vLLM's `include_reasoning`). ChatFormatter applies it before content and tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.reasoning import PROMPT_TAIL_TOKENS, REASONING_FORMATS, ReasoningFormat, StartState


@dataclass(slots=True, frozen=True)
class ReasoningSplit:
    format: ReasoningFormat
    state: StartState
    include: bool = True

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, the answer's text) of a choice's output so far."""
        return self.format.split(text, self.state, final)


def reasoning_split(
    parser: str | None, tokenizer: Any, prompt: list[int], data: Any
) -> ReasoningSplit | None:
    """The request's split, or None without --reasoning-parser."""
    fmt = REASONING_FORMATS.get(parser or "")
    if fmt is None:
        return None
    tail = tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return ReasoningSplit(fmt, fmt.start_state(tail), include=data.include_reasoning)
