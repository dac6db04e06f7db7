"""The multi-node overlay (deploy/k8s/overlays/kuberay): it renders with `kubectl kustomize`;
its Kubernetes objects validate against the Kubernetes schemas, its RayCluster against the
vendored KubeRay v1 schema (tests/deploy/schemas/kuberay: unknown fields refused, as
`kubectl apply --validate=strict` does) and each Ray pod template as a Pod; and it keeps the
promises the README makes: the head runs Ray and then `tessera serve` on the Ray executor with
PP = the worker pods and TP = each worker's GPUs, one worker per node, /health probes on the
head, /dev/shm and the model's claim mounted in every pod, no secret inlined."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.deploy.test_k8s import K8S, K8S_VERSION, env_of, kustomize, one

SCHEMA = Path(__file__).parent / "schemas" / "kuberay" / "ray.io_v1_raycluster.schema.json"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return kustomize(K8S / "overlays" / "kuberay")


@pytest.fixture(scope="module")
def cluster(docs) -> dict:
    return one(docs, "RayCluster")


def _head(cluster: dict) -> tuple[dict, dict]:
    pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    return pod, pod["containers"][0]  # KubeRay's Ray container is the first


def _workers(cluster: dict) -> tuple[dict, dict, dict]:
    (group,) = cluster["spec"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    return group, pod, pod["containers"][0]


def _serve_args(head: dict) -> list[str]:
    """The `tessera serve` arguments in the head's shell command."""
    (script,) = head["args"]
    words = shlex.split(script)
    start = words.index("tessera")
    assert words[start - 1] == "exec" and words[start + 1] == "serve"
    return words[start + 2 :]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """The fields the schema does not name (a structural schema prunes them silently; strict
    validation refuses them): the typos jsonschema alone lets through."""
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is None or schema.get("x-kubernetes-preserve-unknown-fields"):
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                return [
                    p for k, v in value.items() for p in unknown_fields(v, extra, f"{path}.{k}")
                ]
            return []
        out = []
        for key, item in value.items():
            if key not in props:
                out.append(f"{path}.{key}")
            else:
                out += unknown_fields(item, props[key], f"{path}.{key}")
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [
            p
            for i, v in enumerate(value)
            for p in unknown_fields(v, schema["items"], f"{path}[{i}]")
        ]
    return []


