"""Slowloris and idle connections on loopback: the server closes a connection that has not
sent its request headers within --header-read-timeout, and one beyond --limit-concurrency at
once with a 503 in the error envelope, while well-behaved clients keep being served (bounded: 30 sockets, a minute at most)."""

from __future__ import annotations

import json
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


def _refused_with_503(sock: socket.socket) -> bool:
    """Whether the server answered at once with its over-the-cap 503 and closed."""
    sock.setblocking(False)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except BlockingIOError:
        return False  # still open: not refused
    except OSError:
        pass
    if not data:
        return False
    head, _, body = data.partition(b"\r\n\r\n")
    error = json.loads(body)["error"]
    return head.startswith(b"HTTP/1.1 503") and error["code"] == "too_many_connections"


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
        refused = [s for s in socks if _refused_with_503(s)]
        assert len(refused) >= 10, len(refused)
        open_ = [s for s in socks if s not in refused and not _closed(s)]
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
