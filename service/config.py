"""Service settings: one pydantic-settings class, prefix ``TORCHYARD_``, validated at start."""

from __future__ import annotations

import base64
import ipaddress
import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# The database password that docker-compose.yml and .env.example ship with: published,
# so refused outside a local try-out.
EXAMPLE_DATABASE_PASSWORD = "torchyard"
LOCAL_ENVS = ("local", "development")


# The settings an engine cannot run without, and what each is.
_ENGINE_NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    "slurm": (("slurm_api_url", "the API's address as compute nodes reach it"),),
    "kubernetes": (
        ("k8s_image", "the worker image"),
        ("k8s_api_url", "the API's address as pods reach it"),
    ),
}


class Settings(BaseSettings):
    """Every knob of the API service. Each field is read from ``TORCHYARD_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="TORCHYARD_", extra="ignore")

    env: Literal["local", "development", "production"] = Field(
        default="production",
        description="Where the service runs. Outside `local` and `development`, a database URL "
        "with the example password of docker-compose.yml and .env.example is refused.",
    )
    data_dir: Path = Field(
        default=Path("./torchyard-data"),
        description="Artifact store: SQLite file, datasets, logs, model directories, admin token.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL; unset means a SQLite file inside data_dir. "
        "PostgreSQL: postgresql+psycopg://user@host:5432/db",
    )
    host: str = Field(default="127.0.0.1", description="Address `torchyard serve` listens on.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port `torchyard serve` listens on.")
    metrics_token: str | None = Field(
        default=None,
        repr=False,
        min_length=16,
        description="The scrape token of `GET /metrics` (docs/operations.md): when set, a scrape must send "
        "`Authorization: Bearer <it>` (at least 16 characters), from any address; unset: only the "
        "addresses of TORCHYARD_METRICS_ALLOW may scrape, without a token.",
    )
    metrics_allow: str = Field(
        default="127.0.0.0/8,::1/128",
        description="The networks (CIDR, comma-separated) that may scrape `GET /metrics` without a token "
        "while TORCHYARD_METRICS_TOKEN is unset; loopback only by default.",
    )
    trusted_proxies: str = Field(
        default="127.0.0.1/32,::1/128",
        description="The reverse proxies (CIDR, comma-separated) whose `X-Forwarded-For` and "
        "`X-Forwarded-Proto` are believed: a request from one of them is taken to come from the "
        "address it forwards (the audit trail's source, /metrics' allowed networks). Loopback only by "
        "default; empty: none (the TCP peer is the client).",
    )
    max_upload_bytes: int = Field(
        default=2 * 1024**3, gt=0, description="Largest dataset archive accepted by POST /v1/datasets."
    )
    max_extracted_bytes: int = Field(
        default=8 * 1024**3, gt=0, description="Largest total size an archive may expand to."
    )
    max_extracted_files: int = Field(default=1_000_000, gt=0, description="Most files an archive may hold.")
    max_compression_ratio: float = Field(
        default=100.0,
        ge=1,
        description="An uploaded archive may expand to at most this many times its own size "
        "(16 MiB is always allowed); more is refused as a likely zip bomb, from the sizes the "
        "archive declares before they are written.",
    )
    max_code_upload_bytes: int = Field(
        default=256 * 1024**2,
        gt=0,
        description="Largest code archive accepted by POST /v1/code (and most it may expand to: 4x).",
    )
    max_weights_upload_bytes: int = Field(
        default=4 * 1024**3,
        gt=0,
        description="Largest state dict accepted by POST /v1/weights (docs/fine-tuning.md).",
    )
    max_code_files: int = Field(default=50_000, gt=0, description="Most files a code archive may hold.")
    max_outputs_bytes: int = Field(
        default=4 * 1024**3,
        gt=0,
        description="Largest outputs archive a script job may upload (as sent; once unpacked it may "
        "hold at most 8 GiB in 100,000 entries, the contract's MAX_OUTPUTS_UNCOMPRESSED_BYTES and "
        "MAX_OUTPUTS_FILES).",
    )
    max_metric_points_per_job: int = Field(
        default=500_000,
        gt=0,
        description="Metric points one job may store (all attempts); the points of its reports past "
        "it are dropped (the rest of each report is kept), said once in the job's `service` log "
        "stream and counted in the job's `metrics_dropped`.",
    )
    max_metric_names_per_job: int = Field(
        default=200,
        gt=0,
        description="Distinct metric names one job may store; points of further names are dropped as "
        "past TORCHYARD_MAX_METRIC_POINTS_PER_JOB.",
    )
    max_concurrent_uploads_per_user: int = Field(
        default=2,
        ge=1,
        description="Dataset uploads (receiving, extracting, validating) one user may have in "
        "progress at once, over all API replicas; more are refused with 409.",
    )
    staging_sweep_interval_s: float = Field(
        default=300.0,
        gt=0,
        description="How often each API replica removes what interrupted uploads left in the "
        "staging folder (it also does at start); folders of uploads in progress are kept.",
    )
    max_image_pixels: int = Field(
        default=50_000_000, gt=0, description="Largest image (width × height) decoded during validation."
    )
    # NoDecode: pydantic-settings would otherwise parse the variable as JSON before the
    # validator below sees it, and fail on a plain path or a comma-separated list.
    dataset_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Shared-storage folders under which datasets may be registered by path: "
        "one path, a comma-separated list, or a JSON list.",
    )
    max_nodes: int | None = Field(
        default=None,
        ge=1,
        description="Cluster's maximum node count; unset means the number of registered nodes not lost.",
    )
    retention_s: float | None = Field(
        default=None,
        gt=0,
        description="Finished jobs are deleted (their metrics, logs, checkpoints, model directory and "
        "outputs, as DELETE /v1/jobs/{id} does) this many seconds after they finished; unset keeps "
        "them until deleted. A job whose model is a registered model version is kept.",
    )
    engine: Literal["agents", "slurm", "kubernetes"] = Field(
        default="agents",
        description="What runs the jobs: agents (torchyard's own worker agents, the default), "
        "slurm (an existing Slurm cluster: one sbatch per attempt) or kubernetes (one pod per node "
        "rank of each attempt, docs/kubernetes.md).",
    )
    k8s_namespace: str = Field(
        default="default",
        min_length=1,
        description="Kubernetes engine: the namespace the attempts' pods run in (the engine's role "
        "needs pods, services and events there, and read access to nodes).",
    )
    k8s_image: str | None = Field(
        default=None,
        description="Kubernetes engine: the worker image the pods run (required with engine=kubernetes).",
    )
    k8s_api_url: str | None = Field(
        default=None,
        description="Kubernetes engine: the API's address as pods reach it (required with engine=kubernetes).",
    )
    k8s_launcher: str = Field(
        default="torchyard launch",
        description="Kubernetes engine: the command that starts torchyard's one-placement launcher in a pod.",
    )
    k8s_work_dir: str = Field(
        default="",
        description="Kubernetes engine: the launcher's datasets cache and run folder in the pod "
        "(default: $TMPDIR/torchyard-launch-<uid>).",
    )
    k8s_node_selector: str = Field(
        default="",
        description="Kubernetes engine: the pods' node selector, as key=value pairs separated by commas or "
        "a JSON object; only nodes it selects make the cluster.",
    )
    k8s_tolerations: str = Field(
        default="",
        description="Kubernetes engine: the pods' tolerations, a JSON list of Kubernetes toleration objects.",
    )
    k8s_priority_class: str = Field(
        default="", description="Kubernetes engine: the pods' priorityClassName (none by default)."
    )
    k8s_pod_patch: str = Field(
        default="",
        description="Kubernetes engine: a JSON object merged into every pod's spec (volumes, a service "
        "account, security context...); the container is spec.containers[0], named launcher.",
    )
    k8s_queue: str = Field(
        default="",
        description="Kubernetes engine: a Kueue LocalQueue name: the pods are labelled for it and form one "
        "pod group, so that Kueue admits each attempt whole.",
    )
    k8s_poll_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="Kubernetes engine: how often the nodes and the attempts' pods are read, by one API "
        "replica at a time.",
    )
    k8s_gang_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Kubernetes engine: an attempt whose pods are not all bound to nodes this long after "
        "they were created is deleted whole, and its job waits in the queue with Kubernetes' reason.",
    )
    slurm_partitions: str = Field(
        default="",
        description="Slurm engine: the partitions jobs go to and whose nodes make the cluster, comma-separated "
        "(default: the cluster's default partition).",
    )
    slurm_api_url: str | None = Field(
        default=None,
        description="Slurm engine: the API's address as compute nodes reach it (required with engine=slurm).",
    )
    slurm_launcher: str = Field(
        default="torchyard launch",
        description="Slurm engine: the command that starts torchyard's one-placement launcher on a compute node "
        "(a path in a shared virtual environment, say).",
    )
    slurm_sbatch_args: str = Field(
        default="",
        description="Slurm engine: extra sbatch options for every job (account, qos, constraint, time), "
        "split as a shell would.",
    )
    slurm_poll_s: float = Field(
        default=3.0,
        gt=0,
        le=60,
        description="Slurm engine: how often the inventory (sinfo) and the jobs (squeue) are read, by one "
        "API replica at a time.",
    )
    slurm_output_dir: Path | None = Field(
        default=None,
        description="Slurm engine: where sbatch writes each job's output (on storage the node running the "
        "batch script shares with the API; default <data dir>/slurm). Its tail explains an EngineError.",
    )
    slurm_work_dir: str = Field(
        default="",
        description="Slurm engine: the launcher's datasets cache and run folder on each compute node "
        "(default: $TMPDIR/torchyard-launch-<uid> there).",
    )
    preempt_grace_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds preempted ranks have to checkpoint (also read by agents and launchers); with "
        "the Slurm engine, sbatch --signal=USR1@<this> asks for it before the time limit.",
    )
    heartbeat_interval_s: float = Field(
        default=2.0,
        gt=0,
        description="How often workers heartbeat. Unless this or TORCHYARD_LEASE_TIMEOUT_S is set, it is "
        "the shortest interval: with more nodes than TORCHYARD_HEARTBEATS_PER_S x this, the interval handed "
        "to the nodes grows so that they send about that many heartbeats a second together (at most 30 s).",
    )
    lease_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="A node or attempt not heard from for this long is lost. Unless this or "
        "TORCHYARD_HEARTBEAT_INTERVAL_S is set, at least 4 heartbeat intervals as the interval grows.",
    )
    heartbeats_per_s: float = Field(
        default=100.0,
        gt=0,
        description="Heartbeats a second that all nodes together aim to send when neither "
        "TORCHYARD_HEARTBEAT_INTERVAL_S nor TORCHYARD_LEASE_TIMEOUT_S is set: 1,000 nodes heartbeat "
        "every 10 s (lease 40 s), up to 200 nodes every 2 s (lease 15 s).",
    )
    claim_poll_timeout_s: float = Field(
        default=20.0,
        gt=0,
        description="Longest a worker's claim long-poll is held open. Unless set, it grows with the "
        "heartbeat interval handed out (5 intervals, at most 55 s): 1,000 nodes hold their claims for 50 s, "
        "so that a large cluster's idle claims do not cost more than its heartbeats.",
    )
    claim_recheck_interval_s: float = Field(
        default=0.25,
        gt=0,
        le=5,
        description="While a claim long-poll waits and the replica's PostgreSQL notifications are "
        "interrupted (the database restarting), how often it re-reads its node's placements; otherwise "
        "a pass placing work on the node, on any replica, wakes it at once.",
    )
    reaper_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="How often each API replica looks for expired leases, silent nodes and "
        "finished cancellations, and asks for a scheduling pass when jobs are queued.",
    )
    node_memory_s: float = Field(
        default=600.0,
        ge=0,
        description="A submission is checked against the nodes heard from within this many seconds, "
        "not only the nodes ready now: a job made while every worker restarts (an agent upgrade) "
        "is accepted and waits. Only a job larger than every node seen in this window is a 422.",
    )
    replica_memory_s: float = Field(
        default=600.0,
        ge=0,
        description="PostgreSQL with several API replicas: an API replica that stopped being seen (killed, "
        "stopped, cut off from the database) keeps the reaper of every other replica from declaring nodes "
        "lost (the nodes that talked to it cannot be heard) until a replica starts again, for at most this "
        "many seconds. 0: a vanished replica is ignored.",
    )
    database_connect_timeout_s: float = Field(
        default=3.0,
        gt=0,
        le=60,
        description="PostgreSQL: longest wait for a new connection before the request gets 503.",
    )
    database_statement_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="PostgreSQL: longest one SQL statement may run (0: no limit).",
    )
    database_pool_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=120,
        description="PostgreSQL: longest a request waits for a free pooled connection before 503.",
    )
    database_wait_s: float = Field(
        default=300.0,
        ge=0,
        description="At start, how long `torchyard serve` waits for an unreachable database "
        "(retrying with backoff) before it gives up.",
    )
    retry_after_s: int = Field(
        default=2,
        ge=1,
        le=3600,
        description="The Retry-After of a 503 ServiceUnavailableError (database unreachable).",
    )
    master_port_min: int = Field(
        default=29500,
        ge=1024,
        le=65535,
        description="Lowest port handed to an attempt for its torch.distributed rendezvous "
        "(opened on the node of node rank 0).",
    )
    master_port_max: int = Field(
        default=29999,
        ge=1024,
        le=65535,
        description="Highest rendezvous port; the range bounds how many attempts may share one node address.",
    )
    predict_max_files: int = Field(default=64, gt=0, description="Most images one predict request may hold.")
    predict_max_bytes: int = Field(
        default=32 * 1024**2, gt=0, description="Largest predict request body (all its images together)."
    )
    predict_max_image_pixels: int = Field(
        default=4096 * 4096, gt=0, description="Largest image (width × height) a predict request may send."
    )
    predict_max_total_pixels: int = Field(
        default=16 * 4096 * 4096,
        gt=0,
        description="Most pixels (width × height, all its images together) one predict request may send.",
    )
    model_cache_models: int = Field(
        default=4,
        gt=0,
        description="Loaded models each scoring process keeps (least recently used go first).",
    )
    model_cache_bytes: int = Field(
        default=1024**3, gt=0, description="Bytes of ONNX files each scoring process keeps loaded."
    )
    predict_workers: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Scoring processes: models are scored in them, never in the API process.",
    )
    predict_worker_memory_bytes: int = Field(
        default=4 * 1024**3,
        ge=256 * 1024**2,
        description="Address space of each scoring process: a model that needs more fails there.",
    )
    predict_cpu_s: float = Field(
        default=60.0, gt=0, description="CPU seconds one predict request may use in its scoring process."
    )
    predict_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Longest a predict request is scored; past it, or once the client has gone, its "
        "scoring process is killed and replaced.",
    )
    model_max_bytes: int = Field(
        default=4 * 1024**3,
        gt=0,
        description="Largest model directory archive a worker may upload (or a script job's "
        "outputs folder registered as a model).",
    )
    checkpoint_max_bytes: int = Field(
        default=8 * 1024**3, gt=0, description="Largest training-state checkpoint a worker may upload."
    )
    reclaim_min_run_s: float = Field(
        default=300.0,
        ge=0,
        description="A borrowed job that has run less than this is not preempted to give a team its quota "
        "back (it would lose its work; docs/teams.md).",
    )
    storage_url: str | None = Field(
        default=None,
        description="Where artifacts live: unset = files under TORCHYARD_DATA_DIR; s3://bucket/prefix = an "
        "S3 bucket, with the endpoint, region and credentials of the standard AWS settings "
        "(AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID...). Clients then move the bytes with "
        "presigned URLs (docs/storage.md).",
    )
    storage_url_ttl_s: int = Field(
        default=900,
        ge=60,
        le=7 * 24 * 3600,
        description="How long a presigned URL is valid (S3 storage); a longer transfer asks for fresh ones.",
    )
    storage_upload_expiry_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="An unfinished direct upload older than this is dropped, its parts removed (S3 storage).",
    )
    webhook_key: SecretStr | None = Field(
        default=None,
        description="The Fernet key (32 url-safe base64 bytes) that encrypts webhook secrets in the database "
        "(docs/webhooks.md); unset: a key kept in webhook.key in the data directory, made at first use. "
        "API replicas that share no data directory must all be given the same key.",
    )
    webhook_retry_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="How long a webhook delivery is retried (its receiver down or answering other than "
        "2xx) before it is given up as failed.",
    )
    webhook_backoff_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="The wait before a failed webhook delivery's first retry; it doubles with each try, "
        "up to an hour.",
    )
    webhook_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=120,
        description="Longest a webhook receiver may take to answer a delivery (then the try failed).",
    )
    webhook_poll_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="How often each API replica looks for webhook deliveries due.",
    )

    public_url: str | None = Field(
        default=None,
        description="The URL users reach the API and web UI at (https://torchyard.example.org): the OpenID "
        "Connect redirect URI is `<it>/auth/oidc/callback`; the sign-in cookie is Secure when it is https.",
    )
    oidc_issuer: str | None = Field(
        default=None,
        description="The OpenID provider's issuer URL (docs/oidc.md); set, users sign in with the provider "
        "(its discovery document at `<issuer>/.well-known/openid-configuration`) and its access tokens "
        "are taken as bearer tokens. Needs TORCHYARD_OIDC_CLIENT_ID and TORCHYARD_PUBLIC_URL.",
    )
    oidc_client_id: str | None = Field(default=None, description="This service's client id at the provider.")
    oidc_client_secret: SecretStr | None = Field(
        default=None,
        description="This service's client secret at the provider (a confidential web client); unset: a "
        "public client (PKCE alone).",
    )
    oidc_cli_client_id: str | None = Field(
        default=None,
        description="The client id `torchyard login` uses for the device authorization grant (a public "
        "client at the provider); unset: TORCHYARD_OIDC_CLIENT_ID.",
    )
    oidc_audience: str | None = Field(
        default=None,
        description="The audience the provider's access tokens must name to be taken as bearer tokens "
        "(its resource indicator for this API); unset: TORCHYARD_PUBLIC_URL.",
    )
    oidc_groups_claim: str = Field(
        default="groups",
        min_length=1,
        description="The claim that lists a user's groups; each group that names a team makes the user a "
        "member of it (others are ignored).",
    )
    oidc_admin_group: str | None = Field(
        default=None, description="Members of this provider group are torchyard admins; unset: none by group."
    )
    oidc_scopes: str = Field(
        default="openid email profile offline_access",
        description="The scopes asked of the provider at sign-in (space-separated; `openid` is needed).",
    )
    session_ttl_s: int = Field(
        default=3600,
        ge=60,
        le=7 * 24 * 3600,
        description="How long a web sign-in through the provider lasts before it is renewed with the "
        "provider's refresh token (docs/oidc.md); a disabled user's sessions end at once.",
    )

    @model_validator(mode="after")
    def _oidc(self) -> Settings:
        if self.oidc_issuer is not None:
            # Kept as given, a trailing slash included: the tokens' `iss` must equal it exactly.
            self.oidc_issuer = self.oidc_issuer.strip() or None
        if self.public_url is not None:
            self.public_url = self.public_url.strip().rstrip("/") or None
            if self.public_url is not None and urlsplit(self.public_url).scheme not in ("http", "https"):
                raise ValueError(f"TORCHYARD_PUBLIC_URL must be an http(s) URL, not {self.public_url!r}")
        if self.oidc_issuer is not None:
            missing = [
                name
                for name, value in (
                    ("TORCHYARD_OIDC_CLIENT_ID", self.oidc_client_id),
                    ("TORCHYARD_PUBLIC_URL", self.public_url),
                )
                if not value
            ]
            if missing:
                raise ValueError(f"TORCHYARD_OIDC_ISSUER is set: {' and '.join(missing)} must be set too")
            if urlsplit(self.oidc_issuer).scheme not in ("http", "https"):
                raise ValueError(f"TORCHYARD_OIDC_ISSUER must be an http(s) URL, not {self.oidc_issuer!r}")
        return self

    @field_validator("webhook_key")
    @classmethod
    def _webhook_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        key = value.get_secret_value().strip()
        try:
            raw = base64.urlsafe_b64decode(key.encode())
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise ValueError(
                "TORCHYARD_WEBHOOK_KEY must be a Fernet key: 32 bytes in url-safe base64 (make one with "
                'python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())")'
            )
        return SecretStr(key)

    @field_validator("storage_url")
    @classmethod
    def _storage_url(cls, value: str | None) -> str | None:
        value = (value or "").strip() or None
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme != "s3" or not parts.netloc:
                raise ValueError(f"TORCHYARD_STORAGE_URL must be s3://bucket[/prefix], not {value!r}")
        return value

    @field_validator("dataset_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        return _path_list(value)

    @field_validator("metrics_token", mode="before")
    @classmethod
    def _token_or_unset(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("metrics_allow", "trusted_proxies")
    @classmethod
    def _check_networks(cls, value: str, info: ValidationInfo) -> str:
        networks = []
        for item in value.split(","):
            if not item.strip():
                continue
            try:
                networks.append(str(ipaddress.ip_network(item.strip(), strict=False)))
            except ValueError:
                raise ValueError(
                    f"TORCHYARD_{str(info.field_name).upper()}: {item.strip()!r} is not a network "
                    "(CIDR such as 10.0.0.0/8)"
                ) from None
        return ",".join(networks)

    @property
    def trusted_proxy_networks(self) -> list[str]:
        """TORCHYARD_TRUSTED_PROXIES as a list of networks (empty: trust no proxy)."""
        return [n for n in self.trusted_proxies.split(",") if n]

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.lease_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"TORCHYARD_LEASE_TIMEOUT_S ({self.lease_timeout_s:g}) must be larger than "
                f"TORCHYARD_HEARTBEAT_INTERVAL_S ({self.heartbeat_interval_s:g})"
            )
        if self.master_port_min > self.master_port_max:
            raise ValueError(
                f"TORCHYARD_MASTER_PORT_MIN ({self.master_port_min}) must not exceed "
                f"TORCHYARD_MASTER_PORT_MAX ({self.master_port_max})"
            )
        if self.database_url and not self.database_url.startswith(("sqlite", "postgresql")):
            raise ValueError("TORCHYARD_DATABASE_URL must be a sqlite:// or postgresql:// URL")
        if self.env not in LOCAL_ENVS and _url_password(self.database_url) == EXAMPLE_DATABASE_PASSWORD:
            raise ValueError(
                "TORCHYARD_DATABASE_URL uses the example database password of docker-compose.yml and "
                ".env.example; choose a password of your own (with docker compose: POSTGRES_PASSWORD in "
                f".env), or set TORCHYARD_ENV=local for a try-out on one machine (TORCHYARD_ENV is {self.env!r})"
            )
        missing = [
            (name, what) for name, what in _ENGINE_NEEDS.get(self.engine, ()) if not getattr(self, name)
        ]
        if missing:
            needs = " and ".join(f"TORCHYARD_{name.upper()} ({what})" for name, what in missing)
            raise ValueError(f"TORCHYARD_ENGINE={self.engine} needs {needs}")
        return self

    @property
    def slurm_outputs(self) -> Path:
        """Where sbatch writes each Slurm job's output."""
        return self.slurm_output_dir or self.data_dir / "slurm"

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            url = self.database_url
            if url.startswith("postgresql://"):
                url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
            return url
        return f"sqlite:///{(self.data_dir / 'torchyard.db').resolve()}"

    @property
    def admin_token_path(self) -> Path:
        return self.data_dir / "admin.token"


def _url_password(url: str | None) -> str | None:
    if not url:
        return None
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password is not None else None


def _path_list(value: object) -> object:
    """A list setting given as text: a JSON list, or one item / comma-separated items."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not a valid JSON list ({exc})") from None
    return [part.strip() for part in text.split(",") if part.strip()]


@lru_cache
def get_settings() -> Settings:
    return Settings()


def settings_reference() -> str:
    """The README's configuration table, generated from the fields above."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
        shown = "unset" if default is None or default == [] else f"`{default}`"
        lines.append(f"| `TORCHYARD_{name.upper()}` | {shown} | {field.description or ''} |")
    return "\n".join(lines)


def _write_readme_table(readme: Path) -> None:
    text = readme.read_text()
    start, end = "<!-- settings:begin -->\n", "<!-- settings:end -->"
    head, rest = text.split(start, 1)
    _old, tail = rest.split(end, 1)
    readme.write_text(head + start + settings_reference() + "\n" + end + tail)


if __name__ == "__main__":
    _write_readme_table(Path(__file__).resolve().parent.parent / "README.md")
