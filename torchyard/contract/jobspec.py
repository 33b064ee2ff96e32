"""A training job's model, parameters and resources: ranges and defaults of docs/datasets.md,
defined once.

The API validates submissions against these (strictly: unknown fields refused); the
trainer reads them back from ``job.json`` (tolerantly: a newer agent's extra keys are
logged, not fatal). Each field's ``allowed`` text is what a 422 shows and what the
OpenAPI schema documents.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from torchyard.architectures import CLASSIFICATION_ARCHITECTURES

DOUBLE_EPSILON = 2.220446049250313e-16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_RUNTIME_S = 30 * 24 * 3600

Augmentation = Literal["standard", "light", "none"]


def allowed(text: str) -> dict[str, Any]:
    """Shown to clients in validation errors and in the OpenAPI schema."""
    return {"allowed": text}


# A count of at least one, stored as a 32-bit integer.
_POSITIVE_INT32 = f"> 0 and <= {INT32_MAX}"


DEFAULT_MAX_RESTARTS = 3
MAX_RESTARTS = 100
DEFAULT_HANG_TIMEOUT_S = 1800
MIN_HANG_TIMEOUT_S = 10
MAX_HANG_TIMEOUT_S = 604_800


class ModelFields(BaseModel):
    """The untrained model: a torchvision architecture and how to build it."""

    architecture: Annotated[
        str,
        Field(
            min_length=1,
            max_length=100,
            description="A torchvision classification model name (torchvision.models.list_models()).",
            # x-choices: the names a client may offer as a list (the web UI's new-job form).
            json_schema_extra={
                **allowed("a torchvision classification model name"),
                "x-choices": sorted(CLASSIFICATION_ARCHITECTURES),
            },
        ),
    ]
    pretrained: bool = Field(
        default=False,
        description="Start from pretrained weights (the service's weights store, or the model hub "
        "where nodes may reach it; docs/fine-tuning.md) and train a new head for the job's classes.",
    )
    memory_efficient: bool = Field(
        default=False, description="DenseNet only: checkpointed, memory-efficient implementation."
    )


class JobParameters(BaseModel):
    """Training parameters (docs/datasets.md)."""

    epochs: int = Field(default=5, gt=0, le=INT32_MAX, json_schema_extra=allowed(_POSITIVE_INT32))
    batch_size: int = Field(default=16, gt=0, le=INT32_MAX, json_schema_extra=allowed(_POSITIVE_INT32))
    warmup_epochs: int = Field(default=0, ge=0, le=INT32_MAX, json_schema_extra=allowed(">= 0 and <= epochs"))
    learning_rate: float = Field(
        default=0.001,
        ge=DOUBLE_EPSILON,
        allow_inf_nan=False,
        json_schema_extra=allowed(f">= {DOUBLE_EPSILON!r} and finite"),
    )
    random_seed: int = Field(
        default=1, ge=INT64_MIN, le=INT64_MAX, json_schema_extra=allowed("a 64-bit signed integer")
    )
    patience: int = Field(default=3, gt=0, le=INT32_MAX, json_schema_extra=allowed(_POSITIVE_INT32))
    print_frequency: int = Field(default=10, gt=0, le=INT32_MAX, json_schema_extra=allowed(_POSITIVE_INT32))
    image_size: int = Field(default=224, ge=16, le=1024, json_schema_extra=allowed("16..1024"))
    augmentation: Augmentation = Field(
        default="standard", json_schema_extra=allowed("standard, light or none")
    )

    @model_validator(mode="after")
    def _warmup_within_epochs(self) -> JobParameters:
        if self.warmup_epochs > self.epochs:
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) must be <= epochs ({self.epochs})")
        if not math.isfinite(self.learning_rate):
            raise ValueError("learning_rate must be finite")
        return self


class ResourceFields(BaseModel):
    """Where and how long a job runs (docs/datasets.md, §5)."""

    node_count: int = Field(
        default=1, ge=1, le=INT32_MAX, json_schema_extra=allowed(">= 1 and <= the cluster's max nodes")
    )
    process_count_per_node: int = Field(
        default=1,
        ge=1,
        le=INT32_MAX,
        json_schema_extra=allowed(">= 1 and <= the processing units of a node"),
    )
    max_runtime_s: int | None = Field(
        default=None,
        ge=1,
        le=MAX_RUNTIME_S,
        description="Wall-clock limit counted from the job's start (status running); past it every "
        "rank is stopped and the job fails with TimeoutError. Unset: no limit.",
        json_schema_extra=allowed(f">= 1 and <= {MAX_RUNTIME_S} (30 days), or null for no limit"),
    )
    max_restarts: int = Field(
        default=DEFAULT_MAX_RESTARTS,
        ge=0,
        le=MAX_RESTARTS,
        description="How many times a retryable failure (docs/restarts.md) puts the job back to queued to "
        "resume from its latest checkpoint. Preemptions are not counted.",
        json_schema_extra=allowed(f">= 0 and <= {MAX_RESTARTS}"),
    )
    hang_timeout_s: int | None = Field(
        default=DEFAULT_HANG_TIMEOUT_S,
        ge=MIN_HANG_TIMEOUT_S,
        le=MAX_HANG_TIMEOUT_S,
        description="No training step finished by any rank for this long: every rank's stacks are "
        "dumped into its log and the attempt ends with HangError. Null: no watchdog.",
        json_schema_extra=allowed(
            f">= {MIN_HANG_TIMEOUT_S} and <= {MAX_HANG_TIMEOUT_S} (7 days), or null for no watchdog"
        ),
    )


# --- job kinds -------------------------------------------------------------------------------
#
# A job spec's ``type`` selects what runs: ``train`` (the built-in trainer, the default
# when ``type`` is left out), ``script`` (the user's own code, docs/script-jobs.md) or ``evaluate`` (a
# registered model scored on a labeled dataset, docs/models.md). A new kind adds its name here,
# its request model in ``service/schemas/jobs.py`` (``JobCreate``, ``JOB_CREATE_MODELS``),
# its claimed placement in ``torchyard/contract/protocol.py``, one module in
# ``service/services/kinds/`` (submit-time checks, claim payload, success rule, what is
# kept) and one in ``worker/agent/kinds/`` (prepare, launch, outcome). ``jobs.type`` has no
# CHECK constraint: the API refuses unknown kinds, so a new kind needs no migration.


class JobKind(StrEnum):
    """What a job runs (its ``type``)."""

    TRAIN = "train"
    SCRIPT = "script"
    EVALUATE = "evaluate"


JOB_TYPES: tuple[str, ...] = tuple(kind.value for kind in JobKind)
DEFAULT_JOB_TYPE = JobKind.TRAIN.value

Launch = Literal["per_process", "per_node"]
OutputsScope = Literal["node0", "all"]

ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
INPUT_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_]{0,63}$"
MAX_COMMAND_ARGS = 1000
MAX_ARG_CHARS = 10_000
MAX_ENV_VARIABLES = 200
MAX_ENV_VALUE_CHARS = 32_768
MAX_PIP_REQUIREMENTS = 100
# How long building a job's pip environment may take on a node (environment.build_timeout_s).
DEFAULT_BUILD_TIMEOUT_S = 900
MIN_BUILD_TIMEOUT_S = 30
MAX_BUILD_TIMEOUT_S = 7200
MAX_INPUTS = 32

# Variables the agent sets for every script process; a spec may not set them itself.
PER_PROCESS_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)
PER_NODE_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "NPROC_PER_NODE")
RESERVED_VARIABLE_PREFIX = "TORCHYARD_"
# Folders a node's sandbox never shows to a run (os.pathsep-separated), besides the agent's
# own: ``torchyard serve --with-worker`` names its data directory there.
SANDBOX_HIDE_VARIABLE = "TORCHYARD_SANDBOX_HIDE"
RESERVED_VARIABLES = frozenset(
    {*PER_PROCESS_VARIABLES, *PER_NODE_VARIABLES, "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "VIRTUAL_ENV"}
)


def input_variable(name: str) -> str:
    """The environment variable holding the local path of input ``name``."""
    return f"TORCHYARD_INPUT_{name.upper()}"


Network = Literal["host", "none"]


class DistributionFields(BaseModel):
    """How a script job's command is started on each node."""

    launch: Launch = Field(
        default="per_process",
        description="per_process: process_count_per_node copies of the command on every node, each "
        "with RANK, LOCAL_RANK, WORLD_SIZE... set; per_node: the command once per node (it may be "
        "torchrun) with NNODES, NPROC_PER_NODE, NODE_RANK, MASTER_ADDR and MASTER_PORT set.",
        json_schema_extra=allowed("per_process or per_node"),
    )


