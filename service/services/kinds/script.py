"""Script jobs (docs/script-jobs.md): the user's code package and command, per process or per node.

Submission checks the code package and every input dataset; a claim carries the command,
its environment, the code and the inputs; the attempt succeeds on node rank 0's success,
or with ``"outputs": "all"`` once every node uploaded its outputs and reported; the
outputs folder is what is kept (a model directory in it may be registered by ``path``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import CodePackage, Job, JobInput
from service.schemas.jobs import ScriptJobCreate
from service.services.cluster import check_resources
from service.services.code import get_code
from service.services.datasets import dataset_field
from service.services.kinds.base import Claim, Kind, claimed_dataset, queue
from service.services.tokens import Principal
from torchyard.contract.errors import NotFoundError, RequestValidationError, TorchyardError
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import ClaimedCode, ScriptPlacement, ScriptSpec
from torchyard.contract.reports import FILE_STREAM_PREFIX, file_stream_node_rank

# The spec keys a node needs to run the command.
_CLAIMED_KEYS = ("command", "distribution", "environment", "outputs", "resources")


class Script(Kind):
    kind: ClassVar[JobKind] = JobKind.SCRIPT
    shown_fields = ("command", "distribution", "inputs", "environment", "outputs")
    work_name = "the script"
    keeps_outputs = True

    def submit(
        self, session: Session, settings: Settings, principal: Principal, spec: BaseModel, *, commit: bool
    ) -> Job:
        """The code package and every input dataset must be the submitter's (another user's
        is a 404 naming the field), and the resources fit the cluster."""
        assert isinstance(spec, ScriptJobCreate)
        code = get_code(session, principal, spec.code, exact=True, lock="share")
        inputs = {}
        for name, dataset_ref in spec.inputs.items():
            inputs[name] = dataset_field(session, principal, dataset_ref, f"inputs.{name}")
        check_resources(session, settings, spec.resources.node_count, spec.resources.process_count_per_node)
        normalized = spec.model_dump(mode="json")
        normalized["inputs"] = {name: row.id for name, row in inputs.items()}
        normalized["name"] = spec.name or f"script-{code.name}"
        job = queue(session, principal, self.kind, spec, normalized, code_id=code.id)
        for name, row in inputs.items():
            session.add(JobInput(job_id=job.id, name=name, dataset_id=row.id))
        if commit:
            session.commit()
        return job

    def claimed(self, session: Session, job: Job, claim: Claim) -> ScriptPlacement:
        assert job.code_id is not None  # the script_fields constraint
        spec = job.spec
        code = session.get_one(CodePackage, job.code_id)
        inputs = session.scalars(select(JobInput).where(JobInput.job_id == job.id).order_by(JobInput.name))
        return ScriptPlacement(
            **claim.common,
            spec=ScriptSpec.model_validate({k: spec[k] for k in _CLAIMED_KEYS if k in spec}),
            code=ClaimedCode(id=code.id, sha256=code.sha256, files=code.files),
            inputs={row.name: claimed_dataset(session, row.dataset_id) for row in inputs},
        )

    def shown(self, job: Job) -> dict[str, Any]:
        return super().shown(job) | {
            "code": job.code_id,
            "outputs_sha256": job.outputs_sha256,
            "outputs_size": job.outputs_size,
            "tracking": job.tracking,
        }

    def listed(self, job: Job) -> dict[str, Any]:
        return {"command": (job.spec or {}).get("command")}

    def waits_for_every_node(self, job: Job) -> bool:
        """A script job keeping every node's outputs succeeds once every node has uploaded them."""
        return (job.spec or {}).get("outputs") == "all"

    def check_registration(self, job: Job, path: str | None) -> None:
        """A script job is registered with ``path``: the folder of its outputs holding the model."""
        if path is None:
            raise RequestValidationError(
                f"job {job.id} is a script job: name the folder of its outputs that holds the model "
                'directory: "path" in the request, --path with torchyard model register (e.g. model)',
                details={"field": "path"},
            )

    def accepts_log_stream(self, stream: str, node_rank: int) -> bool:
        return file_stream_node_rank(stream) == node_rank  # a file under the node's ./logs

    def log_streams_hint(self, node_rank: int) -> str:
        return f", {FILE_STREAM_PREFIX}{node_rank}/<path>"

    def check_tracking(self, job: Job) -> None:
        return None

    def missing_result(self, job: Job) -> TorchyardError | None:
        return NotFoundError(
            f"job {job.id} is a script job: it has no result; its files are its outputs "
            f"(GET /v1/jobs/{job.id}/outputs, torchyard download {job.id} --outputs)"
        )
