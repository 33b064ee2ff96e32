"""What the Kubernetes driver writes and reads: the attempt's owner and pods, and the nodes.

Plain functions over dicts (the API's JSON), so that what an attempt asks of Kubernetes
and what a pod's status means can be checked without a cluster.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from service.config import Settings
from service.engines.base import LaunchRequest

GPU = "nvidia.com/gpu"
MANAGED_BY = "app.kubernetes.io/managed-by"
ENGINE_JOB = "torchyard.io/engine-job"
JOB = "torchyard.io/job"
ATTEMPT = "torchyard.io/attempt"
RANK = "torchyard.io/node-rank"
NODE_COUNT = "torchyard.io/node-count"
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"
CONTAINER = "launcher"
# Containers waiting for one of these never start by themselves: the attempt is an EngineError.
FATAL_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)
# A pod that failed for one of these was stopped by the cluster, not by its own doing.
PREEMPTED_REASONS = frozenset(
    {"Evicted", "Preempting", "Preempted", "Shutdown", "Terminated", "NodeShutdown"}
)


class PodSettingsError(ValueError):
    """A Kubernetes engine setting that cannot be used (bad JSON, a wrong shape)."""


def _json(name: str, text: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PodSettingsError(f"{name} is not JSON: {exc}") from exc
    if not isinstance(value, kind):
        raise PodSettingsError(f"{name} must be a JSON {'object' if kind is dict else 'list'}")
    return value


def node_selector(settings: Settings) -> dict[str, str]:
    text = settings.k8s_node_selector.strip()
    if not text:
        return {}
    if text.startswith("{"):
        value = _json("TORCHYARD_K8S_NODE_SELECTOR", text, dict)
        return {str(k): str(v) for k, v in value.items()}
    pairs = {}
    for part in text.split(","):
        key, eq, val = part.strip().partition("=")
        if not eq or not key:
            raise PodSettingsError(f"TORCHYARD_K8S_NODE_SELECTOR: {part.strip()!r} is not key=value")
        pairs[key.strip()] = val.strip()
    return pairs


def tolerations(settings: Settings) -> list[dict[str, Any]]:
    text = settings.k8s_tolerations.strip()
    return list(_json("TORCHYARD_K8S_TOLERATIONS", text, list)) if text else []


def pod_patch(settings: Settings) -> dict[str, Any]:
    text = settings.k8s_pod_patch.strip()
    return dict(_json("TORCHYARD_K8S_POD_PATCH", text, dict)) if text else {}


def check_settings(settings: Settings) -> None:
    """Raise :class:`PodSettingsError` naming the first setting that cannot be used."""
    node_selector(settings)
    tolerations(settings)
    pod_patch(settings)


def merge(base: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``patch`` merged into ``base`` (objects key by key, recursively; lists of containers by
    name; anything else replaced)."""
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif (
            key in ("containers", "initContainers")
            and isinstance(value, list)
            and isinstance(out.get(key), list)
        ):
            by_name = {c.get("name"): c for c in out[key]}
            merged = [merge(by_name[c.get("name")], c) if c.get("name") in by_name else c for c in value]
            kept = [c for c in out[key] if c.get("name") not in {m.get("name") for m in merged}]
            out[key] = merged + kept
        else:
            out[key] = value
    return out


def labels(request: LaunchRequest) -> dict[str, str]:
    return {
        MANAGED_BY: "torchyard",
        ENGINE_JOB: request.name,
        JOB: request.job_id,
        ATTEMPT: request.attempt_id,
    }


