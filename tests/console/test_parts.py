"""The console's small parts without a server: block-map aggregation, chart scaling and
escaping, the throughput history, session cookies and CSRF tokens."""

from __future__ import annotations

import re

import pytest

from console.charts import bar_chart, block_map, line_chart, nice_max
from console.session import SessionRevocations, SessionSigner
from console.state import Sample, ThroughputHistory


def test_block_map_one_cell_per_block():
    states = bytes([0, 1, 1, 2, 0, 0, 1])
    m = block_map(states)
    assert m.cells == ["n", "u", "u", "c", "f", "f", "u"]
    assert (m.blocks_per_cell, m.used, m.cached, m.free, m.total) == (1, 3, 1, 2, 6)


def test_block_map_aggregates_large_pools():
    # 1 null block + 10,000 blocks: in use 0..2999, cached 3000..3999, free after.
    states = bytes([0]) + bytes([1] * 3000 + [2] * 1000 + [0] * 6000)
    m = block_map(states, max_cells=2048)
    assert m.blocks_per_cell == 5 and len(m.cells) == 1 + 2000
    assert m.cells[1:601] == ["u"] * 600
    assert m.cells[601:801] == ["c"] * 200 and set(m.cells[801:]) == {"f"}
    assert (m.used, m.cached, m.free) == (3000, 1000, 6000)
    # A group with any tie towards use shows as used: pressure is never hidden.
    assert block_map(bytes([0, 1, 0, 0, 1]), max_cells=2).cells == ["n", "u", "u"]


def test_nice_max_and_charts():
    assert [nice_max(v) for v in (0, 0.3, 1, 3, 5, 7, 9, 1234, 10)] == [
        1,
        0.4,
        1,
        4,
        6,
        8,
        10,
        2000,
        10,
    ]
    svg = line_chart(
        {"a<b": [(0.0, 0.0), (10.0, 50.0)]}, x_span=(0.0, 10.0), x_labels=[(0.0, "<x>")]
    )
    assert "<title>a&lt;b</title>" in svg and "&lt;x&gt;" in svg and "<x>" not in svg
    assert "style=" not in svg  # the CSP forbids inline styles
    points = re.search(r'points="([^"]+)"', svg).group(1).split()
    (x0, y0), (x1, y1) = (map(float, p.split(",")) for p in points)
    assert x0 < x1 and y1 < y0  # up and to the right
    bars = bar_chart(["d1", "d2"], {"k1": [10, 0], "k2": [30, 5]})
    heights = [float(h) for h in re.findall(r'<rect[^>]* height="([0-9.]+)"', bars)]
    assert len(heights) == 3 and heights[1] == pytest.approx(3 * heights[0], rel=0.02)


def test_throughput_history_rates_and_hit_rate():
    h = ThroughputHistory(window_s=100)
    h.add(Sample(0.0, 0, 0, 0, 0))
    h.add(Sample(0.2, 5, 5, 0, 0))  # too soon after the last sample: ignored
    h.add(Sample(2.0, 100, 40, 64, 16))
    h.add(Sample(4.0, 100, 100, 128, 48))
    rates = h.rates()
    assert [(r.prompt_tps, r.generation_tps) for r in rates] == [(50, 20), (0, 30)]
    assert h.recent_hit_rate() == pytest.approx(48 / 128)
    h.add(Sample(200.0, 100, 100, 128, 48))  # the window drops old samples
    assert len(h.rates()) == 0
    h.add(Sample(202.0, 0, 0, 0, 0))  # counters went back: a new engine, start over
    assert h.rates() == []


def test_session_cookie_and_csrf():
    signer = SessionSigner("secret-admin-token")
    cookie, session = signer.issue(now=1000.0)
    assert signer.verify(cookie, now=1001.0) == session
    assert signer.verify(cookie, now=1000.0 + 13 * 3600) is None  # expired
    expires, nonce, sig = cookie.split(".")
    assert signer.verify(f"{int(expires) + 1}.{nonce}.{sig}", now=1001.0) is None
    assert signer.verify(cookie[:-2] + "xx", now=1001.0) is None
    assert signer.verify("garbage", now=1001.0) is None and signer.verify(None) is None
    # Another admin token: every session and CSRF token of the old one is void.
    other = SessionSigner("rotated-admin-token")
    assert other.verify(cookie, now=1001.0) is None
    assert signer.same(session.csrf, session.csrf) and not signer.same(session.csrf, "x")
    assert not signer.same(session.csrf, None)
    nonce = signer.login_nonce()
    assert signer.login_csrf(nonce) != other.login_csrf(nonce)
    assert signer.token_matches(" secret-admin-token ") and not signer.token_matches("secret")
    revoked = SessionRevocations()
    revoked.revoke(session)
    assert session in revoked
    with pytest.raises(ValueError, match="admin token"):
        SessionSigner("")
