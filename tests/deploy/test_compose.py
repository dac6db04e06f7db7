"""The compose stack, Prometheus' configuration, the Grafana dashboard and provisioning, and
the HAProxy alternative parse and agree with each other (no Docker engine is needed: what
compose would run is read from the files). The dashboard's metrics are checked against a real
server's /metrics in test_proxy_affinity.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_has_two_replicas_postgres_nginx_prometheus_grafana():
    services = compose()["services"]
    assert {"postgres", "migrate", "tessera-a", "tessera-b", "nginx", "prometheus", "grafana"} <= (
        set(services)
    )
    for name in ("tessera-a", "tessera-b"):
        replica = services[name]
        env = replica["environment"]
        assert env["TESSERA_DATABASE_URL"].startswith("postgresql+asyncpg://tessera:${")
        assert env["TESSERA_ADMIN_TOKEN"].startswith("${TESSERA_ADMIN_TOKEN:?")  # required
        # The migration finished before a replica starts.
        assert replica["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        grace = int(replica["stop_grace_period"].rstrip("s"))
        assert grace > float(env["TESSERA_SHUTDOWN_TIMEOUT"])
    assert services["migrate"]["entrypoint"] == ["tessera", "db", "upgrade"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_no_secret_value_in_compose():
    text = (DEPLOY / "compose.yaml").read_text()
    services = compose()["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${")
    assert "tsa-" not in text and "tsr-" not in text


def test_compose_mounts_what_exists():
    services = compose()["services"]
    for name in ("nginx", "prometheus", "grafana"):
        for volume in services[name].get("volumes", []):
            src = volume.split(":")[0]
            if src.startswith("./"):
                assert (DEPLOY / src).exists(), f"{name} mounts missing {src}"


def test_prometheus_scrapes_both_replicas():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    targets = job["static_configs"][0]["targets"]
    assert sorted(targets) == ["tessera-a:8000", "tessera-b:8000"]


def test_dashboard_parses_and_covers_the_promised_panels():
    dashboard = json.loads((DEPLOY / "grafana" / "tessera.json").read_text())
    assert dashboard["uid"] == "tessera"
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for needed in (
        "vllm:request_success_total",  # requests
        "vllm:time_to_first_token_seconds_bucket",  # TTFT percentiles
        "vllm:inter_token_latency_seconds_bucket",  # TPOT percentiles
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",  # queue depth
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",  # prefix hit rate
        "tessera:tokens_total",  # per-key tokens
        "tessera:quota_rejections_total",  # rejections by reason
        "tessera:admission_rejections_total",
    ):
        assert needed in exprs, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert re.search(r"\[\$__rate_interval\]|_perc|num_requests|alive", json.dumps(panel))


def test_grafana_provisioning_points_at_the_dashboard():
    services = compose()["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "tessera.yaml").read_text()
    )
    folder = provider["providers"][0]["options"]["path"]
    assert mounts["./grafana/tessera.json"] == f"{folder}/tessera.json"
    ds = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"


def test_nginx_config_is_valid_as_shipped(tmp_path):
    """nginx -t on the shipped file, the upstream names resolved to loopback."""
    from tests.deploy.nginx_proxy import ensure_nginx, render_config

    nginx = ensure_nginx()
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_config({"tessera-a": 18001, "tessera-b": 18002}, 18080, tmp_path))
    out = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True)
    assert out.returncode == 0, out.stderr.decode()
    text = (DEPLOY / "nginx" / "nginx.conf").read_text()
    assert "hash $tessera_affinity consistent;" in text
    assert re.search(r"proxy_next_upstream error timeout http_502 http_503 non_idempotent;", text)
    servers = re.findall(r"^\s*server tessera-[ab]:8000 (.*);$", text, flags=re.M)
    assert len(servers) == 2 and all("max_fails=1" in s and "max_conns=" in s for s in servers)


def test_haproxy_config_is_valid_as_shipped(tmp_path):
    from tests.debian import ensure_debian_binary

    haproxy = ensure_debian_binary("haproxy", "haproxy")
    out = subprocess.run(
        [haproxy, "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")], capture_output=True
    )
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    text = (DEPLOY / "haproxy" / "haproxy.cfg").read_text()
    assert "hash-type consistent" in text and "hash-balance-factor 150" in text
