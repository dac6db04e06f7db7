"""Stop strings over a growing text: an Aho–Corasick automaton, so each new character costs
amortised O(1) whatever the number and length of the stop strings.

The result is the same as the naive check it replaced (re-search the tail for every stop
string after each update): after each update, the earliest-starting stop string among those
that end in the new text wins, ties going to the one listed first; the text is cut before it
(or after it, with include_stop_str_in_output). While streaming, the longest tail of the
text that could still begin a stop string is held back: that is the automaton's state depth.

StopMatcher is built once per request (cost O(total stop characters), bounded by
SamplingParams' limits) and shared by its samples; StopText is one sample's text and state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopMatcher:
    """The automaton: a trie over the stop strings with failure links. Immutable once built."""

    __slots__ = ("stops", "_goto", "_fail", "_depth", "_best")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        own = [-1]  # index (first in the list) of the stop string spelled by this node
        for index, s in enumerate(self.stops):
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    own.append(-1)
                node = nxt
            if own[node] < 0:
                own[node] = index
        fail = [0] * len(goto)
        # best[node]: the longest stop string that is a suffix of the node's text (-1: none).
        # The longest one starts earliest, and a shorter one at the same end never wins.
        best = list(own)
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            if best[node] < 0:
                best[node] = best[fail[node]]
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if node else 0
                queue.append(child)
        self._goto, self._fail, self._depth, self._best = goto, fail, depth, best

    def __bool__(self) -> bool:
        return bool(self.stops)


class StopText:
    """One sample's output text with stop strings applied.

    append(chunk) adds decoded text and cuts it at a stop string that ends inside the chunk;
    take(hold_back) returns what was not returned yet, less a possible stop-string start."""

    __slots__ = ("_m", "_include", "_state", "text", "_emitted", "stop_reason", "ops")

    def __init__(self, matcher: StopMatcher, include_stop_str_in_output: bool = False) -> None:
        self._m = matcher
        self._include = include_stop_str_in_output
        self._state = 0
        self.text = ""
        self._emitted = 0
        self.stop_reason: str | None = None
        self.ops = 0  # automaton transitions taken: the cost, for the linear-time tests

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]

    def append(self, chunk: str) -> None:
        if not chunk or self.stop_reason is not None:
            return
        start = len(self.text)
        self.text += chunk
        m = self._m
        if not m.stops:
            return
        goto, fail, best = m._goto, m._fail, m._best
        state, ops = self._state, 0
        found: tuple[int, int] | None = None  # (start offset, stop index) of the winner
        for pos, ch in enumerate(chunk, start + 1):
            while state and ch not in goto[state]:
                state = fail[state]
                ops += 1
            state = goto[state].get(ch, 0)
            ops += 1
            index = best[state]
            if index >= 0:
                hit = (pos - len(m.stops[index]), index)
                if found is None or hit < found:
                    found = hit
        self._state, self.ops = state, self.ops + ops
        if found is not None:
            i, index = found
            s = m.stops[index]
            self.text = self.text[: i + len(s)] if self._include else self.text[:i]
            self.stop_reason = s

    def take(self, hold_back: bool) -> str:
        end = len(self.text)
        if hold_back and self.stop_reason is None:
            end -= self._m._depth[self._state]
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
