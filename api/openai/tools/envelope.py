"""The JSON envelope of the generic mode and of forced calls (tool_choice required or named):

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]}
    {"content": "The answer in text."}                  (auto only)

The grammar (api/openai/tools/plan.py builds its JSON schema) makes the model write exactly this;
without one (no grammar engine) a reply that is not an envelope is content as written.
"""

from __future__ import annotations

from api.openai.tools.base import Snapshot, ToolParser
from api.openai.tools.calls import read_call
from api.openai.tools.json_scan import array_items, partial_string, scan_object, skip_ws


class EnvelopeParser(ToolParser):
    name = "generic"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_ws(text, 0)
        if start >= len(text):
            return Snapshot(text if final else "")
        if text[start] != "{":
            return Snapshot(text)
        scan = scan_object(text, start)
        snap, seen = Snapshot(""), False
        for m in scan.members:
            if m.key == "content" and text.startswith('"', m.start):
                seen = True
                end = m.end if m.end is not None else len(text)
                snap.content = partial_string(text[m.start : end])
            elif m.key == "tool_calls" and text.startswith("[", m.start):
                seen = True
                for item in array_items(text, m.start)[0]:
                    if text[item] != "{":
                        break
                    call, _ = read_call(text, item)
                    if call is None:
                        break
                    snap.calls.append(call)
        if final and not seen:
            snap.content = text  # not an envelope: the reply as written
        return snap
