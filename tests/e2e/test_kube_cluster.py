"""The private Kubernetes 1.20 control plane (:mod:`tests.support.kube_cluster`) and its
stand-in kubelet (:mod:`tests.support.fake_kubelet`), the ground the Kubernetes engine's tests
stand on: the real scheduler places GPU pods by the node's ``nvidia.com/gpu``, a pod's command
runs and its status and logs come back through the API, deletion and eviction end a pod's
process, the garbage collector removes pods whose owner is deleted, and RBAC holds for the
engine's limited user.

One control plane and one 8-GPU node for the module (about 6 s to start); each test works in
a namespace of its own."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.support.fake_kubelet import ApiError, FakeKubelet, Rest, evict, pod_path
from tests.support.kube_cluster import ENGINE_USER, KubeCluster, kube_cluster, require_kubernetes

pytestmark = [pytest.mark.slow]

NODE = "gpu-node-1"
GPUS = 8
VALIDATE_VERSION = "1.37"  # the newest schemas kubernetes-validate==1.37.0 (dev extra) bundles


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    require_kubernetes()
    with kube_cluster(tmp_path_factory.mktemp("kube")) as c:
        pids = [p.pid for p in c._procs.values()]
        yield c
    # Stopped: none of the control plane's processes is left (nor a pod's: the kubelet killed them).
    left = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not left, f"control-plane processes left running: {left}"


@pytest.fixture(scope="module")
def node(cluster: KubeCluster) -> FakeKubelet:
    return cluster.add_node(NODE, gpus=GPUS, cpu="16", memory="64Gi")


@pytest.fixture(scope="module")
def rest(cluster: KubeCluster) -> Rest:
    return Rest(cluster.api_client())


_namespaces = iter(range(1, 1000))


@pytest.fixture
def ns(cluster: KubeCluster, node: FakeKubelet) -> str:
    name = f"t{next(_namespaces)}"
    cluster.create_namespace(name)
    return name


def wait_until(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def engine_like_pod(
    name: str,
    namespace: str,
    command: list[str],
    *,
    gpus: int = 0,
    owner: dict[str, Any] | None = None,
    image: str = "registry.example/torchyard/worker:1",
    grace_s: int = 5,
) -> dict[str, Any]:
    """A pod as the Kubernetes engine will make one: one container, GPUs as limits, the
    rank's identity from the downward API, never restarted, owned by the job's object."""
    resources: dict[str, Any] = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}
    if gpus:
        resources["limits"]["nvidia.com/gpu"] = str(gpus)
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": "torchyard", "torchyard.dev/attempt": "a1"},
        "annotations": {"torchyard.dev/rank": "0"},
    }
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": grace_s,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [
                {
                    "name": "rank",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": command,
                    "env": [
                        {"name": "TORCHYARD_ATTEMPT", "value": "a1"},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {
                            "name": "RANK",
                            "valueFrom": {
                                "fieldRef": {"fieldPath": "metadata.annotations['torchyard.dev/rank']"}
                            },
                        },
                    ],
                    "resources": resources,
                }
            ],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }


def get_pod(rest: Rest, ns: str, name: str) -> dict[str, Any] | None:
    try:
        pod: dict[str, Any] = rest.get(pod_path(ns, name))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise
    return pod


def phase(rest: Rest, ns: str, name: str) -> str | None:
    pod = get_pod(rest, ns, name)
    return None if pod is None else pod["status"].get("phase")


def pods_of(rest: Rest, ns: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = rest.get(f"/api/v1/namespaces/{ns}/pods")["items"]
    return items


def test_the_pod_spec_is_valid_for_current_kubernetes() -> None:
    """The pods these tests make (as the engine will) are valid, strictly, for a current
    Kubernetes, not only for the 1.20 apiserver here."""
    pod = engine_like_pod("p", "ns", ["python", "-m", "torchyard"], gpus=4)
    pod["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "job",
            "uid": "0f7c5a5e-0000-4000-8000-000000000001",
        }
    ]
    assert kubernetes_validate.validate(pod, VALIDATE_VERSION, strict=True) == VALIDATE_VERSION
    pod["spec"]["containers"][0]["gpus"] = 4  # not a field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, VALIDATE_VERSION, strict=True)


def test_the_node_registers_ready_with_its_gpus(rest: Rest, node: FakeKubelet) -> None:
    got = rest.get(f"/api/v1/nodes/{NODE}")
    assert got["status"]["allocatable"]["nvidia.com/gpu"] == str(GPUS)
    ready = next(c for c in got["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert not got["spec"].get("taints")
    assert got["status"]["nodeInfo"]["kubeletVersion"] == "v1.20.2"


def test_the_scheduler_places_a_gang_by_gpus_and_the_gc_removes_it(
    rest: Rest, node: FakeKubelet, ns: str
) -> None:
    """Two pods of 4 GPUs each fill the 8-GPU node; a third waits, Unschedulable for lack of
    GPUs. The pods belong to a ConfigMap: deleting it has the garbage collector delete them,
    and the stand-in kubelet ends their processes (SIGTERM)."""
    owner = rest.call(
        "POST", f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "job-1"}, "data": {"job": "1"}}
    )
    script = (
        "echo gpus=$NVIDIA_VISIBLE_DEVICES rank=$RANK; trap 'echo got SIGTERM; exit 0' TERM; sleep 300 & wait"
    )
    for i in range(3):
        rest.call(
            "POST",
            f"/api/v1/namespaces/{ns}/pods",
            engine_like_pod(f"r{i}", ns, ["sh", "-c", script], gpus=4, owner=owner),
        )

    def placed() -> tuple[list[str], list[dict[str, Any]]] | None:
        pods = pods_of(rest, ns)
        running = sorted(p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running")
        pending = [p for p in pods if p["status"].get("phase") == "Pending" and p["status"].get("conditions")]
        return (running, pending) if len(running) == 2 and len(pending) == 1 else None

    running, (waiting,) = wait_until(placed, "two pods running and one unschedulable")
    condition = next(c for c in waiting["status"]["conditions"] if c["type"] == "PodScheduled")
    assert condition["status"] == "False" and condition["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in condition["message"]
    assert not waiting["spec"].get("nodeName")

    for name in running:
        pod = rest.get(pod_path(ns, name))
        assert pod["spec"]["nodeName"] == NODE
        (status,) = pod["status"]["containerStatuses"]
        assert "running" in status["state"] and status["ready"] is True
        assert pod["status"]["podIP"] == node.address
    logs = [wait_until(functools.partial(_log, node, ns, n), f"{n}'s output") for n in running]
    devices = sorted(line.split()[0].removeprefix("gpus=") for line in logs)
    assert devices == ["0,1,2,3", "4,5,6,7"], logs

    rest.call("DELETE", f"/api/v1/namespaces/{ns}/configmaps/job-1", {"propagationPolicy": "Background"})
    wait_until(lambda: not pods_of(rest, ns), "the garbage collector to delete the pods", timeout=40)
    for name in running:
        assert "got SIGTERM" in node.read_log(ns, name)
    assert not [p for p in node.running() if p.startswith(f"{ns}/")]


def test_a_pod_runs_its_command_to_completion(
    cluster: KubeCluster, rest: Rest, node: FakeKubelet, ns: str
) -> None:
    """The command runs with the pod's environment ($(VAR) expanded, the downward API), ends
    Succeeded with exit code 0, and its output is the pod's log through the API."""
    command = ["sh", "-c", "echo pod=$POD_NAME ip=$POD_IP rank=$RANK attempt=$(TORCHYARD_ATTEMPT)"]
    rest.call("POST", f"/api/v1/namespaces/{ns}/pods", engine_like_pod("once", ns, command))
    wait_until(lambda: phase(rest, ns, "once") == "Succeeded", "the pod to succeed")
    (status,) = rest.get(pod_path(ns, "once"))["status"]["containerStatuses"]
    assert status["state"]["terminated"]["exitCode"] == 0
    assert status["state"]["terminated"]["reason"] == "Completed"

    from kubernetes.client import CoreV1Api

    log = CoreV1Api(cluster.api_client()).read_namespaced_pod_log("once", ns, _preload_content=False)
    assert log.data.decode() == f"pod=once ip={node.address} rank=0 attempt=a1\n"

    rest.call("POST", f"/api/v1/namespaces/{ns}/pods", engine_like_pod("fails", ns, ["sh", "-c", "exit 3"]))
    wait_until(lambda: phase(rest, ns, "fails") == "Failed", "the pod to fail")
    (status,) = rest.get(pod_path(ns, "fails"))["status"]["containerStatuses"]
    assert status["state"]["terminated"]["exitCode"] == 3
    assert status["state"]["terminated"]["reason"] == "Error"