def owner_service(request: LaunchRequest) -> dict[str, Any]:
    """The attempt's owner: a headless Service over its pods; deleting it deletes them all."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": request.name,
            "labels": labels(request),
            "annotations": {NODE_COUNT: str(request.node_count)},
        },
        "spec": {
            "clusterIP": "None",
            "selector": {ENGINE_JOB: request.name},
            "publishNotReadyAddresses": True,
        },
    }


def pod(
    settings: Settings, request: LaunchRequest, rank: int, owner_uid: str, gpus: bool, cpus_per_gpu: int = 1
) -> dict[str, Any]:
    """The pod of one node rank: the one-placement launcher, the attempt's units on one node
    (its GPUs with the CPUs that go with them — ``cpus_per_gpu``, the fewest any GPU node has
    — or its CPUs); the launcher sizes the ranks' threads to those CPUs."""
    name = f"{request.name}-{rank}"
    argv = [
        *shlex.split(settings.k8s_launcher),
        "--api", str(settings.k8s_api_url),
        "--attempt", request.attempt_id,
        "--node-rank", str(rank),
        "--node", "$(TORCHYARD_NODE_NAME)",
        "--address", "$(TORCHYARD_POD_IP)",
    ]  # fmt: skip
    if settings.k8s_work_dir:
        argv += ["--work-dir", settings.k8s_work_dir]
    units = str(request.process_count_per_node)
    cpus = str(request.process_count_per_node * max(1, cpus_per_gpu)) if gpus else units
    resources: dict[str, Any] = (
        {"requests": {GPU: units, "cpu": cpus}, "limits": {GPU: units}}
        if gpus
        else {"requests": {"cpu": cpus}}
    )
    pod_labels = labels(request) | {RANK: str(rank)}
    annotations = {NODE_COUNT: str(request.node_count)}
    queue = request.queue or settings.k8s_queue  # the job's team's Kueue queue first (docs/teams.md)
    if queue:
        pod_labels |= {KUEUE_QUEUE: queue, KUEUE_GROUP: request.name}
        annotations[KUEUE_GROUP_COUNT] = str(request.node_count)
    grace = math.ceil(settings.preempt_grace_s) + 15
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": grace,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        # One rank per node: a node rank is a node (the placements, the rendezvous, the GPUs).
        "affinity": {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {ENGINE_JOB: request.name}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        },
        "containers": [
            {
                "name": CONTAINER,
                "image": settings.k8s_image,
                "command": argv[:1],
                "args": argv[1:],
                "env": [
                    {"name": "TORCHYARD_LAUNCH_TOKEN", "value": request.launch_token},
                    {"name": "TORCHYARD_PREEMPT_GRACE_S", "value": f"{settings.preempt_grace_s:g}"},
                    {"name": "TORCHYARD_LAUNCH_CPUS", "value": cpus},
                    {
                        "name": "TORCHYARD_NODE_NAME",
                        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                    },
                    {"name": "TORCHYARD_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                ],
                "resources": resources,
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
    }
    if selector := node_selector(settings):
        spec["nodeSelector"] = selector
    if tol := tolerations(settings):
        spec["tolerations"] = tol
    if settings.k8s_priority_class:
        spec["priorityClassName"] = settings.k8s_priority_class
    spec = merge(spec, pod_patch(settings))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": pod_labels,
            "annotations": annotations,
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": request.name,
                    "uid": owner_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }


# --- reading ------------------------------------------------------------------------------


def quantity(value: Any) -> Decimal:
    try:
        return Decimal(parse_quantity(value)) if value is not None else Decimal(0)
    except ValueError:
        return Decimal(0)


@dataclass(frozen=True)
class NodeView:
    name: str
    address: str
    gpus: int
    cpus: int
    ready: bool
    cordoned: bool
    # Taints that keep pods off it (NoSchedule, NoExecute) which the pods do not tolerate.
    untolerated: tuple[str, ...]
    labels: Mapping[str, str]


def node_view(node: Mapping[str, Any], tolerated: Iterable[Mapping[str, Any]]) -> NodeView:
    meta, spec, status = node.get("metadata", {}), node.get("spec", {}), node.get("status", {})
    allocatable = status.get("allocatable") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    tol = list(tolerated)
    untolerated = tuple(
        f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}"
        for t in spec.get("taints") or []
        if t.get("effect") in ("NoSchedule", "NoExecute") and not any(_tolerates(x, t) for x in tol)
    )
    return NodeView(
        name=meta.get("name", ""),
        address=addresses.get("InternalIP") or addresses.get("Hostname") or meta.get("name", ""),
        gpus=int(quantity(allocatable.get(GPU))),
        cpus=int(quantity(allocatable.get("cpu"))),
        ready=conditions.get("Ready") == "True",
        cordoned=bool(spec.get("unschedulable")),
        untolerated=untolerated,
        labels=meta.get("labels") or {},
    )


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration.get("key") == taint.get("key")
    return bool(
        toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get("value", "")
    )


def requested(pods: Iterable[Mapping[str, Any]]) -> dict[str, tuple[Decimal, Decimal]]:
    """(GPUs, CPUs) requested on each node by its pods that have not terminated."""
    out: dict[str, tuple[Decimal, Decimal]] = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if not node or (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        gpus, cpus = out.get(node, (Decimal(0), Decimal(0)))
        for c in (p.get("spec") or {}).get("containers") or []:
            asked = (
                (c.get("resources") or {}).get("requests") or (c.get("resources") or {}).get("limits") or {}
            )
            gpus += quantity(asked.get(GPU))
            cpus += quantity(asked.get("cpu"))
        out[node] = (gpus, cpus)
    return out


@dataclass(frozen=True)
class PodView:
    name: str
    rank: int
    phase: str
    node: str
    ip: str
    deleting: bool
    # Why it is not bound to a node (the scheduler's message), or "".
    unschedulable: str
    # A container waiting for something it never gets by itself (ErrImagePull...): reason, message.
    fatal: tuple[str, str] | None
    # How its container ended: exit code, reason, the end of its output (the termination message).
    exit_code: int | None
    reason: str
    message: str
    evicted: bool


def pod_view(p: Mapping[str, Any]) -> PodView:
    meta, spec, status = p.get("metadata") or {}, p.get("spec") or {}, p.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = ""
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduler_words(scheduled.get("message") or "Unschedulable")
    containers: list[dict[str, Any]] = status.get("containerStatuses") or [{}]
    container = containers[0] or {}
    state = container.get("state") or {}
    waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
    fatal = (
        (waiting["reason"], waiting.get("message", "")) if waiting.get("reason") in FATAL_WAITING else None
    )
    disruption = (conditions.get("DisruptionTarget") or {}).get("status") == "True"
    return PodView(
        name=meta.get("name", ""),
        rank=int((meta.get("labels") or {}).get(RANK, "0")),
        phase=status.get("phase") or "Pending",
        node=spec.get("nodeName") or "",
        ip=status.get("podIP") or "",
        deleting=bool(meta.get("deletionTimestamp")),
        unschedulable=unschedulable,
        fatal=fatal,
        exit_code=terminated.get("exitCode"),
        reason=terminated.get("reason") or status.get("reason") or "",
        message=(terminated.get("message") or status.get("message") or "").strip(),
        evicted=disruption or status.get("reason") in PREEMPTED_REASONS,
    )


def scheduler_words(message: str) -> str:
    """The scheduler's reasons without its node counts: ``0/3 nodes are available: 3
    Insufficient nvidia.com/gpu.`` → ``Insufficient nvidia.com/gpu``."""
    _, sep, reasons = message.partition("nodes are available:")
    if not sep:
        return message.strip().rstrip(".")
    words = []
    for part in reasons.strip().rstrip(".").split(","):
        count, _, what = part.strip().partition(" ")
        words.append(what if count.isdigit() and what else part.strip())
    # The nodes a rank's own gang already holds are excluded by its one-rank-per-node rule:
    # that says nothing of why the gang does not fit, when anything else does.
    told = [w for w in words if w and "anti-affinity" not in w]
    return ", ".join(told or [w for w in words if w])
