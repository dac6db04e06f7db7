"""Hermes-style calls (Qwen2/2.5, Hermes, many fine-tunes): text, then one or more

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first <tool_call>; a tail that may be the start of the tag
is held back until it is decided. Text between or after the calls is dropped.
"""

from __future__ import annotations

from api.openai.tools.base import Snapshot, ToolParser
from api.openai.tools.calls import read_call
from api.openai.tools.json_scan import skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def held_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser(ToolParser):
    name = "hermes"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        first = text.find(OPEN)
        if first < 0:
            keep = 0 if final else held_tail(text, OPEN)
            return Snapshot(text[: len(text) - keep])
        snap = Snapshot(text[:first])
        pos = first
        while pos >= 0:
            body = skip_ws(text, pos + len(OPEN))
            close = text.find(CLOSE, body)
            block = text[: close if close >= 0 else len(text)]
            if body < len(block) and block[body] == "{":
                call, _ = read_call(block, body)
                if call is not None:
                    snap.calls.append(call)
            if close < 0:
                break
            pos = text.find(OPEN, close)
        if final and not snap.calls:
            snap.content = text  # no call could be read: the whole text is the answer
        return snap
