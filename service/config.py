"""Service settings: one pydantic-settings class, prefix ``TORCHYARD_``, validated at start."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every knob of the API service. Each field is read from ``TORCHYARD_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="TORCHYARD_", extra="ignore")

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
    max_upload_bytes: int = Field(
        default=2 * 1024**3, gt=0, description="Largest dataset archive accepted by POST /v1/datasets."
    )
    max_extracted_bytes: int = Field(
        default=8 * 1024**3, gt=0, description="Largest total size an archive may expand to."
    )
    max_extracted_files: int = Field(default=1_000_000, gt=0, description="Most files an archive may hold.")
    max_image_pixels: int = Field(
        default=50_000_000, gt=0, description="Largest image (width × height) decoded during validation."
    )
    dataset_roots: list[Path] = Field(
        default_factory=list,
        description="Shared-storage folders under which datasets may be registered by path "
        "(JSON list or comma-separated).",
    )
    max_nodes: int | None = Field(
        default=None,
        ge=1,
        description="Cluster's maximum node count; unset means the number of registered nodes not lost.",
    )
    heartbeat_interval_s: float = Field(default=2.0, gt=0, description="How often workers heartbeat.")
    lease_timeout_s: float = Field(
        default=15.0, gt=0, description="A node or attempt not heard from for this long is lost."
    )
    claim_poll_timeout_s: float = Field(
        default=20.0, gt=0, description="Longest a worker's claim long-poll is held open."
    )
    claim_recheck_interval_s: float = Field(
        default=0.25,
        gt=0,
        le=5,
        description="While a claim long-poll waits, how often it re-reads the database for work "
        "placed by another API replica (work placed by this replica wakes it at once).",
    )
    reaper_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="How often each API replica looks for expired leases, silent nodes and "
        "finished cancellations, and runs a scheduling pass.",
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
    model_max_bytes: int = Field(
        default=4 * 1024**3, gt=0, description="Largest model directory archive a worker may upload."
    )

    @field_validator("dataset_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip().startswith("["):
            return [part for part in value.split(",") if part.strip()]
        return value

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
        return self

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
