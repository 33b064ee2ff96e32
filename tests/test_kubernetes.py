"""``deploy/kubernetes/``: every manifest is valid against the Kubernetes API schemas
(strict: an unknown field is an error), offline with the ``kubernetes-validate`` package,
and the manifests fit together (selectors, ports, Secrets, the agents' API address; the
Kubernetes engine's variant of the API, its service account and roles).

Offline: no manifest is applied here. The Kubernetes engine's tests
(``tests/e2e/test_kubernetes_engine.py``) run against a real control plane with the Role and
ClusterRole of ``engine-rbac.yaml``; ``deploy/kubernetes/README.md`` says what is tested."""

from __future__ import annotations

import copy
import re
import socket
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.config import Settings
from service.engines import kubernetes_objects as k8s
from service.engines.base import LaunchRequest
from service.engines.kubernetes import CLUSTER_SCOPED as ENGINE_CLUSTER_SCOPED
from service.engines.kubernetes import NEEDED

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
VERSION = "1.37"  # the newest schemas kubernetes-validate==1.37.0 (dev extra) bundles
SECRETS = {
    "torchyard-postgres": {"password"},
    "torchyard-database": {"url"},
    "torchyard-worker-token": {"token"},
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
# The lines of api.yaml that make it the Kubernetes engine's: the README's sed line uncomments them.
ENGINE_LINE = re.compile(r"^( *)# (.*# Kubernetes engine)$", re.M)
ENGINE_SED = "sed -E 's/^( *)# (.*# Kubernetes engine)$/\\1\\2/'"
ACCOUNT = {"kind": "ServiceAccount", "name": "torchyard-api", "namespace": "torchyard"}
READ_ONLY = {"get", "list", "watch"}


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(ROOT.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc:
                found.append((path.name, doc))
    return found


MANIFESTS = _manifests()


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def _named(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _of_kind(kind) if d["metadata"]["name"] == name]
    return doc


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a network connection fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("kubernetes-validate tried the network")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_the_manifests_are_what_the_readme_lists() -> None:
    kinds = sorted((name, doc["kind"], doc["metadata"]["name"]) for name, doc in MANIFESTS)
    assert kinds == [
        ("api.yaml", "Deployment", "torchyard-api"),
        ("api.yaml", "PersistentVolumeClaim", "torchyard-api-data"),
        ("api.yaml", "Service", "torchyard-api"),
        ("engine-rbac.yaml", "ClusterRole", "torchyard-engine-nodes"),
        ("engine-rbac.yaml", "ClusterRoleBinding", "torchyard-engine-nodes"),
        ("engine-rbac.yaml", "Role", "torchyard-engine"),
        ("engine-rbac.yaml", "RoleBinding", "torchyard-engine"),
        ("engine-rbac.yaml", "ServiceAccount", "torchyard-api"),
        ("namespace.yaml", "Namespace", "torchyard"),
        ("postgres.yaml", "Service", "torchyard-postgres"),
        ("postgres.yaml", "StatefulSet", "torchyard-postgres"),
        ("workers.yaml", "DaemonSet", "torchyard-worker"),
    ]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in {name for name, _ in MANIFESTS}:
        assert f"`{name}`" in readme
    for secret in SECRETS:
        assert f"create secret generic {secret}" in readme


@pytest.mark.parametrize("index", range(len(MANIFESTS)), ids=[f"{n}:{d['kind']}" for n, d in MANIFESTS])
def test_each_manifest_is_valid_against_the_kubernetes_schemas(index: int, offline: None) -> None:
    _, doc = MANIFESTS[index]
    assert kubernetes_validate.validate(doc, VERSION, strict=True) == VERSION


def test_a_wrong_field_is_caught(offline: None) -> None:
    """The validation can fail: a misspelt field and a wrong type are both refused."""
    deployment = copy.deepcopy(_named("Deployment", "torchyard-api"))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)
    daemonset = copy.deepcopy(_named("DaemonSet", "torchyard-worker"))
    daemonset["spec"]["template"]["spec"]["hostNetwork"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSION, strict=True)


def _pod_templates() -> list[dict[str, Any]]:
    return [d["spec"]["template"] for k in ("Deployment", "StatefulSet", "DaemonSet") for d in _of_kind(k)]


def test_the_manifests_fit_together() -> None:
    for _, doc in MANIFESTS:
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"]["namespace"] == "torchyard", doc["metadata"]
        else:
            assert "namespace" not in doc["metadata"], doc["metadata"]
    for kind in ("Deployment", "StatefulSet", "DaemonSet"):
        for doc in _of_kind(kind):
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Each Service selects a pod template and names a port its container has.
    for service in _of_kind("Service"):
        selector = service["spec"]["selector"]
        (pod,) = [t for t in _pod_templates() if selector.items() <= t["metadata"]["labels"].items()]
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports
    # Every Secret a pod reads is one the README tells how to create, with that key.
    refs = [
        env["valueFrom"]["secretKeyRef"]
        for pod in _pod_templates()
        for container in pod["spec"]["containers"]
        for env in container.get("env", [])
        if "secretKeyRef" in env.get("valueFrom", {})
    ]
    assert {r["name"] for r in refs} == set(SECRETS)
    for ref in refs:
        assert ref["key"] in SECRETS[ref["name"]], ref
    # The API's volume claim, and the agents' API address: the Service's name, namespace and port.
    api = _named("Deployment", "torchyard-api")["spec"]["template"]["spec"]
    assert api["volumes"][0]["persistentVolumeClaim"]["claimName"] == "torchyard-api-data"
    port = _named("Service", "torchyard-api")["spec"]["ports"][0]["port"]
    args = _named("DaemonSet", "torchyard-worker")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--api") + 1] == f"http://torchyard-api.torchyard.svc.cluster.local:{port}"
    # The database URL of the README's in-cluster example names the StatefulSet's pod and Service.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "@torchyard-postgres-0.torchyard-postgres:5432/torchyard" in readme


def test_the_agents_run_as_the_cli_expects() -> None:
    """The DaemonSet's command is one ``torchyard worker`` accepts."""
    import argparse

    from worker.agent.main import add_arguments

    container = _named("DaemonSet", "torchyard-worker")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "worker"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    assert args.name == "$(NODE_NAME)" and args.address == "$(NODE_IP)"
    names = {e["name"] for e in container["env"]}
    assert {"NODE_NAME", "NODE_IP", "TORCHYARD_TOKEN"} <= names


# --- the Kubernetes engine: its service account and roles, its variant of the API --------


def _grants(kind: str, name: str) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) for every verb the role grants."""
    return {
        (group, resource, verb)
        for rule in _named(kind, name)["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_engine_role_grants_what_the_driver_needs_and_no_more() -> None:
    """The driver checks ``NEEDED`` at start; nodes are cluster-scoped, the rest is in its
    namespace. The Role covers exactly NEEDED's resources, writes exactly what NEEDED writes,
    and adds only reads; the ClusterRole only reads nodes and lists pods (what every node's
    pods request: ``inventory`` lists them in all namespaces)."""
    role = _grants("Role", "torchyard-engine")
    cluster = _grants("ClusterRole", "torchyard-engine-nodes")
    namespaced = {n for n in NEEDED if n[1] not in ENGINE_CLUSTER_SCOPED}
    assert namespaced <= role
    assert {n for n in NEEDED if n[1] in ENGINE_CLUSTER_SCOPED} <= cluster
    assert {(g, r) for g, r, _ in role} == {(g, r) for g, r, _ in namespaced}
    assert {n for n in role if n[2] not in READ_ONLY} == {n for n in namespaced if n[2] not in READ_ONLY}
    assert role == {
        *(("", "pods", v) for v in ("create", "get", "list", "watch", "delete")),
        ("", "pods/log", "get"),
        *(("", "services", v) for v in ("create", "get", "list", "delete")),
        ("", "events", "get"),
        ("", "events", "list"),
    }
    assert cluster == {
        ("", "nodes", "get"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        ("", "pods", "list"),
        ("", "namespaces", "get"),
    }
    # Only what torchyard makes: no Secrets, no RBAC, no wildcards.
    for kind, name in (("Role", "torchyard-engine"), ("ClusterRole", "torchyard-engine-nodes")):
        for rule in _named(kind, name)["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
            assert "nonResourceURLs" not in rule, rule
            # Names narrow a rule: only the engine's own namespace may be read by name.
            if "resourceNames" in rule:
                assert rule["resources"] == ["namespaces"] and rule["resourceNames"] == ["torchyard"], rule


def test_the_engine_account_is_bound_to_its_roles() -> None:
    account = _named("ServiceAccount", "torchyard-api")["metadata"]
    assert {"name": account["name"], "namespace": account["namespace"]} == {
        "name": ACCOUNT["name"],
        "namespace": ACCOUNT["namespace"],
    }
    for binding_kind, role_kind, name in (
        ("RoleBinding", "Role", "torchyard-engine"),
        ("ClusterRoleBinding", "ClusterRole", "torchyard-engine-nodes"),
    ):
        binding = _named(binding_kind, name)
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": role_kind,
            "name": name,
        }
        assert binding["subjects"] == [ACCOUNT]
    assert _named("RoleBinding", "torchyard-engine")["metadata"]["namespace"] == "torchyard"


def _engine_api() -> dict[str, Any]:
    """api.yaml's Deployment with the lines for the Kubernetes engine uncommented."""
    text = ENGINE_LINE.sub(r"\1\2", (ROOT / "api.yaml").read_text(encoding="utf-8"))
    (deployment,) = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "Deployment"]
    return deployment


