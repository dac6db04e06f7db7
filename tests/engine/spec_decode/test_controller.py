"""DraftController (engine.spec_decode.controller) against synthetic step timings: it stops
drafting when drafted steps emit fewer tokens per second, drafts again when the acceptance
rises, probes the other option exactly once per probe_interval decisions, warms up each bucket
of batch sizes on its own; the config key turns it off and is checked."""

from __future__ import annotations

import pytest

from engine.spec_decode.config import parse_speculative_config
from engine.spec_decode.controller import DraftController, bucket_of


def _steps(controller, count, n, k, accept_rate, plain_s, row_s):
    """count decisions at n requests; a drafted step verifies k drafts a request, keeps
    accept_rate of them and costs plain_s + row_s a draft row. The decisions, in order."""
    decisions = []
    for _ in range(count):
        draft = controller.decide(n)
        rows = n * k if draft else 0
        controller.record(n, rows, round(rows * accept_rate), plain_s + row_s * rows)
        decisions.append(draft)
    return decisions


def test_warm_up_drafts_then_measures_plain_per_bucket():
    c = DraftController()
    assert _steps(c, 2, 8, 3, 0.5, 1.0, 0.01) == [True, False]
    assert c.pays(8) is not None and c.pays(12) is not None  # 8-15 share a bucket
    assert c.pays(4) is None  # 4-7: a bucket of its own, warmed up on its own
    assert _steps(c, 2, 4, 3, 0.5, 1.0, 0.01) == [True, False]
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == [1, 2, 2, 3, 3, 4, 4, 5]


def test_stops_drafting_when_drafted_steps_are_slower_per_token():
    """8 requests, 3 drafts each, a tenth kept: a drafted step emits 1.3 tokens a request
    for 1 + 24 * 0.05 = 2.2x the time. After the warm-up only the probes draft."""
    c = DraftController(probe_interval=16)
    decisions = _steps(c, 2 + 160, 8, 3, 0.1, 1.0, 0.05)[2:]
    assert c.pays(8) is False
    assert sum(decisions) == 10 == c.num_probes
    assert [i for i, d in enumerate(decisions) if d] == list(range(15, 160, 16))


def test_keeps_drafting_where_it_pays_and_probes_plain():
    """Memory bound: a draft row costs almost nothing, half the drafts are kept."""
    c = DraftController(probe_interval=8)
    decisions = _steps(c, 2 + 64, 1, 3, 0.67, 1.0, 0.001)[2:]
    assert c.pays(1) is True
    assert [i for i, d in enumerate(decisions) if not d] == list(range(7, 64, 8))


def test_resumes_when_the_acceptance_rises():
    """Open-ended text (nothing kept): drafting stops; the text turns to copying (every
    draft kept): the probes see it and drafting resumes."""
    c = DraftController(probe_interval=16)
    off = _steps(c, 2 + 64, 8, 3, 0.0, 1.0, 0.02)[2:]
    assert sum(off) == 4 and c.pays(8) is False
    on = _steps(c, 160, 8, 3, 1.0, 1.0, 0.02)
    first = on.index(True)
    assert first < 16  # the next probe
    resumed = next(i for i in range(len(on)) if all(on[i : i + 15]))
    assert resumed < 16 * 4, on  # a few probes move the EWMA past the break-even point
    assert c.pays(8) is True
    tail = on[resumed:]
    assert tail.count(False) <= len(tail) // 16 + 1  # only the probes go plain


def test_a_slower_machine_state_flips_the_decision():
    """The same acceptance, but draft rows turn expensive (a loaded or compute-bound
    machine): the probes measure it and drafting stops."""
    c = DraftController(probe_interval=16)
    _steps(c, 2 + 32, 8, 3, 0.5, 1.0, 0.001)
    assert c.pays(8) is True
    after = _steps(c, 96, 8, 3, 0.5, 1.0, 0.1)
    assert c.pays(8) is False and after[-16:].count(True) <= 1


def test_a_stalled_step_does_not_stop_drafting():
    """A drafted step stalled 20x (a neighbour on a shared machine): the estimate grows at
    most by MAX_STEP_GROWTH's share, and drafting goes on where it pays."""
    c = DraftController(probe_interval=16)
    _steps(c, 2 + 16, 1, 3, 0.8, 1.0, 0.05)
    assert c.pays(1) is True
    c.record(1, 3, 2, 20.0)
    assert c.buckets[1].drafted_s < 1.5 and c.pays(1) is True


def test_unmeasurable_steps_are_ignored():
    c = DraftController()
    c.record(0, 0, 0, 1.0)
    c.record(4, 0, 0, 0.0)
    assert c.buckets == {}
    with pytest.raises(ValueError, match="probe_interval"):
        DraftController(probe_interval=1)


def test_the_config_key_turns_it_off_and_is_checked():
    assert parse_speculative_config('{"method": "ngram"}').adaptive is True
    assert parse_speculative_config({"model": "/m/d"}).adaptive is True
    cfg = parse_speculative_config('{"method": "ngram", "adaptive": false}')
    assert cfg.adaptive is False
    with pytest.raises(ValueError, match="adaptive must be true or false"):
        parse_speculative_config('{"method": "ngram", "adaptive": "no"}')