def test_eviction_and_deletion_end_the_process(rest: Rest, node: FakeKubelet, ns: str) -> None:
    """The Eviction API (policy/v1beta1 on 1.20) deletes the pod gracefully: SIGTERM, then the
    pod is gone; a process that ignores SIGTERM is killed after the grace period."""
    script = "trap 'echo got SIGTERM; exit 143' TERM; echo started; sleep 300 & wait"
    rest.call("POST", f"/api/v1/namespaces/{ns}/pods", engine_like_pod("evicted", ns, ["sh", "-c", script]))
    stubborn = "trap 'echo ignoring SIGTERM' TERM; echo started; while true; do sleep 0.1; done"
    rest.call(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        engine_like_pod("stubborn", ns, ["sh", "-c", stubborn], grace_s=1),
    )
    for name in ("evicted", "stubborn"):
        wait_until(functools.partial(_log, node, ns, name), f"{name} to start")

    evict(rest, ns, "evicted", disruption_condition=True)
    wait_until(lambda: get_pod(rest, ns, "evicted") is None, "the evicted pod to go")
    assert "got SIGTERM" in node.read_log(ns, "evicted")

    started = time.monotonic()
    rest.call("DELETE", pod_path(ns, "stubborn"))
    wait_until(lambda: get_pod(rest, ns, "stubborn") is None, "the deleted pod to go")
    assert time.monotonic() - started >= 1.0
    assert "ignoring SIGTERM" in node.read_log(ns, "stubborn")
    assert not [p for p in node.running() if p.startswith(f"{ns}/")]


