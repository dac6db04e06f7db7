"""Llama 3.1/3.2 JSON calls: the reply is (after an optional <|python_tag|>) one call object,
or several separated by ';' or new lines:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A reply whose first character is not '{' is plain content.
"""

from __future__ import annotations

from api.openai.tools.base import Snapshot, ToolParser
from api.openai.tools.calls import read_call
from api.openai.tools.json_scan import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_ws(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]) and start < len(text):
            return Snapshot("")  # may be the tag, still arriving
        if start >= len(text):
            return Snapshot(text if final else "")
        if text[start] != "{":
            return Snapshot(text)
        snap = Snapshot("")
        pos: int | None = start
        while pos is not None and pos < len(text) and text[pos] == "{":
            call, scan = read_call(text, pos)
            if call is None:
                break
            snap.calls.append(call)
            if scan.end is None:
                break
            pos = skip_ws(text, scan.end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_ws(text, pos + 1)
        if final and not snap.calls:
            snap.content = text
        return snap
