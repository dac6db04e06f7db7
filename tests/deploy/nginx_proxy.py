"""The shipped nginx configuration (deploy/nginx/nginx.conf) run in front of loopback replicas.

    ensure_nginx()                                     # Debian's nginx, installed when missing
    proxy = NginxProxy(tmp, {"tessera-a": port_a, "tessera-b": port_b})
    proxy.base_url; proxy.upstreams_of(request_id)     # from its access log; proxy.stop()

Only addresses and paths are rewritten (benchmarks/bench_affinity.render_nginx_config: upstream
servers and the listen port to loopback, the pid, temp and log paths into tmp): each rewrite
must match exactly once, so a change to the shipped file's shape fails here instead of testing
some other configuration.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

from benchmarks.bench_affinity import nginx_binary, render_nginx_config
from tests.api.conftest import free_port
from tests.debian import ensure_debian_binary

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "deploy" / "nginx" / "nginx.conf"


def ensure_nginx() -> str:
    return ensure_debian_binary("nginx", "nginx", nginx_binary)


def render_config(upstreams: dict[str, int], listen: int, tmp: Path) -> str:
    return render_nginx_config(upstreams, listen, tmp, affinity=True)


class NginxProxy:
    def __init__(self, tmp: Path, upstreams: dict[str, int], edit=None) -> None:
        """`edit`: a function of the rendered configuration text (a test's own variant)."""
        self.binary = ensure_nginx()
        self.tmp = tmp
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.conf = tmp / "nginx.conf"
        text = render_config(upstreams, self.port, tmp)
        self.conf.write_text(edit(text) if edit else text)
        self.log = tmp / "access.log"
        cmd = [self.binary, "-p", str(tmp), "-c", str(self.conf), "-g", "daemon off;"]
        check = subprocess.run([*cmd[:-2], "-t"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        self._err = open(tmp / "error.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._err, stderr=subprocess.STDOUT)
        # Wait with a bare TCP connect: a request would open an upstream connection, which
        # nginx then keeps (keepalive) and a test counting connections would see.
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
                return
            except OSError:
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

    def connected_to(self, port: int) -> bool:
        """Whether one of this nginx's own processes holds an established connection to
        127.0.0.1:`port`. Only its own: other proxies (the module's, earlier tests') keep
        keep-alive connections to the same replicas, which a host-wide look would count."""
        import psutil

        master = psutil.Process(self.proc.pid)
        for proc in [master, *master.children()]:
            try:
                conns = proc.net_connections(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            if any(
                c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
                for c in conns
            ):
                return True
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()
