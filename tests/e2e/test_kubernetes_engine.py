"""The Kubernetes engine (docs/kubernetes.md) against a real Kubernetes control plane: the
kube-apiserver, etcd, kube-scheduler and kube-controller-manager of Kubernetes 1.20.2
(:mod:`tests.support.kube_cluster`), three nodes whose kubelets are the stand-in of
:mod:`tests.support.fake_kubelet` (a pod's command runs as a process in the node's network
namespace), the API as a real ``torchyard serve`` with ``TORCHYARD_ENGINE=kubernetes``
holding only the engine's least-privilege role (deploy/kubernetes/engine-rbac.yaml).

One cluster and one API for the whole module; the tests run in order and each leaves the
namespace without its pods. Workloads are the smallest that show the behaviour: digits at
16 px for 2 epochs, or scripts that only print and sleep."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client as k8s

from service.config import Settings
from service.engines.base import Ending, EngineUnavailable, LaunchRequest, Phase
from service.engines.kubernetes import KubernetesDriver
from service.engines.kubernetes_objects import ENGINE_JOB, MANAGED_BY
from tests.support.api_process import ApiProcess
from tests.support.engine_env import EngineEnv, write_launcher
from tests.support.factories import auth
from tests.support.fake_kubelet import evict
from tests.support.kube_cluster import KubeCluster, require_kubernetes
from tests.support.netns import NetnsCluster, require_netns
from tests.support.worker_fixtures import upload_digits, user_client
from worker.trainer.control import PREEMPT_REQUEST_FILE

pytestmark = [pytest.mark.slow]

NAMESPACE = "torchyard"
RBAC = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "engine-rbac.yaml"
GANG_TIMEOUT_S = 6
GPUS_PER_NODE = 2


@dataclass
class KubeEnv(EngineEnv):
    cluster: KubeCluster | None = None
    net: NetnsCluster | None = None
    launcher: Path | None = None

    @property
    def core(self) -> k8s.CoreV1Api:
        assert self.cluster is not None
        return k8s.CoreV1Api(self.cluster.api_client())

    def pods(self, job_id: str) -> list[k8s.V1Pod]:
        return list(
            self.core.list_namespaced_pod(NAMESPACE, label_selector=f"torchyard.io/job={job_id}").items
        )

    def owners(self, job_id: str) -> list[k8s.V1Service]:
        return list(
            self.core.list_namespaced_service(NAMESPACE, label_selector=f"torchyard.io/job={job_id}").items
        )

    def wait_empty(self, job_id: str, timeout: float = 45) -> None:
        """No pod and no owner of the job is left in Kubernetes."""
        deadline = time.monotonic() + timeout
        while self.pods(job_id) or self.owners(job_id):
            assert time.monotonic() < deadline, (
                [p.metadata.name for p in self.pods(job_id)],
                self.api.log()[-3000:],
            )
            time.sleep(0.2)

    def outside_pod(self, name: str, node: str, gpus: int = GPUS_PER_NODE) -> None:
        """A pod of someone else, holding GPUs of ``node``."""
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeName": node,
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "sleep",
                        "image": "busybox",
                        "command": ["sleep", "600"],
                        "resources": {
                            "requests": {"nvidia.com/gpu": str(gpus)},
                            "limits": {"nvidia.com/gpu": str(gpus)},
                        },
                    }
                ],
            },
        }
        self.core.create_namespaced_pod(NAMESPACE, body)

    def delete_pod(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
        deadline = time.monotonic() + 30
        while any(p.metadata.name == name for p in self.core.list_namespaced_pod(NAMESPACE).items):
            assert time.monotonic() < deadline
            time.sleep(0.2)

    def outputs(self) -> str:
        if self.cluster is None:
            return ""
        return self.cluster.logs(1500)


def _grant_engine_role(cluster: KubeCluster) -> None:
    """The deploy manifest's Role and ClusterRole, bound to the engine's test user (the
    manifest binds them to the API's ServiceAccount)."""
    api = cluster.api_client()
    rbac = k8s.RbacAuthorizationV1Api(api)
    subject = {"kind": "User", "name": "torchyard-engine", "apiGroup": "rbac.authorization.k8s.io"}
    for doc in yaml.safe_load_all(RBAC.read_text()):
        if not doc:
            continue
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "Role":
            rbac.create_namespaced_role(NAMESPACE, doc)
            rbac.create_namespaced_role_binding(
                NAMESPACE,
                {
                    "metadata": {"name": f"{name}-test-user"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                    "subjects": [subject],
                },
            )
        elif kind == "ClusterRole":
            rbac.create_cluster_role(doc)
            rbac.create_cluster_role_binding(
                {
                    "metadata": {"name": f"{name}-test-user"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                    "subjects": [subject],
                }
            )


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeEnv]:
    require_kubernetes()
    require_netns()
    root = tmp_path_factory.mktemp("kube")
    started = time.monotonic()
    with NetnsCluster(3) as net:
        cluster = KubeCluster(root=root / "cluster").start()
        try:
            cluster.create_namespace(NAMESPACE)
            _grant_engine_role(cluster)
            for i, host in enumerate(net.hosts, start=1):
                cluster.add_node(f"k{i}", gpus=GPUS_PER_NODE, cpu="2", address=host.address, netns=host.netns)
            up = time.monotonic() - started
            launcher = write_launcher(root)
            api = ApiProcess(
                root / "data",
                None,
                host=net.gateway,
                settings={
                    "TORCHYARD_ENGINE": "kubernetes",
                    "TORCHYARD_K8S_NAMESPACE": NAMESPACE,
                    "TORCHYARD_K8S_IMAGE": "torchyard-worker:test",
                    "TORCHYARD_K8S_LAUNCHER": str(launcher),
                    "TORCHYARD_K8S_WORK_DIR": str(root / "nodes"),
                    "TORCHYARD_K8S_POLL_S": "0.5",
                    "TORCHYARD_K8S_GANG_TIMEOUT_S": str(GANG_TIMEOUT_S),
                    "TORCHYARD_PREEMPT_GRACE_S": "20",
                    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
                    "TORCHYARD_LEASE_TIMEOUT_S": "4",
                    "TORCHYARD_REAPER_INTERVAL_S": "0.2",
                    "TORCHYARD_MASTER_PORT_MIN": "27600",
                    "TORCHYARD_MASTER_PORT_MAX": "27699",
                    "KUBECONFIG": str(cluster.engine_kubeconfig),
                },
            )
            api.env["TORCHYARD_K8S_API_URL"] = api.url
            api.start().wait_ready()
            admin = httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=60)
            user = user_client(admin, api.url)
            digits = upload_digits(user, root / "digits", per_class=12, size=16)
            env = KubeEnv(api, user, digits, root, cluster=cluster, net=net, launcher=launcher)
            deadline = time.monotonic() + 60  # the engine's first inventory
            while user.get("/v1/cluster").json()["ready_nodes"] != 3:
                assert time.monotonic() < deadline, api.log()[-4000:]
                time.sleep(0.1)
            print(f"Kubernetes control plane and 3 nodes up in {up:.2f} s", file=sys.stderr)
            try:
                yield env
            finally:
                user.close()
                admin.close()
                api.kill()
        finally:
            cluster.close()


def _driver(kube: KubeEnv, **settings: Any) -> KubernetesDriver:
    assert kube.cluster is not None
    values = {
        "engine": "kubernetes",
        "k8s_namespace": NAMESPACE,
        "k8s_image": "torchyard-worker:test",
        "k8s_api_url": kube.api.url,
        "k8s_launcher": str(kube.launcher),
        "data_dir": kube.root / "driver-data",
    } | settings
    return KubernetesDriver(Settings(**values), api=kube.cluster.api_client(kube.cluster.engine_kubeconfig))


def test_the_cluster_is_kubernetes_nodes_with_their_gpus_and_cordoned_ones_drained(kube: KubeEnv) -> None:
    cluster = kube.user.get("/v1/cluster").json()
    assert cluster["engine"] == "kubernetes" and cluster["max_nodes"] == 3
    assert {n["name"]: (n["units"], n["accelerator"], n["status"]) for n in cluster["nodes"]} == {
        f"k{i}": (GPUS_PER_NODE, "gpu", "ready") for i in (1, 2, 3)
    }
    assert all(n["engine"] == "kubernetes" and n["engine_state"] == "Ready" for n in cluster["nodes"])
    kube.core.patch_node("k3", {"spec": {"unschedulable": True}})
    try:
        deadline = time.monotonic() + 20
        while {n["name"]: n["status"] for n in kube.user.get("/v1/cluster").json()["nodes"]}[
            "k3"
        ] != "drained":
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        kube.core.patch_node("k3", {"spec": {"unschedulable": False}})
    deadline = time.monotonic() + 20
    while kube.user.get("/v1/cluster").json()["ready_nodes"] != 3:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_shape_no_node_could_hold_is_refused(kube: KubeEnv) -> None:
    train, val = kube.digits
    r = kube.user.post(
        "/v1/jobs",
        json={
            "model": {"architecture": "mobilenet_v3_small"},
            "train_dataset": train,
            "validation_dataset": val,
            "resources": {"node_count": 1, "process_count_per_node": GPUS_PER_NODE + 1},
        },
    )
    assert r.status_code == 422 and r.json()["code"] == "ResourceLimitError", r.text
    assert "processing units of the largest node" in r.text


def _two_node_reference(kube: KubeEnv) -> dict[tuple[str, int], float]:
    if kube.reference is not None:
        return kube.reference
    job_id = kube.train(nodes=2)
    job = kube.wait(job_id, timeout=150)
    assert job["status"] == "succeeded", job
    (attempt,) = job["attempts"]
    assert attempt["engine"] == "kubernetes" and attempt["engine_job_id"] == f"torchyard-{job_id}-1"
    assert len(set(attempt["nodes"])) == 2 and set(attempt["nodes"]) <= {"k1", "k2", "k3"}
    assert kube.user.get(f"/v1/jobs/{job_id}/model").status_code == 200
    kube.reference = kube.history(job_id)
    assert len([k for k in kube.reference if k[0] == "val.top1"]) == 2
    kube.wait_empty(job_id)
    return kube.reference


def test_two_node_training_job_succeeds_one_pod_per_rank(kube: KubeEnv) -> None:
    _two_node_reference(kube)


def test_a_partial_gang_is_released_whole_and_the_job_waits_with_kubernetes_reason(kube: KubeEnv) -> None:
    kube.outside_pod("outside-k1", "k1")
    kube.outside_pod("outside-k2", "k2")
    try:
        job_id = kube.script(["python", "probe.py"], nodes=2)
        reason = "1 of 2 pods unschedulable: Insufficient nvidia.com/gpu"
        job = kube.wait(job_id, lambda j: reason in (j.get("reason") or ""), timeout=30)
        assert job["status"] == "scheduled" and job["reason"] == (
            f"waiting in Kubernetes (job torchyard-{job_id}-1): {reason}"
        )
        job = kube.wait(
            job_id, lambda j: j["attempts"][0]["status"] == "preempted", timeout=GANG_TIMEOUT_S + 30
        )
        released = kube.user.get(f"/v1/jobs/{job_id}").json()["attempts"][0]
        assert released["status"] == "preempted"
        # No part of the released gang holds a GPU: its pods are gone (the next attempt's may pend).
        deadline = time.monotonic() + 10
        while any(p.metadata.name.startswith(f"torchyard-{job_id}-1-") for p in kube.pods(job_id)):
            assert time.monotonic() < deadline, [p.metadata.name for p in kube.pods(job_id)]
            time.sleep(0.1)
    finally:
        kube.delete_pod("outside-k2")
        kube.delete_pod("outside-k1")
    job = kube.wait(job_id, timeout=90)
    assert job["status"] == "succeeded" and job["restarts"] == 0, job
    assert job["attempts"][-1]["status"] == "succeeded"
    kube.wait_empty(job_id)


def test_an_evicted_pod_checkpoints_and_the_job_resumes_exactly(kube: KubeEnv) -> None:
    reference = _two_node_reference(kube)
    with kube.launch_env(TORCHYARD_TEST_PAUSE_AT="train:2"):
        job_id = kube.train(nodes=2)
        paused = kube.wait_file(job_id, 1, "paused-train-2")
    first_run = paused.parent
    (victim,) = [
        p.metadata.name for p in kube.pods(job_id) if p.metadata.labels["torchyard.io/node-rank"] == "1"
    ]
    assert kube.cluster is not None
    evict(kube.cluster.api_client(), NAMESPACE, victim, disruption_condition=True)
    kube.wait_file(job_id, 1, PREEMPT_REQUEST_FILE)
    paused.unlink()
    kube.assert_preempted_then_resumed_exactly(job_id, first_run, reference, timeout=150)
    kube.wait_empty(job_id)


def test_cancel_deletes_every_pod_of_the_job(kube: KubeEnv) -> None:
    job_id = kube.script(["python", "probe.py", "60"], nodes=2)
    kube.wait(job_id, lambda j: j["status"] == "running", timeout=60)
    assert len(kube.pods(job_id)) == 2 and len(kube.owners(job_id)) == 1
    assert kube.user.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    assert kube.wait(job_id, timeout=60)["status"] == "cancelled"
    kube.wait_empty(job_id)


def test_a_launcher_that_cannot_start_is_an_engine_error_with_its_output_not_retried(kube: KubeEnv) -> None:
    assert kube.launcher is not None
    hidden = kube.launcher.with_suffix(".moved")
    shutil.move(kube.launcher, hidden)
    try:
        job_id = kube.script(["python", "probe.py"])
        job = kube.wait(job_id, timeout=60)
    finally:
        shutil.move(hidden, kube.launcher)
    assert job["status"] == "failed" and job["failure"]["code"] == "EngineError", job
    message = job["failure"]["message"]
    assert f"pod torchyard-{job_id}-1-0 of Kubernetes job torchyard-{job_id}-1 ended Failed" in message
    assert "without any report from torchyard's launcher" in message
    assert len(job["attempts"]) == 1
    kube.wait_empty(job_id)


def test_a_node_deleted_is_worker_lost_and_the_job_restarts_on_the_others(kube: KubeEnv) -> None:
    assert kube.cluster is not None and kube.net is not None
    job_id = kube.script(
        ["python", "probe.py", "15"],
        resources={"node_count": 2, "process_count_per_node": 1, "max_restarts": 1},
    )
    job = kube.wait(job_id, lambda j: j["status"] == "running", timeout=60)
    gone = job["attempts"][0]["nodes"][1]
    host = kube.net.hosts[int(gone[1:]) - 1]
    kube.cluster.remove_node(gone)
    try:
        job = kube.wait(job_id, timeout=120)
        assert job["status"] == "succeeded" and job["restarts"] == 1, job
        first, second = job["attempts"]
        assert first["status"] == "failed" and first["failure_code"] == "WorkerLostError"
        assert gone in first["failure_message"] and gone not in second["nodes"]
    finally:
        kube.cluster.add_node(gone, gpus=GPUS_PER_NODE, cpu="2", address=host.address, netns=host.netns)
    kube.wait_empty(job_id)


# --- the driver alone, against the same control plane -------------------------------------


def test_a_second_submission_of_an_attempt_adopts_its_owner_and_makes_only_missing_pods(
    kube: KubeEnv,
) -> None:
    driver = _driver(kube, k8s_gang_timeout_s=600)
    driver.inventory()
    request = LaunchRequest(
        job_id="adopt", attempt_id="a" * 32, attempt_number=1, node_count=4, process_count_per_node=2,
        launch_token="tok",
    )  # fmt: skip
    try:
        name = driver.submit(request)
        assert name == "torchyard-adopt-1"
        kube.core.delete_namespaced_pod(f"{name}-3", NAMESPACE, grace_period_seconds=0)
        assert driver.submit(request) == name
        owners = kube.owners("adopt")
        pods = sorted(p.metadata.name for p in kube.pods("adopt"))
        assert len(owners) == 1 and pods == [f"{name}-{r}" for r in range(4)], pods
        assert all(p.metadata.owner_references[0].uid == owners[0].metadata.uid for p in kube.pods("adopt"))
        # 4 pods of 2 GPUs on 3 nodes of 2: one pends, and the gang is not bound.
        state = driver.poll([name])[name]
        assert state.phase is Phase.PENDING and "1 of 4 pods unschedulable" in state.reason
    finally:
        driver.cancel("torchyard-adopt-1")
    kube.wait_empty("adopt")


def test_an_image_that_cannot_be_pulled_ends_the_attempt_with_the_pods_reason(kube: KubeEnv) -> None:
    driver = _driver(kube, k8s_image="registry.example/does-not-exist:1")
    driver.inventory()
    request = LaunchRequest(
        job_id="pull", attempt_id="b" * 32, attempt_number=1, node_count=1, process_count_per_node=1,
        launch_token="tok",
    )  # fmt: skip
    name = driver.submit(request)
    try:
        deadline = time.monotonic() + 30
        while (state := driver.poll([name])[name]).phase is not Phase.ENDED:
            assert time.monotonic() < deadline, state
            time.sleep(0.3)
        assert state.ending is Ending.FAILED and state.state == "ErrImagePull"
        assert state.summary.startswith(f"pod {name}-0 of Kubernetes job {name} cannot start: ErrImagePull")
    finally:
        driver.cancel(name)
    kube.wait_empty("pull")


def test_a_missing_namespace_or_permission_is_one_clear_line_at_start(kube: KubeEnv) -> None:
    assert kube.cluster is not None
    admin = kube.cluster.api_client()
    with pytest.raises(
        EngineUnavailable, match=r"^TORCHYARD_K8S_NAMESPACE: no namespace 'nowhere' in this Kubernetes"
    ):
        KubernetesDriver(_driver(kube, k8s_namespace="nowhere").settings, api=admin).start()
    # The engine's own role cannot tell a namespace that is not there from one it has no role in.
    with pytest.raises(
        EngineUnavailable, match=r"^TORCHYARD_K8S_NAMESPACE: no namespace 'nowhere', or the engine's"
    ):
        _driver(kube, k8s_namespace="nowhere").start()
    # A namespace where the engine's account may only create pods: every other permission named.
    kube.cluster.create_namespace("partial")
    rbac = k8s.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role(
        "partial",
        {
            "metadata": {"name": "some"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        "partial",
        {
            "metadata": {"name": "some"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "some"},
            "subjects": [
                {"kind": "User", "name": "torchyard-engine", "apiGroup": "rbac.authorization.k8s.io"}
            ],
        },
    )
    partial = _driver(kube, k8s_namespace="partial")
    deadline = time.monotonic() + 15  # RBAC's caches see the new binding within a moment
    while not partial._allowed("", "pods", "create"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with pytest.raises(EngineUnavailable) as raised:
        partial.start()
    assert str(raised.value) == (
        "TORCHYARD_ENGINE=kubernetes: the engine's account may not delete pods, get pods/log, "
        "create services, get services, list services, delete services, list events, get namespaces "
        "in namespace partial (apply deploy/kubernetes/engine-rbac.yaml)"
    )
    _driver(kube).start()  # the engine's own role is enough


def test_labels_name_the_job_attempt_and_rank(kube: KubeEnv) -> None:
    driver = _driver(kube)
    driver.inventory()
    request = LaunchRequest(
        job_id="label", attempt_id="c" * 32, attempt_number=2, node_count=1, process_count_per_node=1,
        launch_token="tok",
    )  # fmt: skip
    name = driver.submit(request)
    try:
        (pod,) = kube.pods("label")
        assert pod.metadata.labels == {
            MANAGED_BY: "torchyard", ENGINE_JOB: name, "torchyard.io/job": "label",
            "torchyard.io/attempt": "c" * 32, "torchyard.io/node-rank": "0",
        }  # fmt: skip
        # 2 GPUs and 2 CPUs a node: a GPU comes with one CPU.
        assert pod.spec.containers[0].resources.requests == {"nvidia.com/gpu": "1", "cpu": "1"}
    finally:
        driver.cancel(name)
    kube.wait_empty("label")