def _check_variables(variables: dict[str, str]) -> dict[str, str]:
    for name, value in variables.items():
        if name in RESERVED_VARIABLES or name.startswith(RESERVED_VARIABLE_PREFIX):
            raise ValueError(f"{name} is set by torchyard and may not be given in environment.variables")
        if "\x00" in value:
            raise ValueError(f"the value of {name} contains a NUL character")
    return variables


_VERSION_CLAUSE = r"(?:~=|===|==|!=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
# A requirement by name, as the package index serves it: name, [extras], version clauses and
# an environment marker; never a URL or a path (``name @ http://...``, ``file:...``) nor an
# option, which would fetch from somewhere else than the configured index.
_REQUIREMENT = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
    r"(?:\s*\[\s*[A-Za-z0-9._-]+(?:\s*,\s*[A-Za-z0-9._-]+)*\s*\])?"
    rf"(?:\s*\(?\s*{_VERSION_CLAUSE}(?:\s*,\s*{_VERSION_CLAUSE})*\s*\)?)?"
    r"(?:\s*;\s*[A-Za-z0-9_.'\"<>=!~ ()-]+)?"
)


def _check_requirements(pip: list[str]) -> list[str]:
    for item in pip:
        if item.lstrip().startswith("-"):
            raise ValueError(f"{item!r}: pip options are not accepted, only requirements")
        if any(c in item for c in "\x00\n\r"):
            raise ValueError(f"{item!r}: a requirement is one line")
        if _REQUIREMENT.fullmatch(item) is None:
            raise ValueError(
                f"{item!r}: a requirement names a package of the index (name, [extras], version, "
                "; marker), without surrounding spaces; no URL, path or 'name @ ...' reference"
            )
    return pip


