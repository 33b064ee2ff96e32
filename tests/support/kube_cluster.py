"""A private, real Kubernetes 1.20 control plane for the tests: etcd, kube-apiserver,
kube-scheduler and kube-controller-manager, built from Debian's source by
``.ci/kubernetes.sh`` (docs/kubernetes-testing.md). Nodes are stand-in kubelets
(:mod:`tests.support.fake_kubelet`) added with :meth:`KubeCluster.add_node`.

Everything listens on ``127.0.0.1`` (free ports), with certificates made here: a cluster CA
signs the API server's serving certificate and a client certificate per user. RBAC is on
(``--authorization-mode=Node,RBAC``):

* :attr:`KubeCluster.admin_kubeconfig` — ``admin`` in ``system:masters`` (the tests' own view);
* :attr:`KubeCluster.engine_kubeconfig` — ``torchyard-engine``, a user with no rights until a
  test binds a Role to it (to check an engine's least-privilege RBAC);
* :meth:`KubeCluster.kubeconfig_for` — any other user and groups.

The scheduler and the controller-manager run with their own identities
(``system:kube-scheduler``, ``system:kube-controller-manager`` with per-controller service
accounts), as in a kubeadm cluster; the garbage collector, the Job and ReplicaSet controllers,
the node-lifecycle controller and the service-account token controller are live. etcd keeps
its data on tmpfs (``/dev/shm``) where there is one.

Every process is started here, in a session of its own, and stopped by its pid at
:meth:`KubeCluster.close` (stand-in kubelets first), which never raises. ``TORCHYARD_KUBE_BIN``
names the binaries' folder; without it a complete build in the cache
(``.ci/kubernetes.sh --cached-only``) is used. Where there is none the tests skip, unless
``TORCHYARD_REQUIRE_KUBERNETES=1`` (CI), where that is a failure.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import free_ports, log_tails

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

    from tests.support.fake_kubelet import FakeKubelet

REQUIRE_ENV = "TORCHYARD_REQUIRE_KUBERNETES"
BIN_ENV = "TORCHYARD_KUBE_BIN"
BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "kubernetes.sh"
VERSION = "v1.20.2"
SERVICE_CIDR = "10.0.0.0/24"
ENGINE_USER = "torchyard-engine"
# How long the node-lifecycle controller waits for a node's heartbeat (its Lease) before it
# marks the node's Ready condition Unknown and taints it unreachable (the default, 40 s).
NODE_MONITOR_GRACE_S = 40
# How long pods tolerate that taint (NoExecute) before the controller deletes them, unless
# they say otherwise: the DefaultTolerationSeconds admission plugin's default, 300 s.
UNREACHABLE_TOLERATION_S = 300


# --- where the binaries are ---------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def kube_bin_dir() -> Path | str:
    """The folder holding the four binaries, or why there is none."""
    configured = os.environ.get(BIN_ENV)
    if configured:
        path = Path(configured)
        missing = [b for b in BINARIES if not os.access(path / b, os.X_OK)]
        if missing:
            return f"{BIN_ENV}={configured} lacks {', '.join(missing)}"
        return path
    if not BUILD_SCRIPT.exists():
        return f"{BUILD_SCRIPT} is missing"
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--cached-only"], capture_output=True, text=True, timeout=60
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return (
            f"no Kubernetes control plane is built ({BIN_ENV} is unset and the cache has none; "
            "run .ci/kubernetes.sh, 5 to 15 minutes, then set "
            f"{BIN_ENV} to the folder it prints)"
        )
    return Path(lines[-1])


@functools.lru_cache(maxsize=1)
def kube_unavailable() -> str | None:
    """Why a private Kubernetes control plane cannot be brought up here, or None if it can."""
    found = kube_bin_dir()
    if isinstance(found, str):
        return found
    try:
        import kubernetes  # noqa: F401
        from cryptography import x509  # noqa: F401
    except ImportError as exc:
        return f"the Python package {exc.name} is not installed (pip install kubernetes cryptography)"
    return None


def require_kubernetes() -> None:
    """Skip where the control plane cannot run; fail instead when ``TORCHYARD_REQUIRE_KUBERNETES=1`` (CI)."""
    reason = kube_unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires the Kubernetes tests to run")
    pytest.skip(
        f"{reason}; the Kubernetes tests need a private control plane ({REQUIRE_ENV}=1 makes this fail)"
    )


# --- certificates -------------------------------------------------------------------------


@dataclass
class CertificateAuthority:
    """A self-signed CA (EC P-256) that issues the cluster's serving and client certificates."""

    key: Any
    cert: Any

    @classmethod
    def create(cls, name: str = "torchyard-test-ca") -> CertificateAuthority:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key=key, cert=cert)

    def issue(
        self,
        common_name: str,
        *,
        organizations: Sequence[str] = (),
        dns: Sequence[str] = (),
        ips: Sequence[str] = (),
        server: bool = False,
    ) -> tuple[bytes, bytes]:
        """A new key and certificate signed by this CA, both PEM: (cert, key)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    @property
    def cert_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.key)


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )


# --- the cluster --------------------------------------------------------------------------


@dataclass
class KubeCluster:
    """etcd and the three control-plane binaries of ``bin_dir``, their files under ``root``."""

    root: Path
    bin_dir: Path | None = None
    node_monitor_grace_s: int = NODE_MONITOR_GRACE_S
    unreachable_toleration_s: int = UNREACHABLE_TOLERATION_S
    kubelets: list[FakeKubelet] = field(default_factory=list)
    server: str = ""
    ca: CertificateAuthority | None = None
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _etcd_dir: Path | None = None
    _clients: list[ApiClient] = field(default_factory=list)

    # --- what tests use ------------------------------------------------------------------

    @property
    def admin_kubeconfig(self) -> Path:
        """``admin`` in ``system:masters``: every right."""
        return self.root / "admin.kubeconfig"

    @property
    def engine_kubeconfig(self) -> Path:
        """``torchyard-engine``: authenticated, no rights until a test binds a Role to it."""
        return self.root / f"{ENGINE_USER}.kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.root / "ca.crt"

    def kubeconfig_for(self, user: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig for ``user`` (a client certificate; ``groups`` as its organizations)."""
        assert self.ca is not None, "the cluster is not started"
        cert, key = self.ca.issue(user, organizations=groups)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
        (self.root / f"{safe}.crt").write_bytes(cert)
        key_path = self.root / f"{safe}.key"
        key_path.write_bytes(key)
        key_path.chmod(0o600)
        path = self.root / f"{safe}.kubeconfig"
        _write_kubeconfig(path, self.server, self.ca_file, self.root / f"{safe}.crt", key_path, user)
        return path

    def api_client(self, kubeconfig: Path | None = None) -> ApiClient:
        """A ``kubernetes`` client for ``kubeconfig`` (the admin's by default), closed with the cluster."""
        from kubernetes import config

        client = config.new_client_from_config(config_file=str(kubeconfig or self.admin_kubeconfig))
        self._clients.append(client)
        return client

    def create_namespace(self, name: str, timeout: float = 30.0) -> None:
        """Create a namespace and wait until pods can be created in it: the ServiceAccount
        admission plugin refuses pods until the namespace's ``default`` service account and
        its token exist (a second or so after the namespace, made by the controller-manager)."""
        body = json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}).encode()
        req = urllib.request.Request(
            self.server + "/api/v1/namespaces",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10, context=self._ssl_context()):
            pass
        self._wait_for(lambda: self._account_ready(name), f"the service account of namespace {name}", timeout)

    def add_node(self, name: str, **kwargs: Any) -> FakeKubelet:
        """Start a stand-in kubelet that registers node ``name`` (see :class:`FakeKubelet`)."""
        from tests.support.fake_kubelet import FakeKubelet

        kubelet = FakeKubelet(self, name, **kwargs)
        self.kubelets.append(kubelet)
        kubelet.start()
        return kubelet

    def remove_node(self, name: str, *, delete_node: bool = True) -> None:
        """Stop node ``name``'s kubelet (its processes killed) and delete the Node object."""
        kubelet = next(k for k in self.kubelets if k.name == name)
        kubelet.close(delete_node=delete_node)
        self.kubelets.remove(kubelet)

    def logs(self, tail: int = 3000) -> str:
        return log_tails(self.root, tail)

    # --- bring-up ------------------------------------------------------------------------

    def start(self) -> KubeCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        if self.bin_dir is None:
            found = kube_bin_dir()
            if isinstance(found, str):
                raise RuntimeError(found)
            self.bin_dir = found
        self.root.mkdir(parents=True, exist_ok=True)
        etcd_client, etcd_peer, api_port, sched_port, cm_port = free_ports(5)
        self.server = f"https://127.0.0.1:{api_port}"
        self._write_certificates()

        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.root
        self._etcd_dir = Path(tempfile.mkdtemp(prefix="torchyard-etcd-", dir=base))
        self._spawn(
            "etcd",
            "--name=etcd0",
            f"--data-dir={self._etcd_dir}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=etcd0=http://127.0.0.1:{etcd_peer}",
            "--logger=zap",
            "--log-level=warn",
            f"--quota-backend-bytes={1 << 30}",
        )
        self._wait_for(
            lambda: self._http_ok(f"http://127.0.0.1:{etcd_client}/health", "etcd"), "etcd", timeout=30
        )

        r = self.root
        self._spawn(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{etcd_client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}",
            "--insecure-port=0",
            f"--cert-dir={r / 'apiserver-certs'}",
            f"--tls-cert-file={r / 'apiserver.crt'}",
            f"--tls-private-key-file={r / 'apiserver.key'}",
            f"--client-ca-file={self.ca_file}",
            f"--kubelet-client-certificate={r / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={r / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--service-account-key-file={r / 'sa.pub'}",
            f"--service-account-signing-key-file={r / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # The "kubernetes" Service's endpoint would be 127.0.0.1, which Endpoints refuse.
            "--endpoint-reconciler-type=none",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            "--profiling=false",
            "--enable-priority-and-fairness=false",
            f"--default-unreachable-toleration-seconds={self.unreachable_toleration_s}",
            f"--default-not-ready-toleration-seconds={self.unreachable_toleration_s}",
            "--event-ttl=1h",
            "--v=1",
        )
        self._wait_for(self._apiserver_ready, "kube-apiserver", timeout=60)

        self._spawn(
            "kube-scheduler",
            f"--kubeconfig={r / 'scheduler.kubeconfig'}",
            "--bind-address=127.0.0.1",
            f"--secure-port={sched_port}",
            f"--cert-dir={r / 'scheduler-certs'}",
            "--port=0",
            "--leader-elect=false",
            "--profiling=false",
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            "--v=1",
        )
        self._spawn(
            "kube-controller-manager",
            f"--kubeconfig={r / 'controller-manager.kubeconfig'}",
            "--bind-address=127.0.0.1",
            f"--secure-port={cm_port}",
            f"--cert-dir={r / 'controller-manager-certs'}",
            "--port=0",
            "--leader-elect=false",
            "--profiling=false",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={r / 'sa.key'}",
            f"--root-ca-file={self.ca_file}",
            f"--cluster-signing-cert-file={self.ca_file}",
            f"--cluster-signing-key-file={r / 'ca.key'}",
            f"--node-monitor-grace-period={self.node_monitor_grace_s}s",
            "--node-monitor-period=2s",
            "--concurrent-gc-syncs=5",
            # Its controllers start one after another, each making its service account: with
            # the default client rate limit (20/s) the last ones start seconds later.
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            "--v=1",
        )
        self._wait_for(
            lambda: self._http_ok(f"https://127.0.0.1:{sched_port}/healthz", "kube-scheduler"),
            "kube-scheduler",
        )
        self._wait_for(
            lambda: self._http_ok(f"https://127.0.0.1:{cm_port}/healthz", "kube-controller-manager"),
            "kube-controller-manager",
        )
        # Pods are admitted only once their namespace's service account has a token.
        self._wait_for(self._account_ready, "the default service account's token", timeout=60)

    def _write_certificates(self) -> None:
        r = self.root
        self.ca = ca = CertificateAuthority.create()
        self.ca_file.write_bytes(ca.cert_pem)
        _write_secret(r / "ca.key", ca.key_pem)
        service_ip = str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))
        cert, key = ca.issue(
            "kube-apiserver",
            dns=[
                "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            ips=["127.0.0.1", service_ip],
            server=True,
        )  # fmt: skip
        (r / "apiserver.crt").write_bytes(cert)
        _write_secret(r / "apiserver.key", key)
        cert, key = ca.issue("kube-apiserver-kubelet-client", organizations=["system:masters"])
        (r / "apiserver-kubelet-client.crt").write_bytes(cert)
        _write_secret(r / "apiserver-kubelet-client.key", key)

        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        sa = ec.generate_private_key(ec.SECP256R1())
        _write_secret(r / "sa.key", _key_pem(sa))
        (r / "sa.pub").write_bytes(
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        for user, groups, name in (
            ("admin", ["system:masters"], "admin"),
            (ENGINE_USER, [], ENGINE_USER),
            ("system:kube-scheduler", [], "scheduler"),
            ("system:kube-controller-manager", [], "controller-manager"),
        ):
            cert, key = ca.issue(user, organizations=groups)
            (r / f"{name}.crt").write_bytes(cert)
            _write_secret(r / f"{name}.key", key)
            _write_kubeconfig(
                r / f"{name}.kubeconfig",
                self.server,
                self.ca_file,
                r / f"{name}.crt",
                r / f"{name}.key",
                user,
            )

    def _spawn(self, name: str, *args: str) -> None:
        assert self.bin_dir is not None
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        try:
            self._procs[name] = subprocess.Popen(
                [str(self.bin_dir / name), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.root,
            )
        finally:
            log.close()

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(self.root / "admin.crt", self.root / "admin.key")
        return ctx

    def _check_alive(self, name: str) -> None:
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.logs()}")

    def _http_ok(self, url: str, name: str) -> bool:
        self._check_alive(name)
        ctx = None
        if url.startswith("https:"):
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _get_json(self, path: str) -> Any:
        req = urllib.request.Request(self.server + path)
        with urllib.request.urlopen(req, timeout=5, context=self._ssl_context()) as resp:
            return json.load(resp)

    def _apiserver_ready(self) -> bool:
        self._check_alive("etcd")
        self._check_alive("kube-apiserver")
        try:
            req = urllib.request.Request(self.server + "/readyz")
            with urllib.request.urlopen(req, timeout=2, context=self._ssl_context()) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _account_ready(self, namespace: str = "default") -> bool:
        for name in ("kube-apiserver", "kube-controller-manager"):
            self._check_alive(name)
        try:
            account = self._get_json(f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
        except (OSError, urllib.error.URLError):
            return False
        return bool(account.get("secrets"))

    def _wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up within {timeout:.0f} s:\n{self.logs()}")
            time.sleep(0.1)

    # --- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the kubelets (their processes killed), then the control plane. Never raises."""
        for kubelet in list(self.kubelets):
            with contextlib.suppress(Exception):
                kubelet.close(delete_node=False)
        self.kubelets.clear()
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        self._clients.clear()
        for name in ("kube-controller-manager", "kube-scheduler", "kube-apiserver", "etcd"):
            _stop(self._procs.pop(name, None))
        if self._etcd_dir is not None:
            shutil.rmtree(self._etcd_dir, ignore_errors=True)
            self._etcd_dir = None


def _write_secret(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def _write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> None:
    """A kubeconfig (JSON, which is YAML) with one cluster, user and context."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "torchyard-test", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "torchyard-test", "context": {"cluster": "torchyard-test", "user": user}}],
        "current-context": "torchyard-test",
    }
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)


@contextlib.contextmanager
def kube_cluster(root: Path, **kwargs: Any) -> Iterator[KubeCluster]:
    """A running :class:`KubeCluster`, stopped on exit."""
    cluster = KubeCluster(root=root, **kwargs).start()
    try:
        yield cluster
    finally:
        cluster.close()
