"""The Kubernetes manifests: every overlay renders with `kubectl kustomize`, validates against
the Kubernetes schemas (kubernetes-validate, offline), and keeps the promises the README makes:
probes on /health with a startupProbe for model loading, the schema migrated by an init
container before the server starts, a grace period longer than preStop + the drain timeout,
a non-root read-only container, and no secret value in any rendered manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu", "trial-postgres"]
COMPONENTS = ["servicemonitor", "keda"]
K8S_VERSION = "1.30.0"  # the oldest Kubernetes these manifests promise to work on
CRD_KINDS = {"ServiceMonitor", "ScaledObject"}  # not in the core schemas: checked by hand


def kustomize(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays")
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def with_components(tmp_path: Path, overlay: str) -> Path:
    """A kustomization of an overlay plus every optional component (what an operator writes)."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "overlays" / overlay, tmp_path)],
                "components": [
                    os.path.relpath(K8S / "components" / c, tmp_path) for c in COMPONENTS
                ],
            }
        )
    )
    return tmp_path


def one(docs: list[dict], kind: str, name: str = "tessera") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, kustomize(K8S / "overlays" / request.param)


def test_every_manifest_validates_against_the_kubernetes_schemas(rendered):
    import kubernetes_validate

    _, docs = rendered
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_components_render_and_validate(tmp_path):
    import kubernetes_validate

    docs = kustomize(with_components(tmp_path, "cpu"))
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = one(docs, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    scaled = one(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "tessera",
    }
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    assert scaled["spec"]["minReplicaCount"] >= 2  # never below the PDB's floor of one + one


def test_probes_follow_health_and_tolerate_model_loading(rendered):
    _, docs = rendered
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"]["path"] == "/health", probe
        assert server[probe]["httpGet"]["port"] == "http"
    startup = server["startupProbe"]
    # Liveness only starts once the startupProbe passed: a model may take minutes to load.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    ready = server["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 10  # a stuck replica leaves soon


def test_migration_runs_before_the_server_starts(rendered):
    _, docs = rendered
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    init = {c["name"]: c for c in pod["initContainers"]}
    migrate = init["migrate"]
    assert migrate["command"] == ["tessera", "db", "upgrade"]
    assert env_of(migrate)["TESSERA_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "tessera-secrets",
        "key": "database-url",
    }
    (server,) = pod["containers"]
    assert "db" not in server.get("args", []) and "command" not in server  # the image's `serve`
    # No Job racing the replicas: the init containers are the only migrators, serialised by
    # the Postgres advisory lock `tessera db upgrade` takes (tests/deploy/test_migrate_lock.py).
    assert not [d for d in docs if d["kind"] == "Job"]


def test_grace_period_covers_prestop_and_the_drain(rendered):
    _, docs = rendered
    config = one(docs, "ConfigMap", "tessera-config")["data"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    prestop = server["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    shutdown = float(config["TESSERA_SHUTDOWN_TIMEOUT"])
    margin = 10  # the abort flush, the ledger flush, the engine's stop
    assert pod["terminationGracePeriodSeconds"] >= float(prestop[1]) + shutdown + margin
    # The preStop sleep outlasts one readiness period, so the endpoint leaves first.
    assert float(prestop[1]) >= server["readinessProbe"]["periodSeconds"]
    strategy = one(docs, "Deployment")["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_containers_run_non_root_on_a_read_only_root(rendered):
    _, docs = rendered
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        mounts_ok = {v["name"] for v in pod["volumes"]}
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert "limits" in c["resources"] and "requests" in c["resources"], c["name"]
            for m in c.get("volumeMounts", []):
                assert m["name"] in mounts_ok or m["name"] in _claims(doc)
    # Every place Tessera writes is a volume: caches, data, /tmp.
    tessera = one(docs, "Deployment")["spec"]["template"]["spec"]
    config = one(docs, "ConfigMap", "tessera-config")["data"]
    mounted = {m["mountPath"] for m in tessera["containers"][0]["volumeMounts"]}
    for var in ("TESSERA_CACHE_DIR", "TESSERA_DATA_DIR", "HOME", "TMPDIR"):
        assert any(config[var] == p or config[var].startswith(p + "/") for p in mounted), var
    for var in ("TRITON_CACHE_DIR", "XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        assert config[var].startswith(config["TESSERA_CACHE_DIR"] + "/"), var


def _claims(doc: dict) -> set[str]:
    return {c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])}


def test_no_secret_is_inlined(rendered):
    _, docs = rendered
    assert not [d for d in docs if d["kind"] == "Secret"], "secrets are created out of band"
    sensitive = ("TOKEN", "PASSWORD", "DATABASE_URL", "API_KEY", "SECRET")
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            pod = doc["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                for name, e in env_of(c).items():
                    if any(s in name for s in sensitive):
                        assert "value" not in e and "secretKeyRef" in e["valueFrom"], name
                assert not any("tsr-" in a or "tsa-" in a for a in c.get("args", []))
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "tessera-config":
            assert not [k for k in doc["data"] if any(s in k for s in sensitive)]
    text = json.dumps(docs)
    assert "postgresql+asyncpg://" not in text and "tsa-" not in text and "tsr-" not in text


def test_admin_token_and_database_url_come_from_one_secret(rendered):
    _, docs = rendered
    (server,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = env_of(server)
    assert env["TESSERA_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tessera-secrets"
    assert env["TESSERA_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "tessera-secrets"


def test_service_pdb_and_ingress_select_the_replicas(rendered):
    _, docs = rendered
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert one(docs, "Service")["spec"]["selector"].items() <= labels.items()
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    ann = one(docs, "Ingress")["metadata"]["annotations"]
    assert ann["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_authorization"
    assert float(ann["nginx.ingress.kubernetes.io/upstream-hash-by-balance-factor"]) > 1
    retry_on = ann["nginx.ingress.kubernetes.io/proxy-next-upstream"].split()
    assert {"error", "http_503", "non_idempotent"} <= set(retry_on)
    assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # SSE


def test_gpu_overlay_matches_tensor_parallel_size_to_its_gpus():
    docs = kustomize(K8S / "overlays" / "gpu")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    args = server["args"]
    tp = int(args[args.index("--tensor-parallel-size") + 1])
    assert int(server["resources"]["limits"]["nvidia.com/gpu"]) == tp
    assert int(server["resources"]["requests"]["nvidia.com/gpu"]) == tp
    shm = [v for v in pod["volumes"] if v["name"] == "dshm"][0]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in server["volumeMounts"]


def test_trial_postgres_is_marked_not_for_production():
    docs = kustomize(K8S / "overlays" / "trial-postgres")
    pg = one(docs, "StatefulSet", "tessera-postgres")
    assert pg["spec"]["replicas"] == 1
    password = env_of(pg["spec"]["template"]["spec"]["containers"][0])["POSTGRES_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"]["name"] == "tessera-postgres"
    text = (K8S / "overlays" / "trial-postgres" / "kustomization.yaml").read_text()
    assert "NOT FOR PRODUCTION" in text


def test_dashboard_configmap_is_the_compose_dashboard():
    docs = kustomize(K8S / "overlays" / "cpu")
    cm = one(docs, "ConfigMap", "tessera-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (REPO / "deploy" / "grafana" / "tessera.json").read_text()
    # kustomize may only read files below its root: base/grafana/tessera.json is a copy.
    assert cm["data"]["tessera.json"] == shipped, (
        "deploy/k8s/base/grafana/tessera.json differs from deploy/grafana/tessera.json: "
        "cp deploy/grafana/tessera.json deploy/k8s/base/grafana/tessera.json"
    )


def test_yaml_lints():
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig(
        "extends: default\nrules:\n  line-length: {max: 130}\n  document-start: disable\n"
        "  truthy: {check-keys: false}\n  comments: {min-spaces-from-content: 1}\n"
    )
    files = sorted((REPO / "deploy").rglob("*.yaml")) + sorted((REPO / "deploy").rglob("*.yml"))
    assert len(files) >= 15
    problems = []
    for path in files:
        for p in linter.run(path.read_text(), config, str(path)):
            if p.level == "error":
                problems.append(f"{path.relative_to(REPO)}:{p.line}: {p.desc} ({p.rule})")
    assert not problems, "\n".join(problems)
