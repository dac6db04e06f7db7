"""ShadowDrafts (engine.spec_decode.shadow): an unverified proposal is settled by the tokens
the request then emits, as verification would have settled it: kept up to the first token
that differs, or all of them; one proposal a request at a time; dropped with the request."""

from __future__ import annotations

from engine.spec_decode.shadow import ShadowDrafts


def test_a_proposal_settles_at_the_first_differing_token():
    shadow = ShadowDrafts()
    shadow.start("a", [5, 6, 7])
    assert not shadow.wants("a") and shadow.wants("b")
    assert shadow.observe("a", [5]) is None  # one step, one token: still open
    assert shadow.observe("a", [6, 9, 4]) == (3, 2)  # a drafted step's tokens count too
    assert shadow.wants("a") and len(shadow) == 0
    shadow.start("a", [1, 2])
    assert shadow.observe("a", [3]) == (2, 0)
    shadow.start("a", [1, 2])
    assert shadow.observe("a", [1, 2, 8]) == (2, 2)  # every draft kept
    assert shadow.num_settled == 3


def test_nothing_to_settle_and_a_dropped_request():
    shadow = ShadowDrafts()
    assert shadow.observe("a", [1]) is None
    shadow.start("a", [])  # no proposal: nothing kept
    assert shadow.wants("a")
    shadow.start("a", [1, 2])
    assert shadow.observe("a", []) is None
    shadow.drop("a")
    assert len(shadow) == 0 and shadow.observe("a", [1]) is None
