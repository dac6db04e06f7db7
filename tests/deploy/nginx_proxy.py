"""The shipped nginx configuration (deploy/nginx/nginx.conf) run in front of loopback replicas.

    ensure_nginx()                                     # Debian's nginx, installed when missing
    proxy = NginxProxy(tmp, {"tessera-a": port_a, "tessera-b": port_b})
    proxy.base_url; proxy.upstreams_of(request_id)     # from its access log; proxy.stop()

Only addresses and paths are rewritten (upstream servers and the listen port to loopback, the
pid, temp and log paths into tmp): each rewrite must match exactly once, so a change to the
shipped file's shape fails here instead of testing some other configuration.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "deploy" / "nginx" / "nginx.conf"


def nginx_binary() -> str | None:
    return shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )


def ensure_nginx() -> str:
    if (found := nginx_binary()) is not None:
        return found
    if shutil.which("apt-get"):
        install = ["apt-get", "install", "-y", "-q", "nginx"]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if subprocess.run(install, check=False, capture_output=True, env=env).returncode != 0:
            # A fresh machine has no package lists yet.
            subprocess.run(["apt-get", "update", "-q"], check=False, capture_output=True)
            subprocess.run(install, check=False, capture_output=True, env=env)
    if (found := nginx_binary()) is None:
        message = "Debian nginx is not installed and could not be (apt-get install -y nginx)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the proxy tests, not skip them quietly
        pytest.skip(message)
    return found


def _sub(text: str, pattern: str, repl: str) -> str:
    out, n = re.subn(pattern, repl, text, flags=re.M)
    assert n == 1, f"{SHIPPED.name}: expected one match of {pattern!r}, found {n}"
    return out


def render_config(upstreams: dict[str, int], listen: int, tmp: Path) -> str:
    text = SHIPPED.read_text()
    for host, port in upstreams.items():
        text = _sub(text, rf"^(\s*server ){re.escape(host)}:8000\b", rf"\g<1>127.0.0.1:{port}")
    text = _sub(text, r"^(\s*listen )8080;", rf"\g<1>127.0.0.1:{listen};")
    text = _sub(text, r"^pid /tmp/nginx\.pid;", f"pid {tmp}/nginx.pid;")
    text = _sub(text, r"access_log /dev/stdout tessera;", f"access_log {tmp}/access.log tessera;")
    text, n = re.subn(r"/tmp/nginx-", f"{tmp}/nginx-", text)
    assert n == 5
    if os.geteuid() == 0:  # workers must read the temp dirs root creates
        text = "user root;\n" + text
    return text


class NginxProxy:
    def __init__(self, tmp: Path, upstreams: dict[str, int]) -> None:
        self.binary = ensure_nginx()
        self.tmp = tmp
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.conf = tmp / "nginx.conf"
        self.conf.write_text(render_config(upstreams, self.port, tmp))
        self.log = tmp / "access.log"
        cmd = [self.binary, "-p", str(tmp), "-c", str(self.conf), "-g", "daemon off;"]
        check = subprocess.run([*cmd[:-2], "-t"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        self._err = open(tmp / "error.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._err, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.base_url + "/version", timeout=2)
                return
            except httpx.TransportError:
                assert self.proc.poll() is None, (tmp / "error.log").read_text()
                assert time.monotonic() < deadline, "nginx did not start listening"
                time.sleep(0.1)

    def upstreams_of(self, request_id: str) -> list[str]:
        """The upstream addresses nginx tried for one request, in order ("127.0.0.1:PORT").
        nginx logs a request after its last byte went out, so a client can be a moment early."""
        deadline = time.monotonic() + 10
        while True:
            for line in self.log.read_text().splitlines():
                if f"rid={request_id} " in line:
                    addr = re.search(r'upstream="([^"]*)"', line).group(1)
                    return [a for a in re.split(r",\s*|\s:\s", addr) if a]
            assert time.monotonic() < deadline, f"request {request_id} is not in nginx's log"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()
