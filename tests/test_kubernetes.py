"""``deploy/kubernetes/``: every manifest is valid against the Kubernetes API schemas
(strict: an unknown field is an error), offline with the ``kubernetes-validate`` package,
and the manifests fit together (selectors, ports, Secrets, the agents' API address).

No Kubernetes cluster runs here (``deploy/kubernetes/README.md`` says so)."""

from __future__ import annotations

import copy
import socket
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
VERSION = "1.37"  # the newest schemas kubernetes-validate==1.37.0 (dev extra) bundles
SECRETS = {
    "torchyard-postgres": {"password"},
    "torchyard-database": {"url"},
    "torchyard-worker-token": {"token"},
}


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
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "torchyard", doc["metadata"]
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
