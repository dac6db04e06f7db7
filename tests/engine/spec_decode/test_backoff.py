"""DraftBackoff (engine.spec_decode.backoff): after a verification that kept no draft a
request skips 2, 4, 8, ... (at most max_skip) chances to draft; a kept draft resets it; off,
it never skips; `draft_backoff` in the speculative config turns it off and is checked."""

from __future__ import annotations

import pytest

from engine.spec_decode.backoff import DraftBackoff
from engine.spec_decode.config import parse_speculative_config


def _chances_skipped(backoff: DraftBackoff, rid: str) -> int:
    skipped = 0
    while not backoff.should_draft(rid):
        skipped += 1
    return skipped


def test_rejections_double_the_skip_up_to_its_cap_and_an_acceptance_resets_it():
    backoff = DraftBackoff(max_skip=8)
    assert backoff.should_draft("a")  # a new request drafts
    skipped = []
    for _ in range(5):
        backoff.record("a", 0)
        skipped.append(_chances_skipped(backoff, "a"))
    assert skipped == [2, 4, 8, 8, 8]
    backoff.record("a", 2)  # a kept draft: back to drafting at every chance
    assert backoff.should_draft("a") and backoff.should_draft("a")
    backoff.record("a", 0)
    assert _chances_skipped(backoff, "a") == 2
    assert backoff.should_draft("b")  # requests are independent


def test_a_finished_request_leaves_nothing_and_off_never_skips():
    backoff = DraftBackoff()
    backoff.record("a", 0)
    backoff.drop("a")
    assert len(backoff) == 0 and backoff.should_draft("a")
    off = DraftBackoff(enabled=False)
    for _ in range(3):
        off.record("a", 0)
        assert off.should_draft("a")


def test_the_config_key_turns_it_off_and_is_checked():
    assert parse_speculative_config('{"method": "ngram"}').draft_backoff is True
    cfg = parse_speculative_config('{"method": "ngram", "draft_backoff": false}')
    assert cfg.draft_backoff is False
    with pytest.raises(ValueError, match="draft_backoff must be true or false"):
        parse_speculative_config('{"method": "ngram", "draft_backoff": 1}')
