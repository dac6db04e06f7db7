"""Prefix affinity through a standard proxy: Debian's nginx with the shipped configuration
(deploy/nginx/nginx.conf) in front of two real `tessera serve` replicas sharing one Postgres.

- a tenant's requests land on one replica, and the tenants spread over both;
- responses carry a stable, non-secret X-Tessera-Affinity key; /health?verbose=true the load;
- SIGTERM one replica under load (a rolling restart): no request is lost (the draining replica
  finishes what it runs, its 503s before any work go to the other replica);
- SIGKILL one replica mid-test: its tenants move to the other with no failed request beyond
  those in flight on the dead one.
Also here, because it needs a real server: every metric the Grafana dashboard queries exists in
a replica's /metrics with the right type.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import tests.api.conftest as api_conftest
from tests.api.conftest import ServerProcess
from tests.api.keys_http import ADMIN_TOKEN, MODEL, Admin, bearer, fresh_database, migrate
from tests.deploy.nginx_proxy import NginxProxy, ensure_nginx

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

REPO = Path(__file__).resolve().parents[2]
NUM_TENANTS = 16  # both replicas get some: all 16 on one side has odds of about 3e-5


class Stack:
    def __init__(self, tmp: Path, model_dir: Path, url: str) -> None:
        self.tmp, self.model_dir, self.url = tmp, model_dir, url
        self.replicas: dict[str, ServerProcess] = {}

    def start_replica(self, name: str, port: int | None = None) -> ServerProcess:
        args = [
            str(self.model_dir),
            "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "2048",
            "--served-model-name", MODEL, "--database-url", self.url,
            "--data-dir", str(self.tmp / name), "--admin-token", ADMIN_TOKEN,
            "--shutdown-timeout", "30",
        ]  # fmt: skip
        log = self.tmp / f"{name}-{uuid.uuid4().hex[:6]}.log"
        if port is None:
            server = ServerProcess(args, log)
        else:  # the same address again: nginx's upstream list is fixed
            saved = api_conftest.free_port
            api_conftest.free_port = lambda: port
            try:
                server = ServerProcess(args, log)
            finally:
                api_conftest.free_port = saved
        self.replicas[name] = server
        server.wait_healthy()
        return server

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.replicas[name].port}"

    def stop(self) -> None:
        for server in self.replicas.values():
            server.stop()


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    ensure_nginx()  # before minutes of replica start-up: skip early where it cannot be had
    tmp = tmp_path_factory.mktemp("proxy")
    with fresh_database("postgres", tmp) as url:
        migrate(url)
        s = Stack(tmp, tiny_llama_dir, url)
        try:
            s.start_replica("tessera-a")
            s.start_replica("tessera-b")
            ports = {name: r.port for name, r in s.replicas.items()}
            (tmp / "nginx").mkdir()
            s.proxy = NginxProxy(tmp / "nginx", ports)
            admin = Admin(s.replicas["tessera-a"])
            s.keys = [admin.create_key(f"tenant-{i}") for i in range(NUM_TENANTS)]
            yield s
        finally:
            if getattr(s, "proxy", None) is not None:
                s.proxy.stop()
            s.stop()


def complete(stack: Stack, key: str, timeout: float = 60) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}
    return httpx.post(
        stack.proxy.base_url + "/v1/completions", json=body, headers=bearer(key), timeout=timeout
    )


def served_by(stack: Stack, response: httpx.Response) -> str:
    """The replica (name) that answered: the last upstream nginx tried."""
    last = stack.proxy.upstreams_of(response.headers["x-request-id"])[-1]
    return next(name for name in stack.replicas if stack.addr(name) == last)


def home_of(stack: Stack, strict: bool = True) -> dict[str, str]:
    """Each tenant's replica now, from three requests each (that must agree, unless not
    `strict`: while nginx takes a replica back, a tenant may move between two requests)."""
    homes = {}
    for key_id, key in stack.keys:
        seen = set()
        for _ in range(3):
            r = complete(stack, key)
            assert r.status_code == 200, r.text
            seen.add(served_by(stack, r))
        assert len(seen) == 1 or not strict, f"tenant {key_id} was spread over {seen}"
        homes[key] = seen.pop()
    return homes


def test_a_tenant_stays_on_one_replica_and_tenants_spread(stack):
    homes = home_of(stack)
    assert set(homes.values()) == {"tessera-a", "tessera-b"}, homes
    # Both replicas see the same keys: one Postgres.
    for name in stack.replicas:
        assert name in homes.values()


def test_affinity_header_is_stable_and_not_secret(stack):
    (key_id, key), (other_id, other) = stack.keys[:2]
    first = complete(stack, key).headers["x-tessera-affinity"]
    assert re.fullmatch(r"[0-9a-f]{16}", first)
    # The same from either replica, directly (it depends on the key's id, nothing per process).
    for server in stack.replicas.values():
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
            headers=bearer(key),
            timeout=60,
        )
        assert r.headers["x-tessera-affinity"] == first
    assert complete(stack, other).headers["x-tessera-affinity"] != first
    assert first not in key and hashlib.sha256(key.encode()).hexdigest()[:16] != first
    # Errors of an authenticated request carry it too; unauthenticated ones do not.
    bad = httpx.post(
        stack.proxy.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": -1},
        headers=bearer(key),
        timeout=30,
    )
    assert bad.status_code == 400 and bad.headers["x-tessera-affinity"] == first
    anon = httpx.post(stack.proxy.base_url + "/v1/completions", json={}, timeout=30)
    assert anon.status_code == 401 and "x-tessera-affinity" not in anon.headers
    # A tenant sending the key back as a request header stays where the header hashes.
    r = httpx.post(
        stack.proxy.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={**bearer(key), "X-Tessera-Affinity": first},
        timeout=60,
    )
    assert r.status_code == 200


def test_health_verbose_reports_load(stack):
    body = httpx.get(
        stack.replicas["tessera-a"].base_url + "/health", params={"verbose": "true"}, timeout=10
    ).json()
    load = body["load"]
    assert set(load) == {"running", "waiting", "kv_cache_usage", "inflight_requests", "draining"}
    assert load["draining"] is False and load["running"] >= 0 and load["waiting"] >= 0
    assert 0.0 <= load["kv_cache_usage"] <= 1.0


def test_dashboard_metrics_exist_in_a_real_servers_metrics(stack):
    text = httpx.get(stack.replicas["tessera-a"].base_url + "/metrics", timeout=10).text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    dashboard = json.loads((REPO / "deploy" / "grafana" / "tessera.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    variables = [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    names = set()
    for expr in exprs + variables:
        names |= set(re.findall(r"\b((?:vllm|tessera):[a-zA-Z0-9_:]+)", expr))
    assert len(names) >= 15
    for name in sorted(names):
        base, kind = name, "gauge"
        for suffix, k in (("_bucket", "histogram"), ("_total", "counter")):
            if name.endswith(suffix):
                base, kind = name[: -len(suffix)], k
        # prometheus-client names a counter family with or without its _total suffix.
        found = types.get(name) or types.get(base)
        assert found, f"the dashboard queries {name}, which /metrics does not have"
        assert found == kind, f"the dashboard queries {name} as a {kind}; /metrics has a {found}"


def test_a_full_replica_spills_its_tenant_to_the_next(stack, tmp_path):
    """max_conns: with the cap at 1, a tenant's second concurrent request goes to the next
    replica on the ring. The home replica is stopped (SIGSTOP) so the first request stays in
    flight there, deterministically, until the test lets it go."""
    key = stack.keys[0][1]

    def cap_at_one(text: str) -> str:
        out, n = re.subn(r"max_conns=\d+", "max_conns=1", text)
        assert n == 2
        # No upstream keep-alive: each request opens its own connection, which the test
        # watches for (an idle kept-alive one would look like the first request).
        out, n = re.subn(r"^\s*keepalive \d+;\n", "", out, flags=re.M)
        assert n == 1
        return out

    proxy = NginxProxy(tmp_path, {name: r.port for name, r in stack.replicas.items()}, cap_at_one)
    try:
        _spill(stack, proxy, key)
    finally:
        proxy.stop()


def _spill(stack: Stack, proxy: NginxProxy, key: str) -> None:
    # The tenant's home as this nginx's ring places it (the module's proxy may have a replica
    # marked down for fail_timeout after an earlier test, and place it elsewhere for now).
    warm = httpx.post(
        proxy.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 1},
        headers=bearer(key),
        timeout=60,
    )
    assert warm.status_code == 200, warm.text
    last = proxy.upstreams_of(warm.headers["x-request-id"])[-1]
    home = next(name for name in stack.replicas if stack.addr(name) == last)
    other = next(n for n in stack.replicas if n != home)
    home_port = stack.replicas[home].port
    deadline = time.monotonic() + 30
    while proxy.connected_to(home_port):  # the warm request's connection, being closed
        assert time.monotonic() < deadline, "nginx kept its connection to the home replica"
        time.sleep(0.05)
    first: dict = {}
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}

    def send_first() -> None:
        first["r"] = httpx.post(
            proxy.base_url + "/v1/completions", json=body, headers=bearer(key), timeout=120
        )

    thread = threading.Thread(target=send_first)
    stack.replicas[home].signal(signal.SIGSTOP)
    try:
        thread.start()
        # This nginx's connection to the stopped home replica: the first request, counted
        # against home's max_conns. Only once it is there may the second go, or it could
        # overtake the first, reach the stopped home and wait there.
        deadline = time.monotonic() + 60
        while not proxy.connected_to(home_port):
            assert time.monotonic() < deadline, "nginx never connected to the home replica"
            time.sleep(0.05)
        second = httpx.post(
            proxy.base_url + "/v1/completions", json=body, headers=bearer(key), timeout=60
        )
        assert second.status_code == 200, second.text
        # Home was full: nginx did not even try it.
        assert proxy.upstreams_of(second.headers["x-request-id"]) == [stack.addr(other)]
    finally:
        stack.replicas[home].signal(signal.SIGCONT)
    thread.join(timeout=120)
    assert first["r"].status_code == 200
    assert proxy.upstreams_of(first["r"].headers["x-request-id"]) == [stack.addr(home)]


def _load(stack: Stack, stop: threading.Event, results: list, streaming: bool) -> None:
    """One client: its tenant's requests one after the other until `stop`."""
    i = len(results)
    key = stack.keys[i % len(stack.keys)][1]
    body = {"model": MODEL, "prompt": f"Tenant {i} says", "max_tokens": 12, "ignore_eos": True}
    while not stop.is_set():
        rec = {"t0": time.monotonic(), "started": False, "ok": False, "key": key}
        results.append(rec)
        try:
            if streaming:
                with httpx.stream(
                    "POST",
                    stack.proxy.base_url + "/v1/completions",
                    json={**body, "stream": True},
                    headers=bearer(key),
                    timeout=60,
                ) as r:
                    rec["status"] = r.status_code
                    rec["rid"] = r.headers.get("x-request-id")
                    events = []
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            rec["started"] = True
                            events.append(line[6:])
                    rec["ok"] = (
                        r.status_code == 200
                        and events[-1:] == ["[DONE]"]
                        and not any('"error"' in e for e in events)
                    )
            else:
                r = complete(stack, key)
                rec.update(status=r.status_code, rid=r.headers.get("x-request-id"))
                rec["ok"] = r.status_code == 200 and len(r.json()["choices"][0]["text"]) >= 0
        except httpx.HTTPError as exc:
            rec["error"] = repr(exc)
        rec["t1"] = time.monotonic()


