"""Submit → first training step on torchyard's Kubernetes engine vs bare pods, and its API calls.

The time from ``POST /v1/jobs`` to the first training step through the Kubernetes engine
(docs/kubernetes.md) against pods made by hand that run the same training, and the calls
the engine makes to the Kubernetes API per attempt and per reconciler pass.

The cluster is the tests' private one (``tests.support.kube_cluster``: the kube-apiserver,
etcd, kube-scheduler and kube-controller-manager of Kubernetes 1.20.2), two nodes ``k1``
and ``k2`` of 2 GPUs each whose kubelets are the stand-in of ``tests.support.fake_kubelet``
in network namespaces (a container's start is a process start here, no image is pulled;
no GPU is real: the training runs on the CPU). Root needed. The API runs in this process
(uvicorn in a thread, SQLite, ``TORCHYARD_ENGINE=kubernetes`` with its default poll period),
so that its driver can be instrumented: every call it makes to the Kubernetes API is counted
by the driver method it serves (start, inventory, submit, poll, cancel) and the client
operation, and every reconciler pass is timed. The engine authenticates as the cluster's
admin (its least-privilege role, tested in tests/e2e/test_kubernetes_engine.py, changes no
call). Every pod's command, torchyard's launcher or the bare torchrun, runs through
:func:`write_in_host`'s wrapper, so that names resolve at once as in a real cluster
(``--nsenter-only`` leaves it out).

1. **Submit → first step**, 1 node and 2 nodes × 1 process, MobileNetV3-Small at 16 px on the
   digits (as the engine's end-to-end test), 1 epoch:

   * **torchyard**: ``POST /v1/jobs``, then everything a job pays: the pass that submits it
     (the owner Service, a pod per node rank), Kubernetes' scheduling, the stand-in kubelet
     starting the launcher, its check-in, the pass that binds the ranks once every pod runs,
     the dataset download, torchrun in the run's sandbox, the trainer. *First step* is the
     time of the first ``train.loss`` point (the rank's own clock).
   * **bare**: the same training as a hand-made pod per node (``torchrun`` of
     ``bench/plain_torchrun.py``: the same model, data, batch, image size and "light"
     augmentation, as many threads and loader workers as the job's rank gets, reading the
     digits from local disk), created through the Kubernetes API with the same resources
     (1 ``nvidia.com/gpu``), no owner, no launcher. The two pods of a 2-node run are pinned to
     k1 and k2 with a node selector, k1's address being the rendezvous (a hand-made run knows
     it in advance; the scheduler still binds them). *First step* is the time rank 0 prints
     after its first optimizer step.

   A watch on the namespace times each run's pods: made, bound to a node, running (the
   process started); the launchers' logs when they were up, checked in and had started
   torchrun. Rounds alternate bare and torchyard (``--repeats``); medians printed.

2. **API calls per attempt**: those of each torchyard run above, from the ``POST`` until one
   pass after its owner and pods are gone, by phase; and **per pass** with no attempt open,
   with 1 and with ``--pending`` attempts open (1-node jobs pending in Kubernetes: other
   pods hold every GPU), then the cancel of those.

    python bench/bench_kubernetes.py                  # 3 rounds, 10 pending attempts
    python bench/bench_kubernetes.py --repeats 5 --keep /tmp/bench-k8s
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import uvicorn

# The tests' private Kubernetes control plane and stand-in kubelets: the repository root first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.config import kube_config

from service.api.app import create_app
from service.config import Settings
from service.engines.kubernetes import KubernetesDriver
from service.services.reconciler import Reconciler
from tests.conftest import free_port
from tests.support.engine_env import MODEL, write_launcher
from tests.support.factories import auth
from tests.support.kube_cluster import KubeCluster, kube_unavailable
from tests.support.netns import NetnsCluster, netns_unavailable
from tests.support.worker_fixtures import upload_digits, user_client

REPO = Path(__file__).resolve().parent.parent
PLAIN = REPO / "bench" / "plain_torchrun.py"
NAMESPACE = "bench"
GPUS_PER_NODE = 2
IMAGE = "torchyard-worker:bench"
GPU = "nvidia.com/gpu"
nan = float("nan")
# What the launcher logs (local time) at its steps: "launcher up" after its imports, its
# check-in answered once a pass bound the attempt's ranks, torchrun started.
LAUNCHER_LINES = (
    ("launcher up", "launcher for attempt"),
    ("checked in", " is node rank "),
    ("torchrun started", "torchrun started"),
)
# The driver's methods whose Kubernetes API calls are counted apart.
PHASES = ("start", "inventory", "submit", "poll", "cancel")


# --- instruments --------------------------------------------------------------------------


@dataclass
class Instruments:
    """The driver's API calls by (phase, operation), and a snapshot of them after every pass."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    # (end of the pass, its seconds, the calls so far)
    passes: list[tuple[float, float, Counter[tuple[str, str]]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> Counter[tuple[str, str]]:
        with self.lock:
            return Counter(self.calls)

    def attach(self, engine: Reconciler) -> None:
        driver = engine.driver
        assert isinstance(driver, KubernetesDriver)
        call, run_pass = driver._call, engine.run_pass

        def counted(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.calls[(_phase(), fn.__name__)] += 1
            return call(what, fn, *args, **kwargs)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return run_pass(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - started
                self.passes.append((time.time(), seconds, self.snapshot()))

        driver._call = counted  # type: ignore[method-assign]
        engine.run_pass = timed  # type: ignore[method-assign]

    def wait_passes(self, n: int, timeout: float = 60) -> int:
        """Until ``n`` more passes have ended; the index of the last one."""
        target = len(self.passes) + n
        deadline = time.monotonic() + timeout
        while len(self.passes) < target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {n} reconciler passes within {timeout} s")
            time.sleep(0.05)
        return target - 1


def _phase() -> str:
    """The driver method (of :data:`PHASES`) a call is made for: the nearest on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in PHASES and "kubernetes" in frame.f_code.co_filename:
            return frame.f_code.co_name
        frame = frame.f_back  # type: ignore[assignment]
    return "other"


class PodWatch:
    """When each pod of the namespace was first seen made, bound to a node, and running
    (this process's clock), from a watch."""

    def __init__(self, api: k8s.ApiClient) -> None:
        self.core = k8s.CoreV1Api(api)
        self.seen: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)

    def start(self) -> PodWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event in watch.Watch().stream(
                    self.core.list_namespaced_pod, NAMESPACE, timeout_seconds=5
                ):
                    self._record(event["object"])
                    if self._stop.is_set():
                        return
            except Exception:  # a cut watch: start another
                self._stop.wait(0.2)

    def _record(self, pod: Any) -> None:
        now = time.time()
        marks = self.seen.setdefault(pod.metadata.name, {})
        marks.setdefault("made", now)
        if pod.spec.node_name:
            marks.setdefault("bound", now)
        if pod.status and pod.status.phase == "Running":
            marks.setdefault("running", now)

    def milestones(self, prefix: str, count: int) -> dict[str, float]:
        """For the ``count`` pods named ``prefix…``: when the last one was made, bound, running."""
        pods = [m for name, m in self.seen.items() if name.startswith(prefix)]
        if len(pods) != count:
            return {}
        return {k: max(m.get(k, nan) for m in pods) for k in ("made", "bound", "running")}


# --- the API in this process --------------------------------------------------------------


@contextmanager
def serve(settings: Settings, host: str, port: int) -> Iterator[Any]:
    """The app (uvicorn in a thread of this process) until the block ends."""
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the API did not start")
        time.sleep(0.05)
    try:
        yield app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@dataclass
class Run:
    """One run: seconds to its first step, and to each milestone; its API calls (torchyard's)."""

    kind: str
    nodes: int
    first_step: float
    marks: dict[str, float]
    calls: Counter[tuple[str, str]]


@dataclass
class Bench:
    args: argparse.Namespace
    cluster: KubeCluster
    net: NetnsCluster
    user: httpx.Client
    digits: tuple[str, str]
    data: Path
    inst: Instruments
    pods: PodWatch
    wrap: list[str]
    threads: int
    core: Any = field(init=False)  # the admin's CoreV1Api (bodies given as dicts)

    def __post_init__(self) -> None:
        self.core = k8s.CoreV1Api(self.cluster.api_client())

    def wait(self, what: str, ready: Callable[[], bool], timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.args.timeout)
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not within {timeout or self.args.timeout} s")
            time.sleep(0.1)

    def engine_objects(self, selector: str) -> int:
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        owners = self.core.list_namespaced_service(NAMESPACE, label_selector=selector).items
        return len(pods) + len(owners)

    # --- torchyard ------------------------------------------------------------------------

    def job_body(self, nodes: int) -> dict[str, Any]:
        return {
            "name": "bench-kubernetes",
            "model": MODEL,
            "train_dataset": self.digits[0],
            "validation_dataset": self.digits[1],
            "parameters": {
                "epochs": self.args.epochs, "image_size": self.args.image_size,
                "batch_size": self.args.batch_size, "learning_rate": self.args.lr,
                "augmentation": "light", "print_frequency": 1, "random_seed": 3,
            },
            "resources": {"node_count": nodes, "process_count_per_node": 1, "max_restarts": 0},
        }  # fmt: skip

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.user.get(f"/v1/jobs/{job_id}")
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def torchyard_run(self, nodes: int) -> Run:
        """One job: the times from ``POST /v1/jobs``, and its API calls to its clean-up."""
        before = self.inst.snapshot()
        submitted = time.time()
        r = self.user.post("/v1/jobs", json=self.job_body(nodes))
        r.raise_for_status()
        job_id = r.json()["id"]
        self.wait(f"job {job_id}", lambda: self.job(job_id)["status"] in ("succeeded", "failed", "cancelled"))
        job = self.job(job_id)
        if job["status"] != "succeeded":
            raise RuntimeError(f"job {job_id} {job['status']}: {job.get('failure')}")
        r = self.user.get(f"/v1/jobs/{job_id}/metrics", params={"name": "train.loss", "limit": 10000})
        r.raise_for_status()
        first = min(
            datetime.fromisoformat(p["time"]).timestamp() for p in r.json()["items"] if p["step"] == 1
        )
        self.wait(f"job {job_id}'s pods gone", lambda: not self.engine_objects(f"torchyard.io/job={job_id}"))
        self.inst.wait_passes(1)
        calls = self.inst.snapshot() - before
        marks = self.pods.milestones(f"torchyard-{job_id}-1-", nodes)
        marks |= self.launcher_marks([f"torchyard-{job_id}-1-{rank}" for rank in range(nodes)])
        return Run("torchyard", nodes, first - submitted, {k: v - submitted for k, v in marks.items()}, calls)

    def launcher_marks(self, pods: list[str]) -> dict[str, float]:
        """From the launchers' logs, when the last one was up, checked in (its placement bound
        by a pass), and had started torchrun."""
        found: dict[str, list[float]] = {key: [] for key, _text in LAUNCHER_LINES}
        for name in pods:
            text = ""
            for kubelet in self.cluster.kubelets:
                try:
                    text = kubelet.read_log(NAMESPACE, name)
                except KeyError:
                    continue
            for key, needle in LAUNCHER_LINES:
                line = next((line for line in text.splitlines() if needle in line), None)
                if line is not None:
                    found[key].append(datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp())
        return {key: max(times) for key, times in found.items() if len(times) == len(pods)}

    # --- bare pods ------------------------------------------------------------------------

    def bare_pod(self, name: str, rank: int, nodes: int, port: int) -> dict[str, Any]:
        argv = [
            *self.wrap, sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--nproc-per-node", "1",
            "--node-rank", str(rank), "--master-addr", self.net.hosts[0].address, "--master-port", str(port),
            str(PLAIN), "--data", str(self.data), "--arch", MODEL["architecture"],
            "--epochs", str(self.args.epochs), "--batch-size", str(self.args.batch_size),
            "--image-size", str(self.args.image_size), "--lr", str(self.args.lr), "--workers", "1",
        ]  # fmt: skip
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"bench": "bare"}},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 0,
                "enableServiceLinks": False,
                "automountServiceAccountToken": False,
                "nodeSelector": {"kubernetes.io/hostname": f"k{rank + 1}"},
                "containers": [
                    {
                        "name": "train",
                        "image": IMAGE,
                        "command": argv[:1],
                        "args": argv[1:],
                        "env": [
                            {"name": "OMP_NUM_THREADS", "value": str(self.threads)},
                            {"name": "GLOO_SOCKET_IFNAME", "value": self.net.hosts[rank].ifname},
                        ],
                        "resources": {"requests": {GPU: "1"}, "limits": {GPU: "1"}},
                    }
                ],
            },
        }

    def bare_run(self, nodes: int, round_: int) -> Run:
        """One run of hand-made pods: the times from the first pod's creation."""
        prefix = f"bare-{round_}-{nodes}n-"
        names = [f"{prefix}{rank}" for rank in range(nodes)]
        bodies = [self.bare_pod(n, rank, nodes, 29400 + 10 * round_ + nodes) for rank, n in enumerate(names)]
        kubelet = self.cluster.kubelets[0]
        created = time.time()
        for body in bodies:
            self.core.create_namespaced_pod(NAMESPACE, body)
        first: float | None = None
        deadline = time.monotonic() + self.args.timeout
        try:
            while first is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{names[0]} printed no first step:\n{self._bare_log(names[0])[-3000:]}"
                    )
                for line in self._bare_log(names[0]).splitlines():
                    if line.startswith("first step done at"):
                        first = float(line.rsplit(" ", 1)[1])
                        break
                else:
                    phase = self.core.read_namespaced_pod(names[0], NAMESPACE).status.phase
                    if phase in ("Succeeded", "Failed"):
                        raise RuntimeError(
                            f"{names[0]} ended {phase}:\n{kubelet.read_log(NAMESPACE, names[0])}"
                        )
                    time.sleep(0.1)
        finally:
            for name in names:
                self.core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
            self.wait("the bare pods gone", lambda: not self.engine_objects("bench=bare"))
        marks = self.pods.milestones(prefix, nodes)
        return Run("bare", nodes, first - created, {k: v - created for k, v in marks.items()}, Counter())

    def _bare_log(self, name: str) -> str:
        try:
            return self.cluster.kubelets[0].read_log(NAMESPACE, name)
        except (KeyError, OSError):
            return ""

    # --- per pass -------------------------------------------------------------------------

    def per_pass(self, passes: int) -> tuple[Counter[tuple[str, str]], list[float], int]:
        """Over the next ``passes`` passes: the calls, each pass's seconds, the pass count."""
        start = self.inst.wait_passes(1)
        end = self.inst.wait_passes(passes)
        calls = self.inst.passes[end][2] - self.inst.passes[start][2]
        return calls, [p[1] for p in self.inst.passes[start + 1 : end + 1]], end - start

    def pending_passes(
        self, pending: int, passes: int
    ) -> list[tuple[str, Counter[tuple[str, str]], list[float], int]]:
        """Calls per pass with none, 1 and ``pending`` attempts open (pending in Kubernetes:
        pods of someone else hold every GPU), then the cancel of those attempts."""
        rows = [("no attempt", *self.per_pass(passes))]
        holders = [f"holder-k{i}" for i in (1, 2)]
        for i, name in enumerate(holders, start=1):
            self.core.create_namespaced_pod(NAMESPACE, _holder(name, f"k{i}"))
        self.wait("the GPUs held", lambda: _all_running(self.core, holders), timeout=60)
        jobs: list[str] = []
        try:
            for count in (1, pending):
                while len(jobs) < count:
                    r = self.user.post("/v1/jobs", json=self.job_body(1))
                    r.raise_for_status()
                    jobs.append(r.json()["id"])
                self.wait(
                    f"{count} attempts pending in Kubernetes",
                    lambda: all("unschedulable" in (self.job(j).get("reason") or "") for j in jobs),
                    timeout=120,
                )
                rows.append((f"{count} pending", *self.per_pass(passes)))
            before = self.inst.snapshot()
            for job_id in jobs:
                self.user.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()
            self.wait(
                "the pending attempts cancelled",
                lambda: (
                    not self.engine_objects("torchyard.io/job")
                    and all(self.job(j)["status"] == "cancelled" for j in jobs)
                ),
            )
            self.inst.wait_passes(1)
            rows.append((f"cancel of {len(jobs)}", self.inst.snapshot() - before, [], 0))
        finally:
            for job_id in jobs:
                self.user.post(f"/v1/jobs/{job_id}/cancel")
            for name in holders:
                self.core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
        return rows


