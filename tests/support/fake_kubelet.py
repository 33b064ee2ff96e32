"""A stand-in kubelet for :mod:`tests.support.kube_cluster`: a Node whose pods are local processes.

A real kubelet needs a container runtime, images and a CNI network (docs/kubernetes-testing.md
says why none runs here). :class:`FakeKubelet` does the part of a kubelet that a workload
engine sees through the API, against the real apiserver, scheduler and controller-manager:

* it registers its Node (capacity and allocatable ``cpu``, ``memory``, ``pods`` and, with
  ``gpus=N``, ``nvidia.com/gpu``; labels, taints, ``Ready``) and renews the node's Lease in
  ``kube-node-lease`` every ``heartbeat_s``, so the node-lifecycle controller keeps it Ready;
  :meth:`FakeKubelet.stop_heartbeats` makes it go silent (the controller then marks it
  NotReady and, later, evicts its pods);
* it watches the pods bound to it (``spec.nodeName``) and runs the **first container's**
  ``command`` + ``args`` (``$(VAR)`` expanded) as a local process with the container's
  ``env`` and ``envFrom`` (plain values; ``fieldRef`` to ``metadata.name|namespace|uid``,
  ``metadata.labels['…']``, ``metadata.annotations['…']``, ``spec.nodeName``,
  ``spec.serviceAccountName``, ``status.podIP``, ``status.hostIP``; ConfigMap and Secret
  keys) on top of ``env=`` (what the "image" would set; by default ``PATH`` and ``HOME``
  only, not the test's environment), in ``workingDir`` if given; with ``netns=`` inside that
  network namespace (``ip netns exec``, with that namespace's name files), the pod's IP being ``address``;
* it writes the pod's status as a kubelet does: ``Running`` with ``podIP``, ``hostIP``,
  conditions and a ``containerStatuses`` entry in ``state.running``, then ``Succeeded`` or
  ``Failed`` with ``state.terminated`` (``exitCode``, ``reason`` ``Completed``/``Error``;
  128+N for a signal); ``restartPolicy`` ``OnFailure``/``Always`` restart the process
  (``restartCount``, ``lastState``);
* a pod given ``nvidia.com/gpu`` gets that many of the node's GPU indices in
  ``NVIDIA_VISIBLE_DEVICES`` (as the NVIDIA device plugin sets it; no GPU is real);
* deletion: a pod with a ``deletionTimestamp`` has its process sent SIGTERM, then after the
  deletion's grace period SIGKILL (its whole process group, as a container's end kills
  everything in it), its final status written, and is then deleted with grace 0;
* logs: the process's stdout and stderr go to a file per pod (:meth:`FakeKubelet.log_path`),
  and the kubelet's log endpoint is served (HTTPS, ``/containerLogs/…`` with ``follow``,
  ``tailLines``, ``limitBytes``), so the apiserver's ``pods/log`` (``kubectl logs``,
  ``read_namespaced_pod_log``) works for pods on this node;
* an image whose name contains ``does-not-exist`` is never "pulled": the pod stays Pending
  with its container waiting in ``ErrImagePull``.

Not done: volumes and volumeMounts (the process sees this machine's files), init and further
containers (ignored), probes, resource limits (nothing is enforced), ``exec``/``attach``/
``port-forward``, images (the command must exist here), ``CrashLoopBackOff`` and
``OOMKilled``. :func:`evict` drives the Eviction API (``policy/v1beta1`` on 1.20).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import http.server
import json
import os
import re
import signal
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

    from tests.support.kube_cluster import KubeCluster

KUBELET_VERSION = "v1.20.2"
GPU_RESOURCE = "nvidia.com/gpu"
BAD_IMAGE_MARK = "does-not-exist"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class Rest:
    """Plain JSON calls through a ``kubernetes`` client's connection (its TLS and credentials),
    without the client's models: the objects stay as the API wrote them."""

    def __init__(self, client: ApiClient) -> None:
        self.client = client

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
        stream: bool = False,
    ) -> Any:
        from kubernetes.client.rest import ApiException

        try:
            resp = self.client.call_api(
                path,
                method,
                query_params=[(k, v) for k, v in (query or {}).items() if v is not None],
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _return_http_data_only=True,
                _request_timeout=timeout,
            )
        except ApiException as exc:
            raise ApiError(int(exc.status or 0), str(exc.body or exc.reason or "")) from None
        if stream:
            return resp
        data = resp.data or b""
        resp.release_conn()
        return json.loads(data) if data else None

    def get(self, path: str, **query: Any) -> Any:
        return self.call("GET", path, query=query)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.call("PATCH", path, body, content_type="application/merge-patch+json")


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def evict(
    client: ApiClient | Rest,
    namespace: str,
    name: str,
    *,
    grace_period_s: int | None = None,
    disruption_condition: bool = False,
) -> None:
    """Evict a pod through the Eviction API, as ``kubectl drain`` does (honours
    PodDisruptionBudgets: an HTTP 429 :class:`ApiError` when one forbids it).

    Kubernetes 1.20 serves the eviction subresource in ``policy/v1beta1`` only (``policy/v1``
    came in 1.22), and the evicted pod just gets a ``deletionTimestamp``. From 1.26 the API
    also adds the condition ``DisruptionTarget`` (reason ``EvictionByEvictionAPI``) first;
    ``disruption_condition=True`` writes that condition here before evicting, so an engine's
    handling of it can be tested on 1.20 too."""
    rest = client if isinstance(client, Rest) else Rest(client)
    if disruption_condition:
        pod = rest.get(pod_path(namespace, name))
        conditions = [c for c in pod["status"].get("conditions", []) if c["type"] != "DisruptionTarget"]
        conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting",
                "lastTransitionTime": now_rfc3339(),
            }
        )
        rest.merge_patch(pod_path(namespace, name) + "/status", {"status": {"conditions": conditions}})
    body: dict[str, Any] = {
        "apiVersion": "policy/v1beta1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
    }
    if grace_period_s is not None:
        body["deleteOptions"] = {"gracePeriodSeconds": grace_period_s}
    rest.call("POST", pod_path(namespace, name) + "/eviction", body)