def _plain_env(deployment: dict[str, Any]) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_api_yaml_as_it_is_runs_the_agents_engine() -> None:
    """Applied as it is, the API runs the agents (the default engine) under the namespace's
    default account; with the Kubernetes engine the agents' DaemonSet must not run, and both
    workers.yaml and the README say so."""
    deployment = _named("Deployment", "torchyard-api")
    assert "serviceAccountName" not in deployment["spec"]["template"]["spec"]
    env = _plain_env(deployment)
    assert not [name for name in env if name.startswith(("TORCHYARD_ENGINE", "TORCHYARD_K8S_"))], env
    assert len(ENGINE_LINE.findall((ROOT / "api.yaml").read_text(encoding="utf-8"))) >= 5
    workers = (ROOT / "workers.yaml").read_text(encoding="utf-8")
    assert workers.startswith("# NOT with the Kubernetes engine (TORCHYARD_ENGINE=kubernetes)")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`workers.yaml` must not be applied" in readme
    assert ENGINE_SED in readme


def test_the_api_with_the_kubernetes_engine_fits_the_rest(offline: None, tmp_path: Path) -> None:
    """The Kubernetes engine's variant of api.yaml is a valid Deployment running as the
    engine's account, with settings the service accepts: the namespace the Role is in, the
    workers' image, the API's Service as pods reach it; and the pod it makes from them (the
    pod patch's volumes included) is valid too."""
    deployment = _engine_api()
    assert kubernetes_validate.validate(deployment, VERSION, strict=True) == VERSION
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == ACCOUNT["name"]
    assert deployment["metadata"]["namespace"] == ACCOUNT["namespace"]
    env = _plain_env(deployment)
    assert env["TORCHYARD_ENGINE"] == "kubernetes"
    assert env["TORCHYARD_K8S_NAMESPACE"] == _named("Role", "torchyard-engine")["metadata"]["namespace"]
    workers = _named("DaemonSet", "torchyard-worker")["spec"]["template"]["spec"]["containers"][0]
    assert env["TORCHYARD_K8S_IMAGE"] == workers["image"]
    service = _named("Service", "torchyard-api")
    port = service["spec"]["ports"][0]["port"]
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert env["TORCHYARD_K8S_API_URL"] == f"http://{name}.{namespace}.svc:{port}"

    values: dict[str, Any] = {k.removeprefix("TORCHYARD_").lower(): v for k, v in env.items()}
    settings = Settings(**(values | {"data_dir": tmp_path / "data"}))
    k8s.check_settings(settings)
    request = LaunchRequest(
        job_id="0" * 32,
        attempt_id="1" * 32,
        attempt_number=1,
        node_count=2,
        process_count_per_node=4,
        launch_token="token",
    )
    for gpus in (True, False):
        pod = k8s.pod(settings, request, 1, "uid", gpus)
        pod["metadata"]["namespace"] = settings.k8s_namespace
        assert kubernetes_validate.validate(pod, VERSION, strict=True) == VERSION
    (container,) = pod["spec"]["containers"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/dev/shm", settings.k8s_work_dir} <= mounts
    assert container["args"][container["args"].index("--work-dir") + 1] == settings.k8s_work_dir


def test_the_guides_name_every_setting_of_the_engine_with_its_default() -> None:
    """docs/kubernetes.md's table names every ``k8s_*`` setting with its default, the
    README's every one; the links of both lead to files that exist."""
    names = sorted(f"TORCHYARD_{name.upper()}" for name in Settings.model_fields if name.startswith("k8s_"))
    guide = ROOT.parent.parent / "docs" / "kubernetes.md"
    rows = dict(
        re.findall(r"^\| `(TORCHYARD_K8S_[A-Z_]+)` \| ([^|]+?) \|", guide.read_text(encoding="utf-8"), re.M)
    )
    assert sorted(rows) == names
    for name, cell in rows.items():
        default = Settings.model_fields[name.removeprefix("TORCHYARD_").lower()].default
        if default not in (None, ""):
            assert cell == f"`{default}`", name
    readme = ROOT / "README.md"
    listed = re.findall(r"^\| `(TORCHYARD_K8S_[A-Z_]+)` \|", readme.read_text(encoding="utf-8"), re.M)
    assert sorted(listed) == names
    for doc in (guide, readme):
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text(encoding="utf-8")):
            assert (doc.parent / target).exists(), (doc.name, target)