def test_an_image_that_cannot_be_pulled_waits_in_err_image_pull(rest: Rest, ns: str) -> None:
    pod = engine_like_pod("nope", ns, ["true"], image="registry.example/does-not-exist:1")
    rest.call("POST", f"/api/v1/namespaces/{ns}/pods", pod)

    def waiting() -> dict[str, Any] | None:
        got = get_pod(rest, ns, "nope")
        statuses = (got or {}).get("status", {}).get("containerStatuses") or [{}]
        state: dict[str, Any] | None = statuses[0].get("state", {}).get("waiting")
        return state

    assert wait_until(waiting, "ErrImagePull")["reason"] == "ErrImagePull"
    assert phase(rest, ns, "nope") == "Pending"
    rest.call("DELETE", pod_path(ns, "nope"))
    wait_until(lambda: get_pod(rest, ns, "nope") is None, "the pod to go")


def test_the_engine_user_has_only_the_rights_it_is_given(cluster: KubeCluster, rest: Rest, ns: str) -> None:
    engine = Rest(cluster.api_client(cluster.engine_kubeconfig))
    with pytest.raises(ApiError) as denied:
        engine.get(f"/api/v1/namespaces/{ns}/pods")
    assert denied.value.status == 403
    rest.call(
        "POST",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
        {
            "metadata": {"name": "pods"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
    )
    rest.call(
        "POST",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
        {
            "metadata": {"name": "engine-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": ENGINE_USER}],
        },
    )
    wait_until(lambda: _allowed(engine, f"/api/v1/namespaces/{ns}/pods"), "the RoleBinding to apply", 10)
    with pytest.raises(ApiError) as denied:
        engine.call("POST", f"/api/v1/namespaces/{ns}/pods", engine_like_pod("x", ns, ["true"]))
    assert denied.value.status == 403
    with pytest.raises(ApiError) as denied:
        engine.get("/api/v1/namespaces/default/pods")
    assert denied.value.status == 403


def _allowed(rest: Rest, path: str) -> bool:
    try:
        rest.get(path)
    except ApiError as exc:
        if exc.status == 403:
            return False
        raise
    return True


def _log(node: FakeKubelet, ns: str, name: str) -> str:
    try:
        return node.read_log(ns, name)
    except (KeyError, FileNotFoundError):
        return ""
