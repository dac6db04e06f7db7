"""Slowloris and idle connections on loopback: the server closes a connection that has not
sent its request headers within --header-read-timeout, and one beyond --limit-concurrency at
once, while well-behaved clients keep being served (bounded: 30 sockets, a minute at most)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

CAP = 20


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    return start_server(
        tiny_llama_dir,
        "--auth",
        "none",
        "--header-read-timeout",
        "1",
        "--limit-concurrency",
        str(CAP),
    )


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (EOF or reset), without blocking."""
    sock.setblocking(False)
    try:
        return sock.recv(1024) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_slowloris_and_idle_connections_are_closed(server):
    socks = []
    try:
        for i in range(CAP + 10):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            if i % 2 == 0:  # half dribble a request, half send nothing at all
                s.sendall(b"GET /health HTTP/1.1\r\n")
            socks.append(s)
        # The ones over the cap are closed before any deadline could have passed: by the time
        # a well-behaved request comes back, at least 10 are gone.
        time.sleep(0.2)
        over = sum(_closed(s) for s in socks)
        assert over >= 10, over
        open_ = [s for s in socks if not _closed(s)]
        # The rest: each dribbles a header byte at a time and is cut off by the deadline
        # (it never completes its headers). Bounded: 60 s for all of them.
        deadline = time.monotonic() + 60
        while open_ and time.monotonic() < deadline:
            for s in list(open_):
                try:
                    s.setblocking(True)
                    s.sendall(b"X")
                except OSError:
                    open_.remove(s)
                    continue
                if _closed(s):
                    open_.remove(s)
            time.sleep(0.1)
        assert not open_, f"{len(open_)} connections still held"
    finally:
        for s in socks:
            s.close()
    # Served as usual once they are gone; a keep-alive client is not cut off mid-request.
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        for _ in range(3):
            assert c.get("/health").status_code == 200
            time.sleep(0.5)
