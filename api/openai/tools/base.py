"""What every tool-call parser provides, and the streamer that turns its views into deltas.

A parser reads a model's (possibly unfinished) output text and returns a Snapshot: the
content text that is certainly content, and the calls found so far (a call appears once its
name is complete; its arguments are the raw JSON text of the value so far). Snapshots only
ever grow as text arrives — content and arguments by appending, calls by adding — so the
streamer can send the difference between two snapshots as OpenAI deltas, and the
non-streaming answer (the final snapshot) equals what the deltas add up to.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class PartialCall:
    name: str
    arguments: str  # raw JSON text of the arguments value so far


@dataclass(slots=True)
class Snapshot:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(ABC):
    """One output format. `final`: the text is complete, so nothing is held back any more
    (a partial start tag at the end, say, turns out to be content).

    Class-level hooks for the formats that need them (Mistral's): `call_id` makes the ids
    its template accepts back, `keeps_special_tokens` says its markers are special tokens
    that detokenizing must keep, `template_messages` rewrites the history for its template.
    """

    name: str
    call_id: Callable[[], str] = staticmethod(new_call_id)
    keeps_special_tokens: bool = False

    @staticmethod
    def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return messages

    @abstractmethod
    def snapshot(self, text: str, final: bool) -> Snapshot: ...


@dataclass(slots=True)
class CallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with name
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Delta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str


class ToolStreamer:
    """One choice's output, parsed as it grows; `max_calls` 1 when parallel_tool_calls is
    false (later calls are dropped); `new_id` makes the call ids (default: the parser's)."""

    def __init__(
        self,
        parser: ToolParser,
        max_calls: int | None = None,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.new_id = new_id or parser.call_id
        self.ids: list[str] = []
        self._content = ""
        self._args: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def _snap(self, text: str, final: bool) -> Snapshot:
        snap = self.parser.snapshot(text, final)
        if self.max_calls is not None:
            snap.calls = snap.calls[: self.max_calls]
        return snap

    def update(self, text: str, final: bool = False) -> list[Delta]:
        """The deltas that bring what was sent up to the output `text`: content first, then
        for each call its opening delta (id, name, arguments "") and its argument fragment."""
        snap = self._snap(text, final)
        if not snap.content.strip() and (snap.calls or not final):
            snap.content = ""  # leading space before a call is not content (parse() agrees)
        out: list[Delta] = []
        if len(snap.content) > len(self._content) and snap.content.startswith(self._content):
            out.append(Delta(content=snap.content[len(self._content) :]))
            self._content = snap.content
        for i, call in enumerate(snap.calls):
            if i == len(self.ids):
                self.ids.append(self.new_id())
                self._args.append("")
                out.append(Delta(calls=[CallDelta(i, self.ids[i], call.name, "")]))
            sent = self._args[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.append(Delta(calls=[CallDelta(i, arguments=call.arguments[len(sent) :])]))
                self._args[i] = call.arguments
        return out

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The whole output: (content or None, calls), as a non-streaming response has it."""
        snap = self._snap(text, final=True)
        calls = [
            ParsedCall(self.ids[i] if i < len(self.ids) else self.new_id(), c.name, c.arguments)
            for i, c in enumerate(snap.calls)
        ]
        content = snap.content
        if calls and not content.strip():
            return None, calls
        return content, calls
