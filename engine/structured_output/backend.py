"""The interface a grammar engine implements, the limits every compile obeys, and the
canonical key of a structured-output spec (the compile cache's key).

A backend compiles (kind, spec text) into a CompiledGrammar; each request gets its own
Matcher from it (forked samples copy theirs). Matchers fill one row of an int32 bitmask
[rows, ceil(vocab / 32)] (bit j of word i set: token 32 * i + j allowed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sampling_params import StructuredOutputsParams


class GrammarError(ValueError):
    """A spec that cannot be used: invalid, too large, or too slow to compile. The message is
    for the user (the API sends it as a 400 naming the parameter)."""


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    compile_timeout_s: float = 10.0  # a compile still running then is refused
    max_spec_bytes: int = 64 * 1024  # schema / regex / grammar text, all choices together
    max_enum_values: int = 1024  # choices, or enum/const values summed over a schema
    # Counted repetitions multiply when nested (a{200}{200} is a{40000}): the lexer's work
    # per token grows with the product, so it is capped (in regexes, grammars, patterns).
    max_repetition: int = 10_000


class Matcher(Protocol):
    def accept_token(self, token: int) -> bool: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def fork(self) -> Matcher: ...


class CompiledGrammar(Protocol):
    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        """Raise GrammarError for an invalid spec. May take long: never on the engine step."""
        ...

    def fill_bitmasks(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Fill bitmask[row] for each (matcher, row); may use several threads."""
        ...


def spec_key(so: StructuredOutputsParams, limits: GrammarLimits) -> tuple[str, str]:
    """(kind, canonical spec text): the compile cache's key. Checks the size limits (cheap,
    synchronous) and that a JSON schema is JSON; raises GrammarError."""
    kind = so.kind
    if kind == "json":
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("the JSON schema must be a JSON object")
        # Key order kept: properties are generated in the order the schema lists them.
        text = json.dumps(schema, separators=(",", ":"))
        _check_size(len(text.encode()), limits, "the JSON schema")
        for pattern in _patterns(schema):
            _check_repetition(pattern, limits, "a pattern in the JSON schema")
        enums = _count_enum_values(schema)
        if enums > limits.max_enum_values:
            raise GrammarError(
                f"the JSON schema lists {enums} enum/const values; at most "
                f"{limits.max_enum_values} are allowed"
            )
        return kind, text
    if kind == "choice":
        choices = so.choice or []
        if len(choices) > limits.max_enum_values:
            raise GrammarError(
                f"{len(choices)} choices given; at most {limits.max_enum_values} are allowed"
            )
        text = json.dumps(choices, separators=(",", ":"))
        _check_size(len(text.encode()), limits, "the choices")
        return kind, text
    if kind == "json_object":
        return kind, ""
    text = so.regex if kind == "regex" else so.grammar
    assert text is not None
    _check_size(len(text.encode()), limits, f"the {kind}")
    _check_repetition(text, limits, f"the {kind}")
    return kind, text


def _check_size(size: int, limits: GrammarLimits, what: str) -> None:
    if size > limits.max_spec_bytes:
        raise GrammarError(
            f"{what} is {size} bytes; at most {limits.max_spec_bytes} bytes are allowed"
        )


def _count_enum_values(node: object) -> int:
    if isinstance(node, dict):
        n = sum(_count_enum_values(v) for v in node.values())
        enum = node.get("enum")
        if isinstance(enum, list):
            n += len(enum)
        return n + ("const" in node)
    if isinstance(node, list):
        return sum(_count_enum_values(v) for v in node)
    return 0


def _patterns(node: object):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            else:
                yield from _patterns(value)
    elif isinstance(node, list):
        for value in node:
            yield from _patterns(value)


def _check_repetition(text: str, limits: GrammarLimits, what: str) -> None:
    n = max_repetition(text)
    if n > limits.max_repetition:
        raise GrammarError(
            f"{what} repeats {n} times (counted repetitions such as {{n}} multiply when "
            f"nested); at most {limits.max_repetition} are allowed"
        )


_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def max_repetition(regex: str) -> int:
    """The largest product of nested counted repetitions ({n}, {n,}, {n,m}) in a regex."""
    stack = [1]  # per open group: the largest product inside it
    last = 1  # the product of the atom just read
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "(":
            stack.append(1)
            i += 1
            continue
        if c == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        if c == "{" and (m := _QUANTIFIER.match(regex, i)):
            count = int(m.group(2)) if m.group(2) else int(m.group(1))
            last *= max(count, 1)
            stack[-1] = max(stack[-1], last)
            i = m.end()
            continue
        if c == "\\":
            i += 2
        elif c == "[":  # a class is one atom: skip to its closing bracket
            i += 1
            if i < n and regex[i] == "^":
                i += 1
            if i < n and regex[i] == "]":
                i += 1
            while i < n and regex[i] != "]":
                i += 2 if regex[i] == "\\" else 1
            i += 1
        else:
            i += 1
        last = 1
    return max(stack)