def run_load(stack: Stack, during, clients: int = 6, streaming: bool = True) -> list[dict]:
    """`clients` threads of sequential requests; `during()` runs once they are all going."""
    stop = threading.Event()
    results: list[dict] = []
    with ThreadPoolExecutor(clients) as pool:
        futures = []
        for _ in range(clients):
            futures.append(pool.submit(_load, stack, stop, results, streaming))
            time.sleep(0.05)
        while sum(1 for r in results if "t1" in r) < 2 * clients:  # warm: each done a few
            time.sleep(0.05)
        try:
            during()
        finally:
            stop.set()
            for f in futures:
                f.result(timeout=120)
    return results


def test_rolling_restart_loses_no_request(stack):
    b = stack.replicas["tessera-b"]
    port = b.port
    marks: dict[str, float] = {}

    def restart_b() -> None:
        marks["sigterm"] = time.monotonic()
        b.signal(signal.SIGTERM)
        assert b.proc.wait(timeout=90) == 0, b.log()  # drained, then exited cleanly
        marks["exited"] = time.monotonic()
        # Under load until the replacement is up on the same address.
        stack.start_replica("tessera-b", port=port)

    results = run_load(stack, restart_b, streaming=True)
    during = [r for r in results if r["t0"] < marks["exited"] and r["t1"] > marks["sigterm"]]
    assert len(during) >= 6, "no load while the replica drained"
    lost = [r for r in results if not r["ok"] and not r["started"]]
    assert not lost, lost[:3]
    # Stronger than the promise: a draining replica finishes the streams it started too.
    broken = [r for r in results if not r["ok"]]
    assert not broken, broken[:3]
    # The retried ones: nginx tried b (draining: 503, or gone: refused), then a.
    retried = [r for r in during if len(stack.proxy.upstreams_of(r["rid"])) > 1]
    for r in retried:
        assert stack.proxy.upstreams_of(r["rid"])[-1] == stack.addr("tessera-a")