@dataclass
class _PodRun:
    uid: str
    namespace: str
    name: str
    pod: dict[str, Any]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    gpus: list[int] = field(default_factory=list)
    started_at: str = ""
    restart_count: int = 0
    last_state: dict[str, Any] = field(default_factory=dict)
    terminating: bool = False
    finished: threading.Event = field(default_factory=threading.Event)


class _ConfigError(Exception):
    """A container cannot be configured (``CreateContainerConfigError``)."""


class FakeKubelet:
    """Node ``name`` of ``cluster``; its pods run as processes here (see the module's doc)."""

    def __init__(
        self,
        cluster: KubeCluster,
        name: str,
        *,
        cpu: str = "8",
        memory: str = "32Gi",
        pods: int = 110,
        gpus: int = 0,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        address: str = "127.0.0.1",
        netns: str | None = None,
        env: Mapping[str, str] | None = None,
        heartbeat_s: float = 5.0,
        kubeconfig: Path | None = None,
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.capacity = {"cpu": cpu, "memory": memory, "pods": str(pods), "ephemeral-storage": "100Gi"}
        if gpus:
            self.capacity[GPU_RESOURCE] = str(gpus)
        self.labels = dict(labels or {})
        self.taints = [dict(t) for t in taints]
        self.address = address
        self.netns = netns
        self.base_env = (
            dict(env)
            if env is not None
            else {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root")}
        )
        self.heartbeat_s = heartbeat_s
        self.rest = Rest(cluster.api_client(kubeconfig))
        self.dir = cluster.root / "kubelets" / name
        self._free_gpus = list(range(gpus))
        self._runs: dict[str, _PodRun] = {}
        self._logs: dict[tuple[str, str], _PodRun] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beating = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_resp: Any = None
        self._server: http.server.ThreadingHTTPServer | None = None
        self.errors: list[str] = []

    # --- what tests use ------------------------------------------------------------------

    def log_path(self, namespace: str, pod: str) -> Path:
        """The file with the stdout and stderr of the pod's container (every restart appended)."""
        with self._lock:
            run = self._logs.get((namespace, pod))
        if run is None:
            raise KeyError(f"no pod {namespace}/{pod} ran on {self.name}")
        return run.log

    def read_log(self, namespace: str, pod: str) -> str:
        return self.log_path(namespace, pod).read_text(errors="replace")

    def pid(self, namespace: str, pod: str) -> int | None:
        """The pid of the pod's running process (to kill it from a test), or None."""
        with self._lock:
            run = self._logs.get((namespace, pod))
        if run is None or run.proc is None or run.proc.poll() is not None:
            return None
        return run.proc.pid

    def running(self) -> list[str]:
        """``namespace/name`` of the pods whose process runs now."""
        with self._lock:
            runs = list(self._runs.values())
        return sorted(f"{r.namespace}/{r.name}" for r in runs if r.proc is not None and r.proc.poll() is None)

    def stop_heartbeats(self) -> None:
        """Stop renewing the node's Lease: the node-lifecycle controller marks the node NotReady
        after its grace period (its pods keep running, as on a node cut off the network)."""
        self._beating.clear()

    def resume_heartbeats(self) -> None:
        self._beating.set()
        self._renew_lease()
        self._post_node_status()

    # --- start and stop ------------------------------------------------------------------

    def start(self) -> FakeKubelet:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        self._start_log_server()
        self._register()
        self._beating.set()
        for target in (self._heartbeats, self._watch_pods):
            thread = threading.Thread(
                target=target, name=f"kubelet-{self.name}-{target.__name__}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def close(self, *, delete_node: bool = True) -> None:
        """Stop watching, kill every pod process (SIGKILL) and, by default, delete the Node."""
        self._stop.set()
        resp = self._watch_resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()
            with contextlib.suppress(Exception):
                resp.close()
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.terminating = True
            _kill_group(run.proc, signal.SIGKILL)
        for run in runs:
            if run.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.proc.wait(5)
        for thread in self._threads:
            thread.join(timeout=10)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if delete_node:
            with contextlib.suppress(Exception):
                self.rest.call("DELETE", f"/api/v1/nodes/{self.name}")

    # --- the node and its heartbeat -------------------------------------------------------

    def _node_conditions(self, ready: bool = True) -> list[dict[str, Any]]:
        now = now_rfc3339()
        ok = {"status": "False", "lastHeartbeatTime": now, "lastTransitionTime": now}
        return [
            {"type": "MemoryPressure", **ok, "reason": "KubeletHasSufficientMemory", "message": "ok"},
            {"type": "DiskPressure", **ok, "reason": "KubeletHasNoDiskPressure", "message": "ok"},
            {"type": "PIDPressure", **ok, "reason": "KubeletHasSufficientPID", "message": "ok"},
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
                "reason": "KubeletReady" if ready else "KubeletNotReady",
                "message": "the stand-in kubelet is posting ready status",
            },
        ]

    def _node_status(self) -> dict[str, Any]:
        assert self._server is not None
        return {
            "capacity": dict(self.capacity),
            "allocatable": dict(self.capacity),
            "conditions": self._node_conditions(),
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self._server.server_address[1]}},
            "nodeInfo": {
                "machineID": self.name,
                "systemUUID": self.name,
                "bootID": self.name,
                "kernelVersion": os.uname().release,
                "osImage": "torchyard stand-in kubelet",
                "containerRuntimeVersion": "fake://1.0",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": KUBELET_VERSION,
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def _register(self) -> None:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "beta.kubernetes.io/os": "linux",
            "beta.kubernetes.io/arch": "amd64",
            **self.labels,
        }
        node: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels},
            "spec": {"taints": self.taints} if self.taints else {},
        }
        try:
            created = self.rest.call("POST", "/api/v1/nodes", node)
        except ApiError as exc:
            if exc.status != 409:
                raise
            created = self.rest.merge_patch(f"/api/v1/nodes/{self.name}", {"metadata": {"labels": labels}})
        self._post_node_status()
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": LEASE_NAMESPACE,
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": created["metadata"]["uid"]}
                ],
            },
            "spec": {
                "holderIdentity": self.name,
                "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": _micro_now(),
            },
        }
        try:
            self.rest.call("POST", f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", lease)
        except ApiError as exc:
            if exc.status != 409:
                raise
            self._renew_lease()

    def _post_node_status(self) -> None:
        self.rest.merge_patch(f"/api/v1/nodes/{self.name}/status", {"status": self._node_status()})

    def _renew_lease(self) -> None:
        self.rest.merge_patch(
            f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.name}",
            {"spec": {"renewTime": _micro_now(), "holderIdentity": self.name}},
        )

    def _heartbeats(self) -> None:
        last_status = time.monotonic()
        while not self._stop.wait(self.heartbeat_s):
            if not self._beating.is_set():
                continue
            try:
                self._renew_lease()
                if time.monotonic() - last_status > 30:
                    self._post_node_status()
                    last_status = time.monotonic()
            except Exception as exc:
                self._error(f"heartbeat: {exc}")

    def _error(self, message: str) -> None:
        if not self._stop.is_set():
            self.errors.append(message)

    # --- pods ------------------------------------------------------------------------------

    def _watch_pods(self) -> None:
        selector = f"spec.nodeName={self.name}"
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    listed = self.rest.get("/api/v1/pods", fieldSelector=selector)
                    for pod in listed["items"]:
                        self._on_pod("ADDED", pod)
                    resource_version = listed["metadata"]["resourceVersion"]
                resp = self.rest.call(
                    "GET",
                    "/api/v1/pods",
                    query={
                        "watch": "true",
                        "fieldSelector": selector,
                        "resourceVersion": resource_version,
                        "allowWatchBookmarks": "true",
                        "timeoutSeconds": 60,
                    },
                    timeout=90,
                    stream=True,
                )
                self._watch_resp = resp
                try:
                    for line in _lines(resp):
                        if self._stop.is_set():
                            return
                        event = json.loads(line)
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            resource_version = None  # 410 Gone, most likely: list again
                            break
                        resource_version = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self._on_pod(event["type"], obj)
                finally:
                    self._watch_resp = None
                    with contextlib.suppress(Exception):
                        resp.release_conn()
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._error(f"watch: {exc!r}")
                resource_version = None
                self._stop.wait(1)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self._lock:
            run = self._runs.get(uid)
            if run is not None:
                run.pod = pod
        if kind == "DELETED":
            if run is not None:
                run.terminating = True
                _kill_group(run.proc, signal.SIGKILL)
                self._spawn_thread(self._forget, run)
            return
        if meta.get("deletionTimestamp"):
            if run is None:
                self._spawn_thread(self._delete_now, pod)
            elif not run.terminating:
                run.terminating = True
                self._spawn_thread(self._terminate, run)
            return
        if run is not None or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            return
        log = self.dir / "logs" / f"{meta['namespace']}_{meta['name']}_{uid}.log"
        run = _PodRun(uid=uid, namespace=meta["namespace"], name=meta["name"], pod=pod, log=log)
        with self._lock:
            self._runs[uid] = run
            self._logs[(run.namespace, run.name)] = run
        self._spawn_thread(self._run, run)

    def _spawn_thread(self, target: Any, arg: Any) -> None:
        thread = threading.Thread(target=target, args=(arg,), daemon=True)
        thread.start()

    def _patch_status(self, run: _PodRun, status: dict[str, Any]) -> None:
        try:
            self.rest.merge_patch(pod_path(run.namespace, run.name) + "/status", {"status": status})
        except ApiError as exc:
            if exc.status != 404:
                self._error(f"status of {run.namespace}/{run.name}: {exc}")

    def _container_status(self, run: _PodRun, state: dict[str, Any], ready: bool) -> dict[str, Any]:
        container = run.pod["spec"]["containers"][0]
        status: dict[str, Any] = {
            "name": container["name"],
            "image": container.get("image", ""),
            "imageID": "",
            "ready": ready,
            "restartCount": run.restart_count,
            "started": "running" in state,
            "state": state,
        }
        if "waiting" not in state:
            status["imageID"] = f"fake://{container.get('image', '')}"
            status["containerID"] = f"fake://{run.uid}-{run.restart_count}"
        if run.last_state:
            status["lastState"] = run.last_state
        return status

    def _conditions(self, ready: bool, reason: str | None = None) -> list[dict[str, Any]]:
        now = now_rfc3339()
        out = []
        for kind, value in (
            ("Initialized", True),
            ("Ready", ready),
            ("ContainersReady", ready),
            ("PodScheduled", True),
        ):
            cond = {"type": kind, "status": "True" if value else "False", "lastTransitionTime": now}
            if not value and reason:
                cond["reason"] = reason
            out.append(cond)
        return out

    def _run(self, run: _PodRun) -> None:
        try:
            self._run_pod(run)
        except Exception as exc:
            self._error(f"pod {run.namespace}/{run.name}: {exc!r}")
        finally:
            run.finished.set()

    def _run_pod(self, run: _PodRun) -> None:
        base: dict[str, Any] = {"hostIP": "127.0.0.1", "startTime": now_rfc3339()}
        admitted = self._admit(run, base)
        if admitted is None:
            return
        argv, env, cwd = admitted
        ip = self.address
        base.update(podIP=ip, podIPs=[{"ip": ip}])
        policy = run.pod["spec"].get("restartPolicy", "Always")
        backoff = 1.0
        while True:
            run.started_at = now_rfc3339()
            if run.terminating or self._stop.is_set():
                return
            try:
                with open(run.log, "ab") as log:
                    run.proc = subprocess.Popen(
                        argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
            except OSError as exc:
                run.proc = None
                terminated = {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": str(exc),
                    "startedAt": run.started_at,
                    "finishedAt": now_rfc3339(),
                }
            else:
                self._patch_status(
                    run,
                    {
                        **base,
                        "phase": "Running",
                        "conditions": self._conditions(True),
                        "containerStatuses": [
                            self._container_status(run, {"running": {"startedAt": run.started_at}}, True)
                        ],
                    },
                )
                rc = run.proc.wait()
                _kill_group(run.proc, signal.SIGKILL)  # the container's other processes end with it
                terminated = _terminated(rc, run.started_at)
            if run.terminating or self._stop.is_set():
                return  # _terminate (or close) writes the end
            if policy == "Always" or (policy == "OnFailure" and terminated["exitCode"] != 0):
                run.restart_count += 1
                run.last_state = {"terminated": terminated}
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, 10.0)
                continue
            break
        self._finish(run, base, terminated)

    def _admit(
        self, run: _PodRun, base: dict[str, Any]
    ) -> tuple[list[str], dict[str, str], str | None] | None:
        """The pod's image "pulled", its GPUs allocated and its command made; or None, its
        status written, where one of these fails."""
        pod = run.pod
        container = pod["spec"]["containers"][0]
        image = container.get("image", "")
        if BAD_IMAGE_MARK in image:
            waiting = {
                "reason": "ErrImagePull",
                "message": f'rpc error: code = NotFound desc = failed to pull and unpack image "{image}": not found',
            }
            self._patch_status(
                run,
                {
                    **base,
                    "phase": "Pending",
                    "conditions": self._conditions(False, "ContainersNotReady"),
                    "containerStatuses": [self._container_status(run, {"waiting": waiting}, False)],
                },
            )
            return None
        wanted = int(str(container.get("resources", {}).get("limits", {}).get(GPU_RESOURCE, "0")))
        with self._lock:
            if wanted > len(self._free_gpus):
                run.gpus = []
            else:
                run.gpus, self._free_gpus = self._free_gpus[:wanted], self._free_gpus[wanted:]
        if wanted and len(run.gpus) < wanted:
            self._patch_status(
                run,
                {
                    **base,
                    "phase": "Failed",
                    "reason": "UnexpectedAdmissionError",
                    "message": f"Allocate failed due to requested number of devices unavailable for {GPU_RESOURCE}",
                },
            )
            return None
        try:
            return self._command(pod, container, run.gpus)
        except _ConfigError as exc:
            waiting = {"reason": "CreateContainerConfigError", "message": str(exc)}
            self._patch_status(
                run,
                {
                    **base,
                    "phase": "Pending",
                    "conditions": self._conditions(False, "ContainersNotReady"),
                    "containerStatuses": [self._container_status(run, {"waiting": waiting}, False)],
                },
            )
            self._release(run)
            return None

    def _finish(self, run: _PodRun, base: dict[str, Any], terminated: dict[str, Any]) -> None:
        phase = "Succeeded" if terminated["exitCode"] == 0 else "Failed"
        self._patch_status(
            run,
            {
                **base,
                "phase": phase,
                "conditions": self._conditions(False, "PodCompleted"),
                "containerStatuses": [self._container_status(run, {"terminated": terminated}, False)],
            },
        )
        self._release(run)

    def _release(self, run: _PodRun) -> None:
        with self._lock:
            self._free_gpus = sorted(self._free_gpus + run.gpus)
            run.gpus = []

    def _terminate(self, run: _PodRun) -> None:
        """A pod being deleted: SIGTERM, SIGKILL after the grace period, status, delete."""
        meta = run.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = run.pod["spec"].get("terminationGracePeriodSeconds", 30)
        proc = run.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(max(float(grace), 0.0))
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
            _kill_group(proc, signal.SIGKILL)
            terminated = _terminated(proc.returncode, run.started_at)
            ip = self.address
            base = {"hostIP": "127.0.0.1", "podIP": ip, "podIPs": [{"ip": ip}]}
            self._finish(run, base, terminated)
        else:
            self._release(run)
        run.finished.wait(10)
        self._delete_now(run.pod)
        with self._lock:
            self._runs.pop(run.uid, None)

    def _forget(self, run: _PodRun) -> None:
        """A pod deleted at once (grace 0, or by someone else): its process was killed."""
        run.finished.wait(10)
        self._release(run)
        with self._lock:
            self._runs.pop(run.uid, None)

    def _delete_now(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        try:
            self.rest.call("DELETE", pod_path(meta["namespace"], meta["name"]), body)
        except ApiError as exc:
            if exc.status not in (404, 409):
                self._error(f"delete {meta['namespace']}/{meta['name']}: {exc}")

    # --- a container's command and environment --------------------------------------------

    def _command(
        self, pod: dict[str, Any], container: dict[str, Any], gpus: list[int]
    ) -> tuple[list[str], dict[str, str], str | None]:
        env = self._env(pod, container, gpus)
        argv = [_expand(a, env) for a in container.get("command", []) + container.get("args", [])]
        if not container.get("command"):
            raise _ConfigError("the stand-in kubelet has no image entrypoint: the container needs a command")
        if self.netns:
            # ip netns exec (not nsenter --net): the namespace's own hosts and resolv.conf
            # (tests.support.netns writes them), so a peer's name is looked up there, at once.
            argv = ["ip", "netns", "exec", self.netns, *argv]
        cwd = container.get("workingDir")
        if cwd:
            Path(cwd).mkdir(parents=True, exist_ok=True)
        return argv, env, cwd

    def _env(self, pod: dict[str, Any], container: dict[str, Any], gpus: list[int]) -> dict[str, str]:
        env = dict(self.base_env)
        host, _, port = self.cluster.server.removeprefix("https://").rpartition(":")
        env.update(
            HOSTNAME=pod["metadata"]["name"],
            KUBERNETES_SERVICE_HOST=host,
            KUBERNETES_SERVICE_PORT=port,
        )
        if gpus:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        namespace = pod["metadata"]["namespace"]
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                ref = source["configMapRef"]
                data = self._object_data("configmaps", namespace, ref["name"], ref.get("optional", False))
            elif "secretRef" in source:
                ref = source["secretRef"]
                data = self._object_data("secrets", namespace, ref["name"], ref.get("optional", False))
            else:
                raise _ConfigError(f"envFrom {source} is not supported by the stand-in kubelet")
            env.update({prefix + k: v for k, v in data.items()})
        for var in container.get("env", []):
            if "valueFrom" in var:
                value = self._value_from(pod, var["valueFrom"])
                if value is None:
                    continue
            else:
                value = _expand(var.get("value", ""), env)
            env[var["name"]] = value
        return env

    def _object_data(self, kind: str, namespace: str, name: str, optional: bool) -> dict[str, str]:
        try:
            obj = self.rest.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
        except ApiError as exc:
            if exc.status == 404 and optional:
                return {}
            if exc.status == 404:
                raise _ConfigError(f'{kind[:-1]} "{name}" not found') from exc
            raise
        data = obj.get("data") or {}
        if kind == "secrets":
            return {k: base64.b64decode(v).decode() for k, v in data.items()}
        return dict(data)

    def _value_from(self, pod: dict[str, Any], source: dict[str, Any]) -> str | None:
        namespace = pod["metadata"]["namespace"]
        if "fieldRef" in source:
            return _field(pod, source["fieldRef"]["fieldPath"], self.address)
        for key, kind in (("configMapKeyRef", "configmaps"), ("secretKeyRef", "secrets")):
            if key in source:
                ref = source[key]
                data = self._object_data(kind, namespace, ref["name"], ref.get("optional", False))
                if ref["key"] not in data:
                    if ref.get("optional", False):
                        return None
                    raise _ConfigError(
                        f"couldn't find key {ref['key']} in {kind[:-1]} {namespace}/{ref['name']}"
                    )
                return data[ref["key"]]
        raise _ConfigError(f"valueFrom {source} is not supported by the stand-in kubelet")

    # --- the log endpoint the apiserver proxies pods/log to --------------------------------

    def _start_log_server(self) -> None:
        kubelet = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends where the connection does (follow)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                kubelet._serve_log(self)

        assert self.cluster.ca is not None
        cert, key = self.cluster.ca.issue(f"system:node:{self.name}", ips=["127.0.0.1"], server=True)
        (self.dir / "kubelet.crt").write_bytes(cert)
        key_path = self.dir / "kubelet.key"
        key_path.write_bytes(key)
        key_path.chmod(0o600)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.dir / "kubelet.crt", key_path)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self._server = server
        thread = threading.Thread(target=server.serve_forever, name=f"kubelet-{self.name}-logs", daemon=True)
        thread.start()

    def _serve_log(self, req: http.server.BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(req.path)
        parts = url.path.strip("/").split("/")
        query = urllib.parse.parse_qs(url.query)
        if len(parts) != 4 or parts[0] != "containerLogs":
            req.send_error(
                404, "the stand-in kubelet serves /containerLogs/{namespace}/{pod}/{container} only"
            )
            return
        namespace, name = parts[1], parts[2]
        with self._lock:
            run = self._logs.get((namespace, name))
        if run is None or not run.log.exists():
            req.send_error(404, f"no logs of {namespace}/{name} on {self.name}")
            return
        follow = query.get("follow", ["false"])[0] == "true"
        tail = query.get("tailLines", [None])[0]
        limit = query.get("limitBytes", [None])[0]
        data = run.log.read_bytes()
        if tail is not None:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(tail) :]) if int(tail) > 0 else b""
        req.send_response(200)
        req.send_header("Content-Type", "text/plain")
        req.end_headers()
        sent = 0
        offset = run.log.stat().st_size
        try:
            if limit is not None:
                data = data[: int(limit)]
            req.wfile.write(data)
            sent += len(data)
            while follow and (limit is None or sent < int(limit)):
                done = run.proc is None or run.proc.poll() is not None or self._stop.is_set()
                with open(run.log, "rb") as f:
                    f.seek(offset)
                    more = f.read()
                offset += len(more)
                if more:
                    if limit is not None:
                        more = more[: int(limit) - sent]
                    req.wfile.write(more)
                    req.wfile.flush()
                    sent += len(more)
                elif done:
                    break
                else:
                    time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass


def _lines(resp: Any) -> Iterator[str]:
    """The lines of a streamed (watch) response as they come."""
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line.decode()
    if buffer.strip():
        yield buffer.decode()


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable's value, ``$$`` for ``$``; any
    other reference stays as written."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR.sub(one, text)


_INDEXED = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def _field(pod: dict[str, Any], path: str, address: str) -> str:
    meta = pod["metadata"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.podIP": address,
        "status.podIPs": address,
        "status.hostIP": "127.0.0.1",
    }
    if path in simple:
        return str(simple[path])
    m = _INDEXED.match(path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        values = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
    raise _ConfigError(f"fieldRef {path} is not supported by the stand-in kubelet")


def _terminated(rc: int, started_at: str) -> dict[str, Any]:
    code = rc if rc >= 0 else 128 - rc
    out: dict[str, Any] = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": started_at,
        "finishedAt": now_rfc3339(),
    }
    if rc < 0:
        out["signal"] = -rc
    return out


def _kill_group(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