def _holder(name: str, node: str) -> dict[str, Any]:
    """Someone else's pod holding every GPU of ``node``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench": "holder"}},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "sleep",
                    "image": "busybox",
                    "command": ["sleep", "600"],
                    "resources": {
                        "requests": {GPU: str(GPUS_PER_NODE)},
                        "limits": {GPU: str(GPUS_PER_NODE)},
                    },
                }
            ],
        },
    }


def _all_running(core: Any, names: list[str]) -> bool:
    return all(core.read_namespaced_pod(n, NAMESPACE).status.phase == "Running" for n in names)


# --- the report ---------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # not NaN
    return statistics.median(values) if values else nan


def report_times(runs: list[Run]) -> None:
    print(
        "\nSubmit → first step (median of the rounds; seconds from the POST, "
        "or from the bare pods' creation)\n"
    )
    columns = [(kind, nodes) for nodes in (1, 2) for kind in ("bare", "torchyard")]
    print("| | " + " | ".join(f"{n} node{'s' * (n > 1)}, {k}" for k, n in columns) + " |")
    print("| --- " * (len(columns) + 1) + "|")
    rows = (
        ("pods made", "made"), ("all bound to a node", "bound"), ("all running (process started)", "running"),
        ("launchers up", "launcher up"), ("launchers checked in", "checked in"),
        ("torchrun started", "torchrun started"),
    )  # fmt: skip
    for label, key in rows:
        cells = [_median([r.marks.get(key, nan) for r in runs if (r.kind, r.nodes) == c]) for c in columns]
        print(f"| {label} | " + " | ".join("" if v != v else f"{v:.2f}" for v in cells) + " |")
    firsts = {c: _median([r.first_step for r in runs if (r.kind, r.nodes) == c]) for c in columns}
    print("| **first step** | " + " | ".join(f"**{firsts[c]:.2f}**" for c in columns) + " |")

    # torchrun's start to the first step: the launcher's torchrun, or the bare pod's process.
    def from_start(r: Run) -> float:
        return r.first_step - r.marks.get("torchrun started", r.marks.get("running", nan))

    starts = [_median([from_start(r) for r in runs if (r.kind, r.nodes) == c]) for c in columns]
    print("| torchrun's start → first step | " + " | ".join(f"{v:.2f}" for v in starts) + " |")
    for nodes in (1, 2):
        bare, job = firsts[("bare", nodes)], firsts[("torchyard", nodes)]
        print(
            f"\n{nodes} node{'s' * (nodes > 1)}: torchyard adds {job - bare:+.2f} s ({job / bare:.2f}x)",
            end="",
        )
    print()


def report_calls(
    runs: list[Run], pending: list[tuple[str, Counter[tuple[str, str]], list[float], int]]
) -> None:
    jobs = [r for r in runs if r.kind == "torchyard"]
    print("\nKubernetes API calls per attempt, POST to clean-up (median of the rounds)\n")
    keys = sorted(
        {k for r in jobs for k in r.calls}, key=lambda k: (PHASES.index(k[0]) if k[0] in PHASES else 9, k[1])
    )
    print("| phase | call | 1 node | 2 nodes |")
    print("| --- | --- | --- | --- |")
    for key in keys:
        cells = [_median([float(r.calls[key]) for r in jobs if r.nodes == n]) for n in (1, 2)]
        print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{v:g}" for v in cells) + " |")
    for label, phases in (("submit + clean-up", ("submit", "cancel")), ("all", PHASES)):
        cells = [
            _median(
                [float(sum(v for k, v in r.calls.items() if k[0] in phases)) for r in jobs if r.nodes == n]
            )
            for n in (1, 2)
        ]
        print(f"| **{label}** | | " + " | ".join(f"**{v:g}**" for v in cells) + " |")
    polls = [
        _median([float(r.calls[("poll", "list_namespaced_service")]) for r in jobs if r.nodes == n])
        for n in (1, 2)
    ]
    print(
        f"\n(the attempt open for {polls[0]:g} and {polls[1]:g} poll passes; "
        "every pass also reads the inventory)"
    )

    print("\nCalls per reconciler pass, by attempts open\n")
    print(
        "| attempts open | passes | inventory calls/pass | poll calls/pass | other calls "
        "| pass time (median) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for label, calls, seconds, passes in pending:
        if not passes:
            continue
        inventory = sum(v for k, v in calls.items() if k[0] == "inventory")
        poll = sum(v for k, v in calls.items() if k[0] == "poll")
        other = {f"{k[0]}:{k[1]}": v for k, v in calls.items() if k[0] not in ("inventory", "poll")}
        print(f"| {label} | {passes} | {inventory / passes:g} | {poll / passes:g} | {other or '-'} "
              f"| {1000 * statistics.median(seconds):.0f} ms |")  # fmt: skip
    for label, calls, _seconds, passes in pending:
        if passes:
            continue
        count = int(label.split()[-1])
        fixed = {f"{k[0]}:{k[1]}": v for k, v in calls.items() if k[0] not in ("inventory", "poll")}
        print(f"\n{label} pending attempts: {sum(fixed.values())} calls besides the passes ({fixed}), "
              f"{sum(fixed.values()) / count:g} per attempt")  # fmt: skip


# --- main ---------------------------------------------------------------------------------


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    numbers: tuple[tuple[str, type, float, str], ...] = (
        ("epochs", int, 1, "of each job and bare run"),
        ("batch-size", int, 16, ""),
        ("image-size", int, 16, "pixels"),
        ("lr", float, 0.02, "learning rate"),
        ("per-class", int, 12, "digits per class (before the split)"),
        ("repeats", int, 3, "rounds of the four runs"),
        ("pending", int, 10, "attempts open in the per-pass measurement"),
        ("passes", int, 4, "passes measured for each count of attempts"),
        ("timeout", float, 180, "seconds a run may take"),
    )
    for name, kind, default, what in numbers:
        parser.add_argument(f"--{name}", type=kind, default=kind(default), help=what or None)
    parser.add_argument("--keep", type=Path, default=None, help="keep the API's and the cluster's files here")
    parser.add_argument(
        "--nsenter-only",
        action="store_true",
        help="run the pods' commands as the stand-in kubelet starts them (names then resolve slowly)",
    )
    return parser.parse_args()


@contextmanager
def bench_cluster(args: argparse.Namespace, root: Path) -> Iterator[Bench]:
    """The cluster, its two nodes, the API in this process with its driver instrumented, a
    user and the digits; all stopped at the end."""
    with NetnsCluster(2) as net:
        cluster = KubeCluster(root=root / "cluster").start()
        watcher: PodWatch | None = None
        try:
            cluster.create_namespace(NAMESPACE)
            for i, host in enumerate(net.hosts, start=1):
                cluster.add_node(f"k{i}", gpus=GPUS_PER_NODE, cpu="4", address=host.address, netns=host.netns)
            # What KUBECONFIG says to a fresh process (the client reads it once, at import).
            kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(cluster.admin_kubeconfig)
            url = f"http://{net.gateway}:{free_port(net.gateway)}"
            wrap = [] if args.nsenter_only else [str(write_in_host(root))]
            settings = Settings(
                data_dir=root / "data", engine="kubernetes", k8s_namespace=NAMESPACE, k8s_image=IMAGE,
                k8s_api_url=url, k8s_launcher=shlex.join([*wrap, str(write_launcher(root))]),
                k8s_work_dir=str(root / "nodes"), k8s_gang_timeout_s=600,
            )  # fmt: skip
            watcher = PodWatch(cluster.api_client()).start()
            with serve(settings, net.gateway, int(url.rsplit(":", 1)[1])) as app:
                inst = Instruments()
                inst.attach(app.state.engine)
                token = settings.admin_token_path.read_text().strip()
                with httpx.Client(base_url=url, headers=auth(token)) as admin:
                    user = user_client(admin, url)
                with user:
                    digits = upload_digits(
                        user, root / "digits", per_class=args.per_class, size=args.image_size
                    )
                    threads = len(os.sched_getaffinity(0))  # what a rank of the job gets (see the docstring)
                    bench = Bench(
                        args, cluster, net, user, digits, root / "digits", inst, watcher, wrap, threads
                    )
                    bench.wait(
                        "the engine's nodes", lambda: user.get("/v1/cluster").json()["ready_nodes"] == 2, 60
                    )
                    yield bench
        finally:
            if watcher is not None:
                watcher.stop()
            cluster.close()


def main() -> int:
    args = _arguments()
    why = kube_unavailable() or netns_unavailable()
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    runs: list[Run] = []
    tmp = tempfile.TemporaryDirectory(prefix="bench-kubernetes-", dir=os.environ.get("TMPDIR"))
    with tmp, bench_cluster(args, args.keep.resolve() if args.keep else Path(tmp.name)) as bench:
        for i in range(1, args.repeats + 1):
            for nodes in (1, 2):
                load = os.getloadavg()[0]
                bare = bench.bare_run(nodes, i)
                job = bench.torchyard_run(nodes)
                runs += [bare, job]
                print(
                    f"round {i}, {nodes} node(s): bare {bare.first_step:.2f} s, torchyard "
                    f"{job.first_step:.2f} s, {sum(job.calls.values())} calls; "
                    f"load {load:.2f} -> {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        pending = bench.pending_passes(args.pending, args.passes)
    print(
        f"\n{MODEL['architecture']} at {args.image_size} px, batch {args.batch_size}, "
        f"{args.epochs} epoch(s), {args.per_class} digits per class; "
        f"{bench.threads} threads and 1 loader worker per rank"
    )
    report_times(runs)
    report_calls(runs, pending)
    return 0


def write_in_host(root: Path) -> Path:
    """A wrapper that re-enters the pod's own network namespace with ``ip netns exec``, so
    that names resolve from that host's files (``/etc/netns/<namespace>/``) at once, as a
    cluster's DNS answers a pod. Under the stand-in kubelet's ``nsenter --net`` alone a pod
    keeps this machine's resolver, whose server it cannot reach: each reverse lookup of a
    peer (c10d's, torchrun's and the rank's) waits 10 s for it."""
    path = root / "in-host.sh"
    path.write_text(
        "#!/bin/sh\n"
        # This checkout's packages, whatever checkout the environment's editable install names.
        f"export PYTHONPATH={shlex.quote(str(REPO))}\n"
        'ns=$(ip netns identify) && [ -n "$ns" ] && exec ip netns exec "$ns" "$@"\n'
        'exec "$@"\n'
    )
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    sys.exit(main())
