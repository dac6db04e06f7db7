"""gpt-oss calls (OpenAI's harmony format, vLLM's `openai` parser): a call is a commentary
message to a recipient,

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or, the recipient in the role header, `<|start|>assistant to=functions.get_weather<|channel|>
commentary json<|message|>{...}<|call|>` (the output's first message starts at ` to=`: the
prompt ended with `<|start|>assistant`). The markers are special tokens, kept in the text
(keeps_special_tokens).
With `--reasoning-parser openai_gptoss` the reasoning split passes a call's messages on in the
answer (engine.reasoning.HarmonyFormat); the content is the answer's text before the first call
(a call ends the model's turn: `<|call|>` is a stop token).
"""

from __future__ import annotations

import re

from api.openai.tools.base import PartialCall, Snapshot, ToolParser
from api.openai.tools.hermes import held_tail
from engine.reasoning import role_recipient_ahead, strip_special_markers

CHANNEL = "<|channel|>"
# a call: the recipient, then the body from <|message|> to <|call|> (or the end so far)
_CALL = re.compile(
    r"to=functions\.(?P<name>[A-Za-z0-9_.-]+)[^<]*(?:<\|channel\|>[^<]*)?"
    r"(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<args>.*?)(?P<end><\|call\|>|<\|end\|>|$)",
    re.DOTALL,
)
_MARKERS = ("<|start|>", CHANNEL)


class HarmonyParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True

    def snapshot(self, text: str, final: bool) -> Snapshot:
        first = min((i for i in (text.find(m) for m in _MARKERS) if i >= 0), default=-1)
        if role_recipient_ahead(text):  # a call's role header from the start (or maybe)
            first = 0
        if first < 0:
            keep = 0 if final else max(held_tail(text, m) for m in _MARKERS)
            return Snapshot(strip_special_markers(text[: len(text) - keep]))
        snap = Snapshot(strip_special_markers(text[:first]))
        for m in _CALL.finditer(text, first):
            args = m["args"]
            if not m["end"] and not final:  # a call still being written: its arguments so far
                args = args[: len(args) - held_tail(args, "<|call|>")]
            snap.calls.append(
                PartialCall(m["name"], args.strip() if m["end"] or final else args.lstrip())
            )
        if final and not snap.calls:
            snap.content = strip_special_markers(text)
        return snap