class EnvironmentFields(BaseModel):
    """A script's environment: extra variables and pip requirements."""

    variables: dict[
        Annotated[str, Field(pattern=ENV_NAME_PATTERN)], Annotated[str, Field(max_length=MAX_ENV_VALUE_CHARS)]
    ] = Field(
        default_factory=dict,
        max_length=MAX_ENV_VARIABLES,
        description="Environment variables for every process (not MASTER_*, RANK... or TORCHYARD_*).",
        json_schema_extra=allowed(f"at most {MAX_ENV_VARIABLES} NAME: value pairs, names {ENV_NAME_PATTERN}"),
    )
    pip: list[Annotated[str, Field(min_length=1, max_length=500)]] = Field(
        default_factory=list,
        max_length=MAX_PIP_REQUIREMENTS,
        description="pip requirements installed into a virtual environment built once per node over "
        "the worker's own torch (--system-site-packages), cached by requirement set.",
        json_schema_extra=allowed(f"at most {MAX_PIP_REQUIREMENTS} requirement strings, no pip options"),
    )
    build_timeout_s: int = Field(
        default=DEFAULT_BUILD_TIMEOUT_S,
        ge=MIN_BUILD_TIMEOUT_S,
        le=MAX_BUILD_TIMEOUT_S,
        description="How long building the pip environment may take on a node; past it the build is "
        "stopped, its node slots freed, and the job fails with EnvironmentBuildError.",
        json_schema_extra=allowed(f">= {MIN_BUILD_TIMEOUT_S} and <= {MAX_BUILD_TIMEOUT_S} (2 hours)"),
    )
    network: Network = Field(
        default="host",
        description="host: the processes share the node's network (what a multi-node job needs; "
        "they reach whatever the node reaches, its loopback services included); none: a network "
        "of their own with only a loopback interface, where the job's MLflow endpoint still "
        "answers (one node, and one process per node or the per_node launch).",
        json_schema_extra=allowed("host or none"),
    )

    @field_validator("variables")
    @classmethod
    def _check_variables(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_variables(value)

    @field_validator("pip")
    @classmethod
    def _check_pip(cls, value: list[str]) -> list[str]:
        return _check_requirements(value)


class ScriptFields(BaseModel):
    """What a script job runs (docs/script-jobs.md)."""

    code: str = Field(
        min_length=1, max_length=64, description="Id of an uploaded code package (POST /v1/code)."
    )
    command: list[Annotated[str, Field(max_length=MAX_ARG_CHARS)]] = Field(
        min_length=1,
        max_length=MAX_COMMAND_ARGS,
        description="The program and its arguments, run in a fresh copy of the code without a shell; "
        "$NAME and ${NAME} are expanded from the launch variables.",
        json_schema_extra=allowed("a non-empty list of strings, the first one non-empty"),
    )
    distribution: DistributionFields = Field(default_factory=DistributionFields)
    inputs: dict[
        Annotated[str, Field(pattern=INPUT_NAME_PATTERN)], Annotated[str, Field(min_length=1, max_length=64)]
    ] = Field(
        default_factory=dict,
        max_length=MAX_INPUTS,
        description="Input name → dataset id; each is materialised on the node and its path given "
        "in TORCHYARD_INPUT_<NAME>.",
        json_schema_extra=allowed(f"at most {MAX_INPUTS} name: dataset id pairs, names {INPUT_NAME_PATTERN}"),
    )
    environment: EnvironmentFields = Field(default_factory=EnvironmentFields)
    outputs: OutputsScope = Field(
        default="node0",
        description="node0: node rank 0's output folder is kept; all: every node's, under node-<rank>/.",
        json_schema_extra=allowed("node0 or all"),
    )

    @field_validator("command")
    @classmethod
    def _check_command(cls, value: list[str]) -> list[str]:
        if not value[0].strip():
            raise ValueError("command[0] (the program) may not be empty")
        if any("\x00" in arg for arg in value):
            raise ValueError("command arguments may not contain NUL characters")
        return value

    @field_validator("inputs")
    @classmethod
    def _check_inputs(cls, value: dict[str, str]) -> dict[str, str]:
        if len({input_variable(n) for n in value}) != len(value):
            raise ValueError("input names must differ in more than letter case")
        return value
