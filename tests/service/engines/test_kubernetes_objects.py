"""What the Kubernetes driver asks of Kubernetes and how it reads Kubernetes' answers, without
a cluster (the real control plane: tests/e2e/test_kubernetes_engine.py). The pod and the
owner it makes are checked against a current Kubernetes release's schema, strictly: the
1.20 control plane of the tests must not be the only one that accepts them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from service.config import Settings
from service.engines import kubernetes_objects as k8s
from service.engines.base import LaunchRequest

CURRENT = "1.37"
REQUEST = LaunchRequest(
    job_id="j1", attempt_id="a" * 32, attempt_number=3, node_count=2, process_count_per_node=4,
    launch_token="secret-token", max_runtime_s=None,
)  # fmt: skip


def settings(tmp_path: Path, **values: Any) -> Settings:
    base = {
        "engine": "kubernetes",
        "data_dir": tmp_path,
        "k8s_image": "registry.example/torchyard-worker:1",
        "k8s_api_url": "http://torchyard-api.torchyard.svc:8000",
        "preempt_grace_s": 30,
    }
    return Settings(**(base | values))


def test_the_pod_runs_the_launcher_for_its_rank_with_the_attempts_gpus(tmp_path: Path) -> None:
    pod = k8s.pod(settings(tmp_path), REQUEST, 1, "uid-1", gpus=True)
    assert pod["metadata"]["name"] == "torchyard-j1-3-1"
    assert pod["metadata"]["labels"] == {
        k8s.MANAGED_BY: "torchyard", k8s.ENGINE_JOB: "torchyard-j1-3", k8s.JOB: "j1",
        k8s.ATTEMPT: "a" * 32, k8s.RANK: "1",
    }  # fmt: skip
    assert pod["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Service", "name": "torchyard-j1-3", "uid": "uid-1", "controller": True,
         "blockOwnerDeletion": True}
    ]  # fmt: skip
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["torchyard"]
    assert container["args"] == [
        "launch", "--api", "http://torchyard-api.torchyard.svc:8000", "--attempt", "a" * 32,
        "--node-rank", "1", "--node", "$(TORCHYARD_NODE_NAME)", "--address", "$(TORCHYARD_POD_IP)",
    ]  # fmt: skip
    assert container["resources"] == {"requests": {k8s.GPU: "4", "cpu": "4"}, "limits": {k8s.GPU: "4"}}
    env = {e["name"]: e for e in container["env"]}
    assert env["TORCHYARD_LAUNCH_TOKEN"]["value"] == "secret-token"
    assert env["TORCHYARD_LAUNCH_CPUS"]["value"] == "4"
    # With 8 CPUs a GPU on every GPU node, each GPU comes with 8 of them.
    big = k8s.pod(settings(tmp_path), REQUEST, 1, "uid-1", gpus=True, cpus_per_gpu=8)["spec"]["containers"][0]
    assert big["resources"]["requests"] == {k8s.GPU: "4", "cpu": "32"}
    assert {e["name"]: e.get("value") for e in big["env"]}["TORCHYARD_LAUNCH_CPUS"] == "32"
    assert env["TORCHYARD_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["TORCHYARD_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["terminationGracePeriodSeconds"] == 45
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert pod["spec"]["automountServiceAccountToken"] is False
    # Each rank on a node of its own.
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {
        "labelSelector": {"matchLabels": {k8s.ENGINE_JOB: "torchyard-j1-3"}},
        "topologyKey": "kubernetes.io/hostname",
    }


def test_cpu_nodes_get_cpu_requests_and_the_settings_reach_the_pod(tmp_path: Path) -> None:
    s = settings(
        tmp_path,
        k8s_launcher="/opt/venv/bin/torchyard launch",
        k8s_work_dir="/scratch/torchyard",
        k8s_node_selector="pool=a100, zone=b",
        k8s_tolerations='[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]',
        k8s_priority_class="training",
        k8s_queue="vision",
        k8s_pod_patch='{"serviceAccountName": "runner", "containers": [{"name": "launcher", '
        '"volumeMounts": [{"name": "data", "mountPath": "/data"}]}], "volumes": [{"name": "data", '
        '"emptyDir": {}}]}',
    )
    pod = k8s.pod(s, REQUEST, 0, "uid", gpus=False)
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["resources"] == {"requests": {"cpu": "4"}}
    assert container["command"] == ["/opt/venv/bin/torchyard"] and container["args"][-2:] == [
        "--work-dir",
        "/scratch/torchyard",
    ]
    assert spec["nodeSelector"] == {"pool": "a100", "zone": "b"}
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["priorityClassName"] == "training" and spec["serviceAccountName"] == "runner"
    # The patch's container merges into the launcher's by name; the launcher keeps its own fields.
    assert container["volumeMounts"] == [{"name": "data", "mountPath": "/data"}] and container["image"]
    assert spec["volumes"] == [{"name": "data", "emptyDir": {}}]
    assert pod["metadata"]["labels"][k8s.KUEUE_QUEUE] == "vision"
    assert pod["metadata"]["labels"][k8s.KUEUE_GROUP] == "torchyard-j1-3"
    assert pod["metadata"]["annotations"][k8s.KUEUE_GROUP_COUNT] == "2"


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("k8s_node_selector", "pool", "'pool' is not key=value"),
        ("k8s_tolerations", '{"key": "x"}', "must be a JSON list"),
        ("k8s_pod_patch", "[1]", "must be a JSON object"),
        ("k8s_pod_patch", "{bad", "is not JSON"),
    ],
)
def test_a_setting_that_cannot_be_used_is_named(tmp_path: Path, name: str, value: str, words: str) -> None:
    with pytest.raises(k8s.PodSettingsError, match=words):
        k8s.check_settings(settings(tmp_path, **{name: value}))


def test_the_pod_and_its_owner_are_valid_for_a_current_kubernetes(tmp_path: Path) -> None:
    s = settings(tmp_path, k8s_node_selector='{"pool": "a100"}', k8s_priority_class="p", k8s_queue="q")
    for gpus in (True, False):
        assert kubernetes_validate.validate(k8s.pod(s, REQUEST, 0, "uid", gpus), CURRENT, strict=True)
    assert kubernetes_validate.validate(k8s.owner_service(REQUEST), CURRENT, strict=True)


def test_nodes_read_with_their_allocatable_units_readiness_and_taints() -> None:
    node = {
        "metadata": {"name": "g1", "labels": {"pool": "a100"}},
        "spec": {"taints": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"},
                            {"key": "soft", "effect": "PreferNoSchedule"}]},
        "status": {
            "allocatable": {"cpu": "31500m", k8s.GPU: "8", "memory": "200Gi"},
            "conditions": [{"type": "Ready", "status": "True"}],
            "addresses": [{"type": "Hostname", "address": "g1"}, {"type": "InternalIP", "address": "10.1.0.7"}],
        },
    }  # fmt: skip
    view = k8s.node_view(node, [])
    assert (view.gpus, view.cpus, view.ready, view.cordoned, view.address) == (8, 31, True, False, "10.1.0.7")
    assert view.untolerated == ("gpu=yes:NoSchedule",)
    assert k8s.node_view(node, [{"key": "gpu", "operator": "Exists"}]).untolerated == ()
    assert k8s.node_view(node, [{"key": "gpu", "value": "no"}]).untolerated == ("gpu=yes:NoSchedule",)
    node["spec"]["unschedulable"] = True
    node["status"]["conditions"] = [{"type": "Ready", "status": "Unknown"}]
    view = k8s.node_view(node, [])
    assert view.cordoned and not view.ready


def test_requests_are_counted_per_node_for_pods_that_have_not_ended() -> None:
    def p(node: str, phase: str, gpu: str | None, cpu: str) -> dict[str, Any]:
        req = {"cpu": cpu} | ({k8s.GPU: gpu} if gpu else {})
        return {"spec": {"nodeName": node, "containers": [{"resources": {"requests": req}}]},
                "status": {"phase": phase}}  # fmt: skip

    got = k8s.requested(
        [p("g1", "Running", "4", "2"), p("g1", "Pending", "2", "500m"), p("g1", "Succeeded", "8", "8"),
         p("g2", "Failed", "8", "1"), p("", "Pending", "1", "1")]
    )  # fmt: skip
    assert {n: (int(g), float(c)) for n, (g, c) in got.items()} == {"g1": (6, 2.5)}


def test_a_pods_status_read_for_binding_failures_and_ends() -> None:
    pending = {
        "metadata": {"name": "torchyard-j-1-2", "labels": {k8s.RANK: "2"}},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "message": "0/3 nodes are available: 1 node(s) were unschedulable, 2 Insufficient nvidia.com/gpu."}],
        },
    }  # fmt: skip
    view = k8s.pod_view(pending)
    assert view.rank == 2 and view.node == "" and view.phase == "Pending"
    assert view.unschedulable == "node(s) were unschedulable, Insufficient nvidia.com/gpu"
    pulling = {
        "metadata": {"name": "p"},
        "spec": {"nodeName": "g1"},
        "status": {"phase": "Pending", "containerStatuses": [
            {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}}}]},
    }  # fmt: skip
    assert k8s.pod_view(pulling).fatal == ("ImagePullBackOff", 'Back-off pulling image "x"')
    failed = {
        "metadata": {"name": "p"},
        "spec": {"nodeName": "g1"},
        "status": {"phase": "Failed", "podIP": "10.2.0.4", "containerStatuses": [
            {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "message": "last words\n"}}}]},
    }  # fmt: skip
    view = k8s.pod_view(failed)
    assert (view.exit_code, view.reason, view.message, view.evicted, view.ip) == (
        137, "OOMKilled", "last words", False, "10.2.0.4",
    )  # fmt: skip
    evicted = {
        "metadata": {"name": "p"},
        "status": {"phase": "Failed", "reason": "Evicted", "message": "low memory"},
    }
    assert k8s.pod_view(evicted).evicted
    disrupted = {"metadata": {"name": "p"}, "status": {"phase": "Running", "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]}}  # fmt: skip
    assert k8s.pod_view(disrupted).evicted


def test_the_schedulers_words_lose_their_node_counts() -> None:
    assert k8s.scheduler_words("0/3 nodes are available: 3 Insufficient nvidia.com/gpu.") == (
        "Insufficient nvidia.com/gpu"
    )
    assert k8s.scheduler_words("no nodes available to schedule pods") == "no nodes available to schedule pods"
    # The gang's own one-rank-per-node rule is left out when anything else is said.
    assert (
        k8s.scheduler_words(
            "0/3 nodes are available: 1 node(s) didn't match pod affinity/anti-affinity, 1 node(s) didn't "
            "match pod anti-affinity rules, 2 Insufficient nvidia.com/gpu."
        )
        == "Insufficient nvidia.com/gpu"
    )


def test_a_teams_kueue_queue_comes_before_the_installs(tmp_path: Path) -> None:
    from dataclasses import replace

    s = settings(tmp_path, k8s_queue="shared")
    pod = k8s.pod(s, replace(REQUEST, queue="vision"), 0, "uid", gpus=False)
    assert pod["metadata"]["labels"][k8s.KUEUE_QUEUE] == "vision"
    pod = k8s.pod(s, REQUEST, 0, "uid", gpus=False)
    assert pod["metadata"]["labels"][k8s.KUEUE_QUEUE] == "shared"
