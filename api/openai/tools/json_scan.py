"""A scanner for JSON that may still be arriving: where values start and (if they do) end.

Tool-call parsers stream a call's arguments as raw text fragments, so they need the span of
the `arguments` value inside a model's half-written object, not a parsed value. The scanner
never raises: a malformed or unfinished text just yields fewer complete spans.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# The scans jump with regexes (C speed) from one structural character to the next: a parser
# re-reads the whole output at every streamed delta, so a Python loop per character would
# cost seconds on a few-kilobyte call.
_WS = re.compile(r"[ \t\r\n]*")
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)
_STRUCTURE = re.compile(r'["{}\[\]]')
_PRIMITIVE_END = re.compile(r"[,}\] \t\r\n]")


def skip_ws(s: str, i: int) -> int:
    return _WS.match(s, i).end()


def string_end(s: str, i: int) -> int | None:
    """s[i] is '"': the index just past the closing quote, or None if it has not come yet."""
    m = _STRING.match(s, i)
    return m.end() if m else None


def value_end(s: str, i: int) -> int | None:
    """The index just past the complete JSON value starting at s[i] (no leading space), or
    None if it is unfinished (or malformed: its end cannot be found)."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while (m := _STRUCTURE.search(s, j)) is not None:
            c, j = m.group(), m.start()
            if c == '"':
                end = string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if c in "{[" else -1
            j += 1
            if depth == 0:
                return j
        return None
    # A number or a literal: complete only once a delimiter follows (digits may continue).
    m = _PRIMITIVE_END.search(s, i)
    return m.start() if m else None


@dataclass(slots=True)
class Member:
    key: str
    start: int  # where the value starts (after the colon and any space)
    end: int | None  # just past the value; None: unfinished


@dataclass(slots=True)
class ObjectScan:
    members: list[Member]
    end: int | None  # just past the closing brace; None: unfinished or malformed


def scan_object(s: str, i: int) -> ObjectScan:
    """s[i] is '{': its members so far; the last may be unfinished."""
    members: list[Member] = []
    j = i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            return ObjectScan(members, None)
        if s[j] == "}":
            return ObjectScan(members, j + 1)
        if s[j] == ",":
            j += 1
            continue
        if s[j] != '"':
            return ObjectScan(members, None)
        key_end = string_end(s, j)
        if key_end is None:
            return ObjectScan(members, None)
        try:
            key = json.loads(s[j:key_end])
        except ValueError:
            return ObjectScan(members, None)
        j = skip_ws(s, key_end)
        if j >= len(s) or s[j] != ":":
            return ObjectScan(members, None)
        j = skip_ws(s, j + 1)
        if j >= len(s):
            return ObjectScan(members, None)
        end = value_end(s, j)
        members.append(Member(key, j, end))
        if end is None:
            return ObjectScan(members, None)
        j = end


def array_items(s: str, i: int) -> tuple[list[int], bool]:
    """s[i] is '[': the start of each item so far, and whether the array is closed."""
    starts: list[int] = []
    j = i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            return starts, False
        if s[j] == "]":
            return starts, True
        if s[j] == ",":
            j += 1
            continue
        starts.append(j)
        end = value_end(s, j)
        if end is None:
            return starts, False
        j = end


def partial_string(raw: str) -> str:
    """The decoded text of a JSON string literal that may be cut short (raw starts with '"'):
    an unfinished escape at the end is left for later, so the result only ever grows."""
    body = raw[1:]
    complete = string_end(raw, 0) == len(raw)
    if complete:
        body = body[:-1]
    cut = body.rfind("\\")
    if cut >= 0:
        tail = body[cut:]
        # An odd run of backslashes at the end, or a short \uXXXX: wait for more.
        run = len(body) - len(body.rstrip("\\"))
        if run % 2 == 1:
            body = body[:-1]
        elif tail.startswith("\\u") and len(tail) < 6:
            body = body[:cut]
    try:
        text = json.loads('"' + body + '"')
    except ValueError:
        return ""
    if text and "\ud800" <= text[-1] <= "\udbff" and not complete:
        text = text[:-1]  # a high surrogate whose partner may still come
    return text
