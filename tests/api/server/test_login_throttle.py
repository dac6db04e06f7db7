"""LoginThrottle on its own, with a hand-driven clock: the lockout after N failures in the
window, its end, a success forgetting the failures, one WARNING per lockout (never a
secret), the metrics, the bounded table, and which address a connection counts as."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from api.server.login_throttle import LoginThrottle, client_address, locked_out
from api.server.metrics import Metrics
from tests.api.server.test_metrics import value


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(max_failures=3, window_s=10.0, **kw) -> tuple[LoginThrottle, Clock]:
    clock = Clock()
    return LoginThrottle(max_failures, window_s, clock=clock, **kw), clock


def test_n_failures_in_the_window_lock_the_client_out_for_the_window(caplog):
    throttle, clock = make()
    metrics = Metrics("tiny")
    throttle.metrics = metrics
    with caplog.at_level(logging.WARNING, logger="tessera.api"):
        assert throttle.failure("10.0.0.1", "console") == 0.0
        clock.t += 1
        assert throttle.failure("10.0.0.1", "console") == 0.0
        assert throttle.locked_for("10.0.0.1") == 0.0
        assert throttle.failure("10.0.0.1", "console") == 10.0  # the third: locked out
        assert throttle.locked_for("10.0.0.1") == 10.0
        assert throttle.locked_for("10.0.0.2") == 0.0  # another client is not
        clock.t += 4
        assert throttle.locked_for("10.0.0.1") == pytest.approx(6.0)
        throttle.failure("10.0.0.1", "console")  # raced past the check: no second lockout
        clock.t += 6
        assert throttle.locked_for("10.0.0.1") == 0.0  # over, and forgotten
        assert len(throttle) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "10.0.0.1" in message and "3 failed" in message and "10 s" in message
    text = metrics.render().decode()
    assert value(text, "tessera:login_failures_total", surface="console") == 4
    assert value(text, "tessera:login_lockouts_total", surface="console") == 1
    assert value(text, "tessera:login_lockouts_total", surface="admin_api") == 0


def test_failures_older_than_the_window_do_not_count():
    throttle, clock = make()
    throttle.failure("a", "admin_api")
    throttle.failure("a", "admin_api")
    clock.t += 10.5  # both out of the window
    assert throttle.failure("a", "admin_api") == 0.0
    assert throttle.failure("a", "metrics") == 0.0
    assert throttle.failure("a", "console") == 10.0  # surfaces share one count per client


def test_a_success_forgets_the_failures():
    throttle, _ = make()
    throttle.failure("a", "console")
    throttle.failure("a", "console")
    throttle.success("a")
    assert throttle.failure("a", "console") == 0.0
    assert throttle.failure("a", "console") == 0.0
    assert throttle.failure("a", "console") == 10.0


def test_zero_means_no_limit_and_bad_values_are_refused():
    throttle, _ = make(max_failures=0)
    for _ in range(100):
        assert throttle.failure("a", "console") == 0.0
    assert throttle.locked_for("a") == 0.0 and len(throttle) == 0
    with pytest.raises(ValueError, match="window_s"):
        LoginThrottle(5, 0)
    with pytest.raises(ValueError, match="max_failures"):
        LoginThrottle(-1, 60)
    with pytest.raises(ValueError, match="surface"):
        throttle.failure("a", "elsewhere")


def test_the_table_is_bounded_whatever_the_addresses():
    throttle, clock = make(max_clients=1000)
    for i in range(50_000):  # an attacker rotating addresses, one guess each
        throttle.failure(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", "console")
        clock.t += 0.0001
    assert len(throttle) == 1000
    # The most recent clients are the ones kept (LRU); a locked-out one stays locked.
    for _ in range(3):
        throttle.failure("192.0.2.7", "console")
    for i in range(999):
        throttle.failure(f"198.51.{i >> 8}.{i & 255}", "console")
    assert len(throttle) == 1000 and throttle.locked_for("192.0.2.7") > 0


def test_client_address_is_the_peer_and_ipv6_counts_per_64():
    def conn(host):
        return SimpleNamespace(client=SimpleNamespace(host=host) if host else None)

    assert client_address(conn("203.0.113.9")) == "203.0.113.9"
    assert client_address(conn("2001:db8:1:2:aaaa::1")) == "2001:db8:1:2::/64"
    assert client_address(conn("2001:db8:1:2:bbbb::9")) == "2001:db8:1:2::/64"
    assert client_address(conn("::ffff:198.51.100.4")) == "198.51.100.4"
    assert client_address(conn("testclient")) == "testclient"
    assert client_address(conn(None)) == "unknown"


def test_locked_out_is_a_429_in_the_envelope_with_retry_after():
    err = locked_out(0.2)
    assert err.status_code == 429 and err.headers["Retry-After"] == "1"
    assert err.to_body()["error"]["type"] == "rate_limit_exceeded"
    assert locked_out(59.01).headers["Retry-After"] == "60"