def test_killed_replica_moves_its_tenants_to_the_other(stack):
    # After the rolling restart nginx keeps b out for fail_timeout (10 s), then b's tenants
    # come back to it.
    deadline = time.monotonic() + 60
    while not (
        b_tenants := {k for k, h in home_of(stack, strict=False).items() if h == "tessera-b"}
    ):
        assert time.monotonic() < deadline, "nginx never sent b its tenants back"
        time.sleep(1)
    b = stack.replicas["tessera-b"]
    marks: dict[str, float] = {}

    def kill_b() -> None:
        marks["kill"] = time.monotonic()
        b.proc.kill()
        b.proc.wait(timeout=30)
        # SIGKILL is not death: until the process is torn down (a loaded model's pages, on a
        # busy machine: tens of ms and more) its listening socket still takes connections
        marks["dead"] = time.monotonic()
        time.sleep(1.0)  # keep the load on for a while without b

    results = run_load(stack, kill_b, streaming=False)
    failed = [r for r in results if not r["ok"]]
    # Only requests in flight on b while it died may fail (nginx retries those it can: a
    # request whose response had not begun goes to the next replica).
    for r in failed:
        assert r["t0"] < marks["dead"] and r["t1"] > marks["kill"], r
    after = [r for r in results if r["t0"] > marks["dead"]]
    assert len(after) >= 6
    assert all(r["ok"] for r in after)
    # b's tenants now land on a.
    for key in b_tenants:
        r = complete(stack, key)
        assert r.status_code == 200 and served_by(stack, r) == "tessera-a"