def test_objects_validate_against_the_kubernetes_schemas(docs):
    import kubernetes_validate

    kinds = {d["kind"] for d in docs}
    assert "RayCluster" in kinds and "PersistentVolumeClaim" in kinds
    # The one server is the Ray head: no Deployment, and no disruption budget that would
    # pretend a drained node leaves the engine up.
    assert not kinds & {"Deployment", "PodDisruptionBudget"}
    for doc in docs:
        if doc["kind"] != "RayCluster":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_raycluster_validates_against_the_vendored_kuberay_schema(cluster):
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator(schema).validate(cluster)
    assert cluster["apiVersion"] == "ray.io/v1"
    assert unknown_fields(cluster, schema) == []
    # The check bites: a misspelt field and a wrong type are both caught.
    typo = json.loads(json.dumps(cluster))
    typo["spec"]["workerGroupSpecs"][0]["replica"] = 2
    assert unknown_fields(typo, schema) == [".spec.workerGroupSpecs[0].replica"]
    typo["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(typo)


def test_ray_pod_templates_validate_as_pods(cluster):
    import kubernetes_validate

    templates = [cluster["spec"]["headGroupSpec"]["template"]]
    templates += [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t"}, **template}
        pod["metadata"] = {"name": "t", **template.get("metadata", {})}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_head_starts_ray_then_serves_on_the_ray_executor(cluster):
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    pod, head = _head(cluster)
    assert head["command"] == ["/bin/bash", "-lc", "--"]
    (script,) = head["args"]
    # KubeRay's generated `ray start` without --block (it would never return), then the server.
    assert "${KUBERAY_GEN_RAY_START_CMD/--block/} &&" in script
    args = _serve_args(head)
    assert _flag(args, "--distributed-executor-backend") == "ray"
    # The head holds no rank: no GPU in its pod nor in its Ray node.
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in json.dumps(head["resources"])
    init = {c["name"]: c for c in pod["initContainers"]}
    assert init["migrate"]["command"] == ["tessera", "db", "upgrade"]


def test_pipeline_stages_are_worker_pods_and_tp_is_their_gpus(cluster):
    _, head = _head(cluster)
    args = _serve_args(head)
    tp = int(_flag(args, "--tensor-parallel-size"))
    pp = int(_flag(args, "--pipeline-parallel-size"))
    assert pp >= 2
    group, pod, worker = _workers(cluster)
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pp
    assert cluster["spec"]["enableInTreeAutoscaling"] is False
    # A stage's TP ranks in one placement bundle, so on one node: a worker pod's GPUs.
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == tp
    assert int(worker["resources"]["requests"]["nvidia.com/gpu"]) == tp
    assert int(worker["resources"]["requests"]["cpu"]) >= tp  # the bundle asks a CPU a rank
    # One worker pod per node: a stage per node.
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    labels = cluster["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    assert worker["command"] == ["/bin/bash", "-lc", "--"]
    assert "$KUBERAY_GEN_RAY_START_CMD" in worker["args"][0]


def test_head_probes_follow_health(cluster):
    _, head = _head(cluster)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert head[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = head["startupProbe"]
    # Workers scheduled and every stage loaded before liveness starts counting.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["http"] == 8000


def test_shm_and_the_model_claim_in_every_ray_pod(docs, cluster):
    _, head = _head(cluster)
    claim = one(docs, "PersistentVolumeClaim", "tessera-models")
    assert set(claim["spec"]["accessModes"]) & {"ReadOnlyMany", "ReadWriteMany"}
    model = Path(_serve_args(head)[0])
    head_pod, _ = _head(cluster)
    _, worker_pod, worker = _workers(cluster)
    for pod, container in ((head_pod, head), (worker_pod, worker)):
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert mounts["dshm"]["mountPath"] == "/dev/shm"
        (models,) = [n for n, v in volumes.items() if "persistentVolumeClaim" in v]
        assert volumes[models]["persistentVolumeClaim"]["claimName"] == "tessera-models"
        assert mounts[models]["readOnly"] is True
        # Every rank opens the model at the path the head resolved.
        assert Path(mounts[models]["mountPath"]) in model.parents


def test_ray_pods_run_non_root_read_only_and_inline_no_secret(cluster):
    head_pod, head = _head(cluster)
    _, worker_pod, worker = _workers(cluster)
    for pod in (head_pod, worker_pod):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        mounted = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert "/tmp" in mounted  # Ray's session folder on a read-only root
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert "limits" in c["resources"] and "requests" in c["resources"], c["name"]
            for name, e in env_of(c).items():
                if any(s in name for s in ("TOKEN", "PASSWORD", "DATABASE_URL", "SECRET")):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], name
    env = env_of(head)
    assert env["TESSERA_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "tessera-secrets"
    assert env["TESSERA_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tessera-secrets"
    # The actors run under the workers' raylets: the same settings as the server.
    assert {"configMapRef": {"name": "tessera-config"}} in worker["envFrom"]


def test_grace_period_covers_prestop_and_the_drain(docs, cluster):
    config = one(docs, "ConfigMap", "tessera-config")["data"]
    pod, head = _head(cluster)
    prestop = head["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    margin = 10
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= float(prestop[1]) + float(config["TESSERA_SHUTDOWN_TIMEOUT"]) + margin


def test_service_and_ingress_reach_the_head(docs, cluster):
    labels = cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    workers = cluster["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= workers.items()  # never a worker pod
    backend = one(docs, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["name"] == service["metadata"]["name"]
