"""The Kubernetes driver (docs/kubernetes.md): one pod per node rank, Kubernetes doing the scheduling.

The port's four operations (:mod:`service.engines.base`) with the official ``kubernetes``
client, in one namespace, as the engine's service account (or ``KUBECONFIG``):

1. **inventory**: the nodes the pods may go to (the node selector's, tolerated taints), with
   their allocatable ``nvidia.com/gpu`` (else CPUs); cordoned nodes are drained, NotReady
   ones lost; what non-terminated pods request is kept with each node;
2. **submit**: the attempt's owner, a headless Service named ``torchyard-<job>-<attempt>``
   (the ``engine_job_id``), then one pod per node rank owned by it (deleting the owner
   deletes them all), each running the one-placement launcher with the attempt's launch
   token and its GPUs (or CPUs). An owner already there is adopted and only its missing
   pods are made: an API that stopped between the two submits nothing twice;
3. **poll**: one list of the engine's Services and one of its pods per pass, whatever the
   number of attempts. All or nothing: an attempt whose pods are not all bound to nodes
   ``k8s_gang_timeout_s`` after they were made is deleted whole and reported
   ``UNSCHEDULABLE`` with the scheduler's reason — no partial gang holds GPUs. Once every
   rank is bound with an address, the state carries the nodes and rank 0's address (the
   reconciler binds the placements; the launchers wait for that). A container that cannot
   start (an image that cannot be pulled...) ends the attempt at once; an evicted pod is a
   preemption; a pod missing while its owner lives was deleted from outside; the owner
   missing means the attempt was deleted from outside (a cancel);
4. **cancel**: the owner deleted (and its pods with it, each given its grace period).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from service.config import Settings
from service.engines import kubernetes_objects as k8s
from service.engines.base import (
    KUBERNETES_CAPABILITIES,
    Capabilities,
    Ending,
    EngineJobState,
    EngineNotAnswering,
    EngineUnavailable,
    LaunchRequest,
    NodeSeen,
    Phase,
    SubmitRefused,
)
from service.states import EngineName
from torchyard.contract.states import NodeStatus

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
# What the engine's role must be allowed (docs/kubernetes.md; deploy/kubernetes/engine-rbac.yaml).
NEEDED = (
    ("", "pods", "create"),
    ("", "pods", "list"),
    ("", "pods", "delete"),
    ("", "pods/log", "get"),
    ("", "services", "create"),
    ("", "services", "get"),
    ("", "services", "list"),
    ("", "services", "delete"),
    ("", "events", "list"),
    ("", "nodes", "list"),
    ("", "namespaces", "get"),
)
# Of those, the ones that are not in a namespace.
CLUSTER_SCOPED = frozenset({"nodes", "namespaces"})
_TIMEOUT_S = 20


@dataclass
class KubernetesDriver:
    settings: Settings
    api: client.ApiClient | None = None
    name: EngineName = EngineName.KUBERNETES
    display_name: str = "Kubernetes"
    cancel_verb: str = "deleted"
    capabilities: Capabilities = KUBERNETES_CAPABILITIES
    launcher: str = field(init=False)
    # Whether the nodes have GPUs: pods then ask for nvidia.com/gpu, else for CPUs.
    gpus: bool = False
    # The CPUs a pod asks for with each GPU: the fewest any GPU node has per GPU.
    cpus_per_gpu: int = 1
    # Calls to the API server, by what was called (the benchmark reads them).
    calls: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.launcher = self.settings.k8s_launcher
        self.namespace = self.settings.k8s_namespace

    @property
    def period_s(self) -> float | None:
        return self.settings.k8s_poll_s

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls[what] = self.calls.get(what, 0) + 1
        kwargs.setdefault("_request_timeout", _TIMEOUT_S)
        try:
            return fn(*args, **kwargs)
        except (HTTPError, OSError) as exc:  # no answer (an ApiException is one: it goes up)
            raise EngineNotAnswering(f"the Kubernetes API server does not answer: {exc}") from exc

    # --- start ----------------------------------------------------------------------------

    def start(self) -> None:
        """Connect, and check the namespace and every permission: one clear line otherwise."""
        try:
            k8s.check_settings(self.settings)
        except k8s.PodSettingsError as exc:
            raise EngineUnavailable(f"TORCHYARD_ENGINE=kubernetes: {exc}") from exc
        if self.api is None:
            self.api = _connect()
        try:
            self._call("check", self.core.read_namespace, self.namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                raise EngineUnavailable(
                    f"TORCHYARD_K8S_NAMESPACE: no namespace {self.namespace!r} in this Kubernetes cluster"
                ) from exc
            if exc.status != 403:  # 403: said below, with every other permission missing
                raise EngineUnavailable(
                    f"TORCHYARD_ENGINE=kubernetes: the API server answered {exc.status}: {_message(exc)}"
                ) from exc
        except EngineNotAnswering as exc:
            raise EngineUnavailable(f"TORCHYARD_ENGINE=kubernetes: {exc}") from exc
        refused = [
            (group, resource, verb)
            for group, resource, verb in NEEDED
            if not self._allowed(group, resource, verb)
        ]
        writes = [n for n in NEEDED if n[1] not in CLUSTER_SCOPED and n[2] in ("create", "delete")]
        if all(n in refused for n in writes):
            # Nothing at all there: a namespace that does not exist looks the same to a role
            # that may not read namespaces.
            raise EngineUnavailable(
                f"TORCHYARD_K8S_NAMESPACE: no namespace {self.namespace!r}, or the engine's account has no role "
                "in it (apply deploy/kubernetes/engine-rbac.yaml)"
            )
        missing = [f"{verb} {resource}" for _group, resource, verb in refused]
        if missing:
            raise EngineUnavailable(
                f"TORCHYARD_ENGINE=kubernetes: the engine's account may not {', '.join(missing)} "
                f"in namespace {self.namespace} (apply deploy/kubernetes/engine-rbac.yaml)"
            )
        log.info("Kubernetes engine: namespace %s, image %s", self.namespace, self.settings.k8s_image)

    def _allowed(self, group: str, resource: str, verb: str) -> bool:
        sub, _, subresource = resource.partition("/")
        attributes = client.V1ResourceAttributes(
            group=group,
            resource=sub,
            subresource=subresource or None,
            verb=verb,
            namespace=None if resource in CLUSTER_SCOPED else self.namespace,
            name=self.namespace if resource == "namespaces" else None,
        )
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes)
        )
        answer = self._call(
            "check", client.AuthorizationV1Api(self.api).create_self_subject_access_review, review
        )
        return bool(answer.status.allowed)

    # --- inventory ------------------------------------------------------------------------

    def inventory(self) -> list[NodeSeen]:
        nodes = self._list("nodes", self.core.list_node)
        pods = self._list("pods", self.core.list_pod_for_all_namespaces, field_selector=_NOT_ENDED)
        asked = k8s.requested(pods)
        selector = k8s.node_selector(self.settings)
        tolerated = k8s.tolerations(self.settings)
        views = [k8s.node_view(n, tolerated) for n in nodes]
        views = [v for v in views if all(v.labels.get(k) == val for k, val in selector.items())]
        self.gpus = any(v.gpus for v in views)
        ratios = [v.cpus // v.gpus for v in views if v.gpus]
        self.cpus_per_gpu = max(1, min(ratios)) if ratios else 1
        return [self._seen(v, asked.get(v.name)) for v in sorted(views, key=lambda v: v.name)]

    def _seen(self, view: k8s.NodeView, asked: tuple[Any, Any] | None) -> NodeSeen:
        gpu = self.gpus
        units = view.gpus if gpu else max(1, view.cpus)
        used = int((asked[0] if gpu else asked[1]) + 0) if asked else 0
        if not view.ready:
            status, state, why = NodeStatus.LOST, "NotReady", f"node {view.name} is NotReady in Kubernetes"
        elif view.cordoned or view.untolerated:
            status, state = NodeStatus.DRAINED, "SchedulingDisabled" if view.cordoned else "Tainted"
            why = f"node {view.name} is {'cordoned' if view.cordoned else 'tainted ' + ', '.join(view.untolerated)}"
        else:
            status, state, why = NodeStatus.READY, "Ready", ""
        return NodeSeen(
            name=view.name,
            address=view.address,
            units=units,
            accelerator="gpu" if gpu else "cpu",
            status=status,
            state=state,
            why=why,
            info={"gpus": view.gpus, "cpus": view.cpus, "requested_units": min(used, units)},
        )

    def _list(self, what: str, fn: Any, **kwargs: Any) -> list[dict[str, Any]]:
        try:
            answer = self._call(what, fn, _preload_content=False, **kwargs)
        except ApiException as exc:
            raise EngineNotAnswering(f"listing {what}: {exc.status} {_message(exc)}") from exc
        return list(_json(answer).get("items") or [])

    # --- submit ---------------------------------------------------------------------------

    def submit(self, request: LaunchRequest) -> str:
        try:
            owner = self._owner(request)
            made = {
                p["metadata"]["name"]
                for p in self._list(
                    "pods", self.core.list_namespaced_pod, namespace=self.namespace,
                    label_selector=f"{k8s.ENGINE_JOB}={request.name}",
                )
            }  # fmt: skip
            for rank in range(request.node_count):
                body = k8s.pod(self.settings, request, rank, owner, self.gpus, self.cpus_per_gpu)
                if body["metadata"]["name"] in made:
                    continue
                try:
                    self._call(
                        "pods", self.core.create_namespaced_pod, self.namespace, body, _preload_content=False
                    )
                except ApiException as exc:
                    if exc.status != 409:  # 409: made meanwhile
                        raise
        except ApiException as exc:
            if exc.status in (400, 403, 404, 422):
                self.cancel(request.name)
                raise SubmitRefused(f"Kubernetes refused the attempt's pods: {_message(exc)}") from exc
            raise EngineNotAnswering(f"creating {request.name}: {exc.status} {_message(exc)}") from exc
        return request.name

    def _owner(self, request: LaunchRequest) -> str:
        """The uid of the attempt's owner Service, made now unless this service made it before."""
        try:
            made = self._call(
                "services",
                self.core.create_namespaced_service,
                self.namespace,
                k8s.owner_service(request),
                _preload_content=False,
            )
            return str(_json(made)["metadata"]["uid"])
        except ApiException as exc:
            if exc.status != 409:
                raise
        existing = _json(
            self._call(
                "services",
                self.core.read_namespaced_service,
                request.name,
                self.namespace,
                _preload_content=False,
            )
        )["metadata"]
        if (existing.get("labels") or {}).get(k8s.MANAGED_BY) != "torchyard":
            raise ApiException(
                status=409, reason=f"a Service {request.name} not made by torchyard is in the way"
            )
        log.warning("job %s: Kubernetes already has %s: not submitted again", request.job_id, request.name)
        return str(existing["uid"])

    # --- poll -----------------------------------------------------------------------------

    def poll(self, ids: Sequence[str]) -> dict[str, EngineJobState]:
        if not ids:
            return {}
        managed = f"{k8s.MANAGED_BY}=torchyard"
        owners = {
            s["metadata"]["name"]: s
            for s in self._list(
                "services",
                self.core.list_namespaced_service,
                namespace=self.namespace,
                label_selector=managed,
            )
        }
        pods: dict[str, list[k8s.PodView]] = {}
        for p in self._list(
            "pods", self.core.list_namespaced_pod, namespace=self.namespace, label_selector=managed
        ):
            job = (p["metadata"].get("labels") or {}).get(k8s.ENGINE_JOB, "")
            pods.setdefault(job, []).append(k8s.pod_view(p))
        return {i: self._state(i, owners.get(i), sorted(pods.get(i, []), key=lambda v: v.rank)) for i in ids}

    def _state(self, job: str, owner: dict[str, Any] | None, pods: list[k8s.PodView]) -> EngineJobState:
        if owner is None:
            return _ended(job, "Deleted", Ending.CANCELLED, f"the owner of Kubernetes job {job} was deleted")
        count = int((owner["metadata"].get("annotations") or {}).get(k8s.NODE_COUNT, len(pods) or 1))
        ended = [p for p in pods if p.phase in ("Succeeded", "Failed")]
        if fatal := next((p for p in pods if p.fatal), None):
            reason, message = fatal.fatal or ("", "")
            return _ended(
                job,
                reason,
                Ending.FAILED,
                f"pod {fatal.name} of Kubernetes job {job} cannot start: {reason}: {message}".rstrip(": "),
                self._events(fatal.name),
            )
        unscheduled = [p for p in pods if not p.node]
        if unscheduled and len(pods) == count:
            reason = f"{len(unscheduled)} of {count} pods unschedulable: {unscheduled[0].unschedulable or 'Pending'}"
            if time.time() - _created(owner) > self.settings.k8s_gang_timeout_s:
                log.warning("Kubernetes job %s: %s; deleted whole", job, reason)
                self.cancel(job, grace_period_s=0)  # nothing ran in them: freed at once
                return EngineJobState(
                    id=job,
                    phase=Phase.ENDED,
                    state="Unschedulable",
                    reason=reason,
                    ending=Ending.UNSCHEDULABLE,
                    summary=reason,
                )
            return EngineJobState(id=job, phase=Phase.PENDING, state="Pending", reason=reason)
        if len(pods) < count:
            if pods and len(ended) < len(pods):
                return EngineJobState(id=job, phase=Phase.RUNNING, state="Running")  # the leases decide
            return _ended(
                job,
                "PodDeleted",
                Ending.NODE_LOST,
                f"{count - len(pods)} of {count} pods of Kubernetes job {job} were deleted",
            )
        if len(ended) == count:
            return self._finished(job, pods)
        # While its attempt lives only others delete its pods: an eviction, a preemption.
        taken = next((p for p in pods if p.evicted or p.deleting), None)
        disrupted = f"pod {taken.name} on node {taken.node} is being evicted" if taken else ""
        if all(p.node and p.ip for p in pods):
            return EngineJobState(
                id=job,
                phase=Phase.RUNNING,
                state="Running",
                nodes=tuple(p.node for p in pods),
                master_addr=pods[0].ip,
                disrupted=disrupted,
            )
        if any(not p.ip for p in pods) and not disrupted:
            return EngineJobState(id=job, phase=Phase.PENDING, state="Pending", reason="ContainerCreating")
        return EngineJobState(id=job, phase=Phase.RUNNING, state="Running", disrupted=disrupted)

    def _finished(self, job: str, pods: list[k8s.PodView]) -> EngineJobState:
        failed = [p for p in pods if p.phase == "Failed"]
        if not failed:
            return _ended(job, "Succeeded", Ending.COMPLETED, f"Kubernetes job {job} ended Succeeded")
        first = failed[0]
        ending = Ending.PREEMPTED if any(p.evicted for p in failed) else Ending.FAILED
        summary = (
            f"pod {first.name} of Kubernetes job {job} ended Failed (exit code "
            f"{first.exit_code if first.exit_code is not None else '?'}, reason {first.reason or 'none'})"
        )
        return _ended(job, first.reason or "Failed", ending, summary, self._log_tail(first))

    def _log_tail(self, pod: k8s.PodView) -> str:
        try:
            # The raw body, decoded here: the client's own decoding of a log differs between
            # its versions (some give the repr of the bytes).
            response = self._call(
                "pods/log", self.core.read_namespaced_pod_log, pod.name, self.namespace,
                container=k8s.CONTAINER, tail_lines=LOG_TAIL_LINES, _preload_content=False,
            )  # fmt: skip
            return bytes(response.data or b"").decode("utf-8", "replace").strip() or pod.message
        except (ApiException, EngineNotAnswering):
            return pod.message  # its termination message: the end of its output

    def _events(self, pod: str) -> str:
        try:
            events = self._list(
                "events", self.core.list_namespaced_event, namespace=self.namespace,
                field_selector=f"involvedObject.name={pod}",
            )  # fmt: skip
        except EngineNotAnswering:
            return ""
        return "\n".join(f"{e.get('reason')}: {e.get('message')}" for e in events[-LOG_TAIL_LINES:])

    # --- cancel ---------------------------------------------------------------------------

    def cancel(self, engine_job_id: str, *, grace_period_s: int | None = None) -> None:
        """The owner deleted with its pods (each stopped with its grace period, or with
        ``grace_period_s``)."""
        log.info("deleting Kubernetes job %s", engine_job_id)
        try:
            self._call(
                "services",
                self.core.delete_namespaced_service,
                engine_job_id,
                self.namespace,
                propagation_policy="Background",
                _preload_content=False,
            )
        except ApiException as exc:
            if exc.status != 404:
                log.warning("deleting %s: %s %s", engine_job_id, exc.status, _message(exc))
        # The garbage collector deletes the pods too; deleting them now frees their units at once.
        pods = self._list(
            "pods",
            self.core.list_namespaced_pod,
            namespace=self.namespace,
            label_selector=f"{k8s.ENGINE_JOB}={engine_job_id}",
        )
        for p in pods:
            if not p["metadata"].get("deletionTimestamp"):
                try:
                    self._call(
                        "pods",
                        self.core.delete_namespaced_pod,
                        p["metadata"]["name"],
                        self.namespace,
                        grace_period_seconds=grace_period_s,
                        _preload_content=False,
                    )
                except ApiException as exc:
                    if exc.status != 404:
                        log.warning("deleting pod %s: %s", p["metadata"]["name"], _message(exc))


_NOT_ENDED = "status.phase!=Succeeded,status.phase!=Failed"


def _connect() -> client.ApiClient:
    """The in-cluster service account, else ``KUBECONFIG`` (or ~/.kube/config)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise EngineUnavailable(
                f"TORCHYARD_ENGINE=kubernetes: no in-cluster service account and no usable KUBECONFIG ({exc})"
            ) from exc
    return client.ApiClient()


def _json(response: Any) -> dict[str, Any]:
    data = response.data if hasattr(response, "data") else response
    value = json.loads(data)
    return value if isinstance(value, dict) else {}


def _message(exc: ApiException) -> str:
    try:
        return str(_json(exc.body).get("message") or exc.reason)
    except (ValueError, TypeError):
        return str(exc.reason)


def _created(owner: dict[str, Any]) -> float:
    stamp = owner["metadata"].get("creationTimestamp") or ""
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


def _ended(job: str, state: str, ending: Ending, summary: str, tail: str = "") -> EngineJobState:
    return EngineJobState(
        id=job, phase=Phase.ENDED, state=state, reason=state, ending=ending, summary=summary, output_tail=tail
    )
