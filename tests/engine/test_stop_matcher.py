"""The incremental stop matcher (engine/stop_matcher.py) against the naive check it replaced,
and its cost: linear in the output whatever the stop set, within SamplingParams' limits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from engine.stop_matcher import StopMatcher, StopText


class NaiveStopText:
    """The reference: the stop check IncrementalDetokenizer had before the automaton."""

    def __init__(self, stop: list[str], include: bool) -> None:
        self._stop = [s for s in stop if s]
        self._include = include
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self._emitted = 0
        self.stop_reason: str | None = None

    def append(self, chunk: str) -> None:
        if self.stop_reason is not None:
            return
        start = len(self.text)
        self.text += chunk
        if not self._stop or len(self.text) == start:
            return
        search_from = max(0, start - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self._include else self.text[:i]
            self.stop_reason = s

    def take(self, hold_back: bool) -> str:
        end = len(self.text)
        if hold_back and self._stop:
            end -= self._stop_prefix_len()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _stop_prefix_len(self) -> int:
        tail = self.text[-(self._max_stop - 1) :] if self._max_stop > 1 else ""
        for n in range(len(tail), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stop):
                return n
        return 0


def _run(impl, chunks: list[str]) -> list:
    """What a client sees: the delta after each update, the text, the stop reason."""
    seen = []
    for chunk in chunks:
        if impl.stop_reason is not None:
            break
        impl.append(chunk)
        seen.append(impl.take(hold_back=impl.stop_reason is None))
    seen.append(impl.take(hold_back=False))  # finish()
    return [seen, impl.text, impl.stop_reason]


# A small alphabet so that stop strings, overlaps and partial prefixes actually occur.
_alpha = st.sampled_from("abcaab\u00e9\U0001f600")
_text = st.text(alphabet=_alpha, max_size=40)
_stops = st.lists(st.text(alphabet=_alpha, min_size=0, max_size=6), max_size=6)


@st.composite
def _split(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=600, deadline=None)
@given(data=st.data(), text=_text, stops=_stops, include=st.booleans())
def test_matches_the_naive_check_on_every_split(data, text, stops, include) -> None:
    chunks = data.draw(_split(text))
    want = _run(NaiveStopText(stops, include), chunks)
    got = _run(StopText(StopMatcher(stops), include), chunks)
    assert got == want


@pytest.mark.parametrize(
    ("stops", "chunks", "text", "reason"),
    [
        (["ab", "abc"], ["abc"], "", "ab"),  # same start: the one listed first
        (["abc", "ab"], ["abc"], "", "abc"),
        (["ab", "abc"], ["ab", "c"], "", "ab"),  # the earlier update wins
        (["bc", "xabcd"], ["xabcd"], "", "xabcd"),  # ends later but starts earlier
        (["aab"], ["aaa", "ab"], "aa", "aab"),  # failure links across updates
    ],
)
def test_tie_breaks(stops, chunks, text, reason) -> None:
    out = StopText(StopMatcher(stops))
    for c in chunks:
        out.append(c)
    assert (out.text, out.stop_reason) == (text, reason)


def test_limits_are_enforced() -> None:
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match=r"^stop holds 65 strings"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=r"^stop strings must be at most"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])


def _worst_stop_set() -> list[str]:
    """The largest allowed set, built so that every output character keeps a long partial
    match alive (the naive check's worst case): 'aaaa...b' patterns over an 'aaaa' output."""
    return ["a" * (MAX_STOP_STRING_CHARS - 1 - i) + "b" for i in range(MAX_STOP_STRINGS)]


@pytest.mark.parametrize("chunk", [1, 7])
def test_cost_is_linear_in_the_output(chunk: int) -> None:
    stops = _worst_stop_set()
    costs = []
    for n in (2_000, 4_000, 8_000):
        out = StopText(StopMatcher(stops))
        text = ("a" * 50 + "c") * (n // 51)  # partial matches that keep failing
        for i in range(0, len(text), chunk):
            out.append(text[i : i + chunk])
            out.take(hold_back=True)
        assert out.stop_reason is None and out.emitted_text == text[: len(out.emitted_text)]
        costs.append(out.ops / len(text))
    # Transitions per character: at most 2 (one forward, at most one failure per forward),
    # whatever the output length: linear, not output x stop count.
    assert max(costs) <= 2.0


def _steps_until_finished(engine, rid: str) -> int:
    steps = 0
    while True:
        steps += 1
        if any(o.request_id == rid and o.finished for o in engine.step()):
            return steps


def test_max_stop_set_beside_a_normal_request(tiny_llama_dir) -> None:
    """A request with the largest allowed stop set pays per character of its own output,
    and a 4-token request beside it finishes in the same number of steps as alone."""
    from engine import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    try:
        engine = llm.engine
        normal = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        engine.add_request("alone", "Hello", normal)
        alone = _steps_until_finished(engine, "alone")

        # Never emitted by the model (its vocabulary is ASCII-ish BPE), so it never stops.
        stops = ["\u2603" * (MAX_STOP_STRING_CHARS - 1 - i) + "x" for i in range(MAX_STOP_STRINGS)]
        heavy = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, stop=stops)
        engine.add_request("heavy", "Tell me", heavy)
        detok = engine.output_processor.states["heavy"].samples[0].detokenizer
        engine.add_request("normal", "Hello", normal)
        assert _steps_until_finished(engine, "normal") == alone
        while engine.has_unfinished_requests():
            engine.step()
        assert detok.stop_reason is None and len(detok.text) > 0
        assert detok._out.ops <= 2 * len(detok.text)
    finally:
        llm.shutdown()
