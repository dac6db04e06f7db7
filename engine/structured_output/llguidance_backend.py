"""llguidance (Microsoft's Rust grammar engine, on PyPI) behind the backend interface.

Why this engine: its lexer is built lazily from regex derivatives under fuel and state
limits (LLParserLimits), so a pathological regex or schema ends in an error, never in an
automaton that takes minutes or gigabytes to build; compiles are milliseconds; masks are
filled in Rust with the GIL released (several rows at once via LLExecutor). Measured
against xgrammar on this machine: BENCHMARKS.md, "Structured output".
"""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import torch

from engine.structured_output.backend import GrammarError

# Lark for a choice: one alternative per string; JSON string literals are valid Lark ones.
_CHOICE_RULE = "start: {}"
# Whitespace between JSON tokens: none, so the model cannot pad a value out to max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}
_LIMITS = dict(
    initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis at compile
    step_lexer_fuel=200_000,  # ~15 ms per mask at most
    max_lexer_states=50_000,
    max_grammar_size=500_000,
)


class LLGuidanceMatcher:
    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept_token(self, token: int) -> bool:
        return self._m.consume_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def is_terminated(self) -> bool:
        return self._m.is_stopped() or self._m.is_error()

    def failed(self) -> bool:
        return self._m.is_error()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy())


class LLGuidanceGrammar:
    __slots__ = ("_template",)

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template  # never advanced: each request copies it

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        # Building the token trie costs ~1 s: once per engine.
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None
        )
        self.vocab_size = vocab_size
        self._limits = llguidance.LLParserLimits(**_LIMITS)
        self._executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, kind: str, spec: str) -> LLGuidanceGrammar:
        try:
            m = self._matcher(kind, spec)
        except GrammarError:
            raise
        except (ValueError, RuntimeError, TypeError) as e:  # raised rather than reported
            raise GrammarError(_clean(str(e), kind)) from None
        if m.is_error():
            raise GrammarError(_clean(m.get_error(), kind))
        return LLGuidanceGrammar(m)

    def _matcher(self, kind: str, spec: str) -> llguidance.LLMatcher:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_OPTIONS
            )
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            alts = " | ".join(json.dumps(c) for c in json.loads(spec))
            grammar = llguidance.LLMatcher.grammar_from_lark(_CHOICE_RULE.format(alts))
        elif kind == "grammar":
            grammar = llguidance.LLMatcher.grammar_from_lark(spec)
        else:
            raise GrammarError(f"unknown structured output kind {kind!r}")
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if not m.is_error():  # the first mask builds the lexer's start: its errors show here
            probe = m.deep_copy()
            probe.compute_bitmask()
            if probe.is_error():
                m = probe
        return m

    def fill_bitmasks(self, rows: list[tuple[LLGuidanceMatcher, int]], bitmask: torch.Tensor):
        if not rows:  # (llguidance's executor refuses an empty list)
            return
        if len(rows) == 1:
            rows[0][0].fill_bitmask(bitmask, rows[0][1])
            return
        assert bitmask.is_contiguous() and bitmask.dtype == torch.int32
        self._executor.unsafe_compute_mask_ptr(
            [(m._m, row) for m, row in rows],
            bitmask.data_ptr(),
            bitmask.shape[1] * 4,
            bitmask.shape[0],
        )


_WHAT = {"json": "schema", "json_object": "schema", "regex": "regex", "choice": "choices"}
_MAX_MESSAGE = 300
# llguidance's stop reasons, when a compile ends in one: what each means for the spec.
_STOPS = {
    "NoExtension": "matches no output at all",
    "NoExtensionBias": "matches no output at all",
    "LexerTooComplex": "is too complex to compile within the server's limits; simplify it",
    "ParserTooComplex": "is too complex to compile within the server's limits; simplify it",
    "MaxTokensTotal": "is too complex to compile within the server's limits; simplify it",
    "MaxTokensParser": "is too complex to compile within the server's limits; simplify it",
}
_HINTS = {
    "schema": " (look for a $ref or allOf that leads back to itself, or constraints that "
    "contradict each other)",
    "grammar": " (look for rules that only refer to each other, with no text to end on)",
}
# <state>...</state> and <grammar>...</grammar>: the matcher's internals and the grammar
# echoed back, never for the client.
_DUMP = re.compile(r"<(state|grammar)>.*?(?:</\1>|\Z)", re.DOTALL)
_AT = re.compile(r"^(?:at )?(\d+)\((\d+)\): (.*)$")


def _clean(message: str, kind: str = "grammar") -> str:
    """llguidance's error as a short message for the client: its reason in the spec's terms,
    without the matcher's state, the grammar it echoes or source excerpts, capped."""
    what = _WHAT.get(kind, kind)
    lines = [ln.rstrip() for ln in _DUMP.sub("", message).strip().splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    if not lines:
        return f"the {what} is invalid"
    first = lines[0].strip().removeprefix("Error: ")
    if first in _STOPS:
        hint = _HINTS.get(what, "") if first.startswith("NoExtension") else ""
        return f"the {what} {_STOPS[first]}{hint}"
    where = ""
    located = _AT.match(first)
    if located:
        line, column, first = located.groups()
        if kind == "grammar":  # elsewhere a position in the grammar built around the spec
            where = f"line {line}, column {column}: "
    reason = next((ln.strip()[7:] for ln in lines if ln.strip().startswith("error: ")), None)
    if "regex parse error" in first and reason:
        # The regex crate's report: the pattern, a caret line, then "error: <reason>".
        if kind == "regex":
            return _cap(f"the regex does not parse: {reason}")
        quoted = re.search(r'invalid regex ("(?:[^"\\]|\\.)*")', first)
        pattern = quoted.group(1) if quoted else json.dumps(lines[1].strip())
        pattern = f" {pattern}" if len(pattern) <= 80 else ""
        return _cap(f"{where}invalid regex{pattern}: {reason}")
    if first.startswith("Resource '") and "not present in a registry" in first:
        ref = first.split("'")[1]
        return _cap(
            f'the $ref "{ref}" points outside the schema; only references within it '
            '("#/$defs/...") are resolved'
        )
    return _cap(where + first)  # the lines below it echo the spec or the engine's state


def _cap(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 1] + "…"
