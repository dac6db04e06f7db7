"""Stop-string matching cost at the largest allowed stop set: the naive tail search that
IncrementalDetokenizer used to run (kept as the reference in tests/engine/test_stop_matcher.py)
against the Aho-Corasick matcher (engine/stop_matcher.py), interleaved, best of 3.

    python -m benchmarks.bench_stop
"""

from __future__ import annotations

import time

from engine.stop_matcher import StopMatcher, StopText
from tests.engine.test_stop_matcher import NaiveStopText, _worst_stop_set

TOKEN_CHARS = 4


def _run(out, text: str) -> float:
    started = time.perf_counter()
    for i in range(0, len(text), TOKEN_CHARS):
        out.append(text[i : i + TOKEN_CHARS])
        out.take(hold_back=True)
    return time.perf_counter() - started


def main() -> None:
    stops = _worst_stop_set()  # 64 strings of ~1,000 characters, all near-misses
    text = ("a" * 50 + "c") * 40  # 2,040 characters: 510 tokens of 4
    tokens = len(text) // TOKEN_CHARS
    naive, fast, build = [], [], []
    for _ in range(3):
        naive.append(_run(NaiveStopText(stops, False), text))
        started = time.perf_counter()
        matcher = StopMatcher(stops)
        build.append(time.perf_counter() - started)
        fast.append(_run(StopText(matcher), text))
    print(f"naive: {min(naive) / tokens * 1e3:.2f} ms per token")
    print(
        f"automaton: {min(fast) / tokens * 1e6:.2f} us per token, built in {min(build) * 1e3:.1f} ms"
    )
    print(f"ratio: {min(naive) / min(fast):,.0f}x")


if __name__ == "__main__":
    main()
