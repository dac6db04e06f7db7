"""Mistral calls: text, then [TOOL_CALLS] and the calls, in either of Mistral's two forms:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]   (v0.3)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}   (v11+)

(the newer form may carry [CALL_ID]xxxxxxxxx before [ARGS]; the id is ours to give). The
markers are special tokens, so the plan has them kept in the text (keeps_special_tokens).
Content is the text before the first [TOOL_CALLS]; a tail that may be its start is held
back until it is decided. Mistral's templates accept only call ids of 9 letters and
digits: the ids given out have that shape, and history ids of another shape (from another
server, say) are mapped to one, the same way for a call and its result.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
from typing import Any

from api.openai.tools.base import PartialCall, Snapshot, ToolParser
from api.openai.tools.calls import read_call
from api.openai.tools.hermes import held_tail
from api.openai.tools.json_scan import array_items, skip_ws, value_end

TOOL_CALLS = "[TOOL_CALLS]"
_NAMED_CALL = re.compile(r"([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]*\s*)?\[ARGS\]")
_ALNUM = string.ascii_letters + string.digits
_ID = re.compile(r"^[A-Za-z0-9]{9}$")


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def mistral_history_id(call_id: str) -> str:
    """`call_id` if Mistral's template takes it, else 9 letters and digits derived from it."""
    if _ID.match(call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        n, r = divmod(n, len(_ALNUM))
        out.append(_ALNUM[r])
    return "".join(out)


class MistralParser(ToolParser):
    name = "mistral"
    call_id = staticmethod(mistral_call_id)
    keeps_special_tokens = True

    @staticmethod
    def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [
                    {**c, "id": mistral_history_id(c.get("id") or "")} for c in m["tool_calls"]
                ]
                m = {**m, "tool_calls": calls}
            if m.get("tool_call_id"):
                m = {**m, "tool_call_id": mistral_history_id(m["tool_call_id"])}
            out.append(m)
        return out

    def snapshot(self, text: str, final: bool) -> Snapshot:
        first = text.find(TOOL_CALLS)
        if first < 0:
            keep = 0 if final else held_tail(text, TOOL_CALLS)
            return Snapshot(text[: len(text) - keep])
        snap = Snapshot(text[:first])
        start = skip_ws(text, first + len(TOOL_CALLS))
        if text.startswith("[", start):
            _read_list(text, start, snap.calls)
        else:
            _read_named(text, start, snap.calls)
        if final and not snap.calls:
            snap.content = text  # no call could be read: the whole text is the answer
        return snap


def _read_list(text: str, start: int, calls: list[PartialCall]) -> None:
    """The v0.3 form: a JSON list of call objects."""
    for item in array_items(text, start)[0]:
        if text[item] != "{":
            return
        call, _ = read_call(text, item)
        if call is None:
            return
        calls.append(call)


def _read_named(text: str, pos: int, calls: list[PartialCall]) -> None:
    """The v11+ form: name[ARGS]{...}, each call after its own [TOOL_CALLS]. A call counts
    once its arguments object has started."""
    while (m := _NAMED_CALL.match(text, pos)) is not None:
        args = skip_ws(text, m.end())
        if not text.startswith("{", args):
            return
        end = value_end(text, args)
        calls.append(PartialCall(m.group(1), text[args : end or len(text)].rstrip()))
        if end is None:
            return
        pos = skip_ws(text, end)
        if text.startswith(TOOL_CALLS, pos):
            pos = skip_ws(text, pos + len(TOOL_CALLS))
