"""Stop-string matching cost at the largest allowed stop set: the naive tail search that
IncrementalDetokenizer used to run (kept as the reference in tests/engine/test_stop_matcher.py)
against the Aho-Corasick matcher (engine/stop_matcher.py), interleaved, best of 3.

    tessera bench stop
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from engine.stop_matcher import StopMatcher, StopText

# The naive reference lives with its property test: this needs the repository checkout.
CHECKOUT = Path(__file__).resolve().parents[1]

TOKEN_CHARS = 4


def _run(out, text: str) -> float:
    started = time.perf_counter()
    for i in range(0, len(text), TOKEN_CHARS):
        out.append(text[i : i + TOKEN_CHARS])
        out.take(hold_back=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    del argv  # no options: the stop set is the largest the limits allow
    if not (CHECKOUT / "tests" / "engine" / "test_stop_matcher.py").is_file():
        raise SystemExit("tessera bench stop: run from a checkout of the repository (tests/)")
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    from tests.engine.test_stop_matcher import NaiveStopText, _worst_stop_set

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
    return 0


if __name__ == "__main__":
    main()
