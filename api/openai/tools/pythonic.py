"""Pythonic calls (Llama 3.2 / Llama 4 style): text, then a Python list of calls with keyword
arguments,

    [get_weather(city="Paris", unit="C"), get_time(zone="CET")]

Each call is read with Python's `ast` and its argument values must be literals (strings,
numbers, True/False/None, lists, tuples, dicts with string keys; JSON's true/false/null
are taken too); nothing is ever evaluated. Arguments become a JSON object. A call is sent
once its closing parenthesis has arrived (its arguments in one fragment), so a call that
turns out malformed was never sent: the calls before it stand, and with none the whole
text is content. Content is the text before the list; a tail that may be its start is
held back until it is decided. Text after the list is dropped.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from api.openai.tools.base import PartialCall, Snapshot, ToolParser
from api.openai.tools.json_scan import skip_ws

_NAME = r"[A-Za-z_][A-Za-z0-9_.-]*"
_LIST_START = re.compile(r"\[\s*" + _NAME + r"\s*\(")
_MAYBE_START = re.compile(r"\[\s*(?:" + _NAME + r"\s*)?\Z")  # may still become _LIST_START
_CALL_HEAD = re.compile(r"(" + _NAME + r")\s*\(")
_SCAN = re.compile(r"[\"'()\[\]{}]")
_CLOSE = {")": "(", "]": "[", "}": "{"}
_WORDS = {"true": True, "false": False, "null": None}


class PythonicParser(ToolParser):
    name = "pythonic"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        m = _LIST_START.search(text)
        if m is None:
            held = None if final else _MAYBE_START.search(text)
            return Snapshot(text[: held.start()] if held else text)
        snap = Snapshot(text[: m.start()])
        _read_calls(text, m.start() + 1, snap.calls)
        if final and not snap.calls:
            snap.content = text  # no call could be read: the whole text is the answer
        return snap


def _read_calls(text: str, pos: int, calls: list[PartialCall]) -> None:
    while (head := _CALL_HEAD.match(text, skip_ws(text, pos))) is not None:
        close = _matching_paren(text, head.end() - 1)
        if close is None:
            return  # unfinished (or unbalanced): nothing of this call yet
        arguments = _arguments(text[head.end() - 1 : close])
        if arguments is None:
            return
        calls.append(PartialCall(head.group(1), arguments))
        pos = skip_ws(text, close)
        if not text.startswith(",", pos):
            return  # "]" ends the list; anything else ends the reading too
        pos += 1


def _matching_paren(text: str, i: int) -> int | None:
    """text[i] is '(': the index just past its partner, skipping brackets inside strings;
    None while unfinished or if the brackets do not pair."""
    stack: list[str] = []
    j = i
    while (m := _SCAN.search(text, j)) is not None:
        c, j = m.group(), m.start()
        if c in "\"'":
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "([{":
            stack.append(c)
        elif not stack or stack.pop() != _CLOSE[c]:
            return None
        j += 1
        if not stack:
            return j
    return None


def _string_end(text: str, i: int) -> int | None:
    """Just past the Python string literal starting at text[i] (a quote), or None."""
    quote = text[i : i + 3] if text[i : i + 3] in ('"""', "'''") else text[i]
    j = i + len(quote)
    while True:
        k = text.find(quote, j)
        if k < 0:
            return None
        run = len(text[j:k]) - len(text[j:k].rstrip("\\"))  # backslashes right before it
        if run % 2 == 0:
            return k + len(quote)
        j = k + 1


def _arguments(parens: str) -> str | None:
    """'(k=v, ...)' -> the JSON text of {k: v, ...}; None if it is not keyword literals."""
    try:
        call = ast.parse("f" + parens, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(call, ast.Call) or call.args:
        return None
    out: dict[str, Any] = {}
    for kw in call.keywords:
        if kw.arg is None or kw.arg in out:  # **spread, or a repeated name
            return None
        try:
            out[kw.arg] = _literal(kw.value)
        except ValueError:
            return None
    return json.dumps(out, ensure_ascii=False)


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, str, int)):
            return v
        if isinstance(v, float) and math.isfinite(v):
            return v
        raise ValueError(f"not a JSON value: {v!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal(node.operand)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("a sign before a non-number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise ValueError("dict keys must be strings")
            out[k.value] = _literal(v)
        return out
    if isinstance(node, ast.Name) and node.id in _WORDS:
        return _WORDS[node.id]
    raise ValueError(f"not a literal: {type(node).__name__}")
