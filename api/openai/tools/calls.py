"""Reading one call object, {"name": ..., "arguments": {...}}, from text that may be unfinished."""

from __future__ import annotations

import json

from api.openai.tools.base import PartialCall
from api.openai.tools.json_scan import ObjectScan, scan_object

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/OpenAI say arguments, Llama 3 parameters


def read_call(text: str, start: int) -> tuple[PartialCall | None, ObjectScan]:
    """text[start] is '{': the call once its name is complete (arguments so far: the raw
    value text, trailing space trimmed; "" until the value starts), and the object's scan."""
    scan = scan_object(text, start)
    name: str | None = None
    arguments = ""
    for m in scan.members:
        if m.key == "name" and m.end is not None:
            try:
                value = json.loads(text[m.start : m.end])
            except ValueError:
                value = None
            name = value if isinstance(value, str) and value else None
        elif m.key in ARGUMENT_KEYS:
            end = m.end if m.end is not None else len(text)
            arguments = text[m.start : end].rstrip()
    if name is None:
        return None, scan
    if scan.end is not None and not arguments:
        arguments = "{}"  # a call without arguments: OpenAI sends an empty object
    return PartialCall(name, arguments), scan
