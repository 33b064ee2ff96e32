"""The script kind on the service side (service/services/kinds/script.py): what a submission
checks and stores (the code package, the input datasets), what a claim carries, when an
attempt succeeds, which log streams and reports it accepts, and what it keeps."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Job, JobInput, Node
from service.schemas.jobs import ScriptJobCreate
from service.services.kinds.script import Script
from service.services.tokens import Principal
from service.states import JobStatus
from tests.service.kinds.conftest import Rows
from torchyard.contract.errors import NotFoundError, RequestValidationError, ResourceLimitError
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import ClaimedCode, ClaimedDataset, ScriptPlacement

SCRIPT = Script()


def _spec(code: str, **overrides: Any) -> ScriptJobCreate:
    body: dict[str, Any] = {
        "type": "script",
        "code": code,
        "command": ["python", "train.py", "--rank", "$RANK"],
    }
    body.update(overrides)
    return ScriptJobCreate.model_validate(body)


def _submit(session: Session, rows: Rows, who: Principal, spec: ScriptJobCreate) -> Job:
    return SCRIPT.submit(session, rows.settings, who, spec, commit=False)


@pytest.fixture
def code_id(rows: Rows, alice: Principal, node: Node) -> str:
    """Alice's code package ``trainer``, on a cluster of one 4-unit node."""
    return rows.code(alice, "trainer", files=7).id


# --- submit --------------------------------------------------------------------------------------


def test_submit_stores_the_inputs_by_dataset_id_and_names_the_job_after_the_code(
    session: Session, rows: Rows, alice: Principal, code_id: str
) -> None:
    images = rows.dataset(alice, "images", ["cat", "dog"])
    labels = rows.dataset(alice, "labels", ["x"])
    spec = _spec(
        code_id,
        inputs={"train": "images", "extra": labels.id},  # a name and an id
        outputs="all",
        distribution={"launch": "per_node"},
        environment={"variables": {"SEED": "3"}},
        resources={"node_count": 1, "process_count_per_node": 4},
        priority=-5,
    )
    job = _submit(session, rows, alice, spec)

    assert job.type == JobKind.SCRIPT
    assert job.status == JobStatus.QUEUED
    assert job.code_id == code_id
    assert job.name == "script-trainer"
    assert (job.node_count, job.process_count_per_node, job.priority) == (1, 4, -5)
    assert job.architecture is None and job.train_dataset_id is None
    expected = spec.model_dump(mode="json") | {
        "inputs": {"train": images.id, "extra": labels.id},
        "name": "script-trainer",
    }
    assert job.spec == expected
    stored = session.scalars(select(JobInput).where(JobInput.job_id == job.id).order_by(JobInput.name))
    assert [(row.name, row.dataset_id) for row in stored] == [("extra", labels.id), ("train", images.id)]


def test_a_given_name_is_kept(session: Session, rows: Rows, alice: Principal, code_id: str) -> None:
    assert _submit(session, rows, alice, _spec(code_id, name="sweep-7")).name == "sweep-7"


def test_the_code_package_is_named_by_its_id_only(
    session: Session, rows: Rows, alice: Principal, code_id: str
) -> None:
    """Submission looks the package up exactly: its name is not enough."""
    with pytest.raises(NotFoundError) as err:
        _submit(session, rows, alice, _spec("trainer"))
    assert err.value.status_code == 404
    assert err.value.message == "code package 'trainer' not found"
    assert err.value.details == {"field": "code"}


def test_another_users_code_package_is_not_found(
    session: Session, rows: Rows, alice: Principal, bob: Principal, code_id: str
) -> None:
    with pytest.raises(NotFoundError) as err:
        _submit(session, rows, bob, _spec(code_id))
    assert err.value.message == f"code package {code_id!r} not found"
    assert err.value.details == {"field": "code"}


def test_an_input_another_user_owns_is_not_found_naming_the_input(
    session: Session, rows: Rows, alice: Principal, bob: Principal, code_id: str
) -> None:
    theirs = rows.dataset(bob, "theirs", ["a"])
    mine = rows.dataset(alice, "mine", ["a"])
    with pytest.raises(NotFoundError) as err:
        _submit(session, rows, alice, _spec(code_id, inputs={"ok": mine.id, "data": theirs.id}))
    assert err.value.message.startswith(f"inputs.data: dataset {theirs.id!r} not found")
    assert err.value.details == {"field": "inputs.data"}
    assert session.scalars(select(Job)).first() is None  # nothing queued


def test_a_shape_beyond_the_cluster_is_refused(
    session: Session, rows: Rows, alice: Principal, code_id: str
) -> None:
    with pytest.raises(ResourceLimitError) as err:
        _submit(session, rows, alice, _spec(code_id, resources={"process_count_per_node": 9}))
    assert err.value.details == [
        {
            "field": "resources.process_count_per_node",
            "value": 9,
            "limit": 4,
            "message": "process_count_per_node 9 exceeds the 4 processing units of the largest node",
        }
    ]


# --- claim ---------------------------------------------------------------------------------------


def test_a_claim_carries_the_command_its_settings_the_code_and_the_inputs_in_name_order(
    session: Session, rows: Rows, alice: Principal, code_id: str, node: Node
) -> None:
    zeta = rows.dataset(alice, "zeta", ["z1", "z2"], per_class=3, sha="9")
    alpha = rows.dataset(alice, "alpha", ["a"], per_class=2, sha="8")
    job = _submit(
        session,
        rows,
        alice,
        _spec(
            code_id,
            inputs={"zeta": zeta.id, "alpha": alpha.id},
            outputs="all",
            distribution={"launch": "per_node"},
            environment={"variables": {"SEED": "3"}, "pip": ["tqdm==4.66.0"]},
            resources={"process_count_per_node": 2, "hang_timeout_s": 30},
        ),
    )
    claim = rows.claim(job, node)
    placed = SCRIPT.claimed(session, job, claim)

    assert isinstance(placed, ScriptPlacement)
    assert placed.type is JobKind.SCRIPT
    assert placed.job_id == job.id and placed.lease_token == claim.placement.lease_token
    assert placed.spec.command == ["python", "train.py", "--rank", "$RANK"]
    assert placed.spec.distribution.launch == "per_node"
    assert placed.spec.environment.variables == {"SEED": "3"}
    assert placed.spec.environment.pip == ["tqdm==4.66.0"]
    assert placed.spec.outputs == "all"
    assert placed.spec.resources.process_count_per_node == 2
    assert placed.spec.resources.hang_timeout_s == 30
    assert placed.code == ClaimedCode(id=code_id, sha256="c" * 64, files=7)
    assert list(placed.inputs) == ["alpha", "zeta"]
    assert placed.inputs["zeta"] == ClaimedDataset(
        id=zeta.id, sha256="9" * 64, classes=["z1", "z2"], num_images=6
    )
    assert placed.inputs["alpha"] == ClaimedDataset(id=alpha.id, sha256="8" * 64, classes=["a"], num_images=2)
    assert placed.datasets is None and placed.checkpoint is None


# --- success, logs, reports, what is kept ---------------------------------------------------------


@pytest.mark.parametrize(("outputs", "waits"), [("node0", False), ("all", True)])
def test_only_outputs_all_waits_for_every_node(
    session: Session, rows: Rows, alice: Principal, code_id: str, outputs: str, waits: bool
) -> None:
    job = _submit(session, rows, alice, _spec(code_id, outputs=outputs))
    assert SCRIPT.waits_for_every_node(job) is waits


def test_a_node_ships_the_file_streams_of_its_own_logs_folder_only() -> None:
    assert SCRIPT.accepts_log_stream("file-2/loss.log", 2)
    assert SCRIPT.accepts_log_stream("file-0/sub/dir.txt", 0)
    assert not SCRIPT.accepts_log_stream("file-1/loss.log", 2)  # another node's
    assert not SCRIPT.accepts_log_stream("file-x/loss.log", 0)
    assert not SCRIPT.accepts_log_stream("file-0", 0)  # no path
    assert not SCRIPT.accepts_log_stream("rank-0", 0)
    assert SCRIPT.log_streams_hint(3) == ", file-3/<path>"


def test_a_script_job_keeps_outputs_reports_tracking_and_has_no_result(
    session: Session, rows: Rows, alice: Principal, code_id: str
) -> None:
    job = _submit(session, rows, alice, _spec(code_id))
    assert SCRIPT.kind is JobKind.SCRIPT
    assert SCRIPT.keeps_outputs and not SCRIPT.keeps_model
    assert SCRIPT.work_name == "the script"
    SCRIPT.check_tracking(job)  # allowed
    missing = SCRIPT.missing_result(job)
    assert isinstance(missing, NotFoundError)
    assert missing.message == (
        f"job {job.id} is a script job: it has no result; its files are its outputs "
        f"(GET /v1/jobs/{job.id}/outputs, torchyard download {job.id} --outputs)"
    )
    assert not SCRIPT.uses_version(job, "any")


def test_a_script_job_is_registered_with_the_path_of_its_model_in_the_outputs(
    session: Session, rows: Rows, alice: Principal, code_id: str
) -> None:
    job = _submit(session, rows, alice, _spec(code_id))
    SCRIPT.check_registration(job, "model")
    with pytest.raises(RequestValidationError) as err:
        SCRIPT.check_registration(job, None)
    assert err.value.status_code == 422
    assert err.value.details == {"field": "path"}
    assert err.value.message.startswith(f"job {job.id} is a script job: name the folder of its outputs")


def test_shown_and_listed(session: Session, rows: Rows, alice: Principal, code_id: str) -> None:
    data = rows.dataset(alice, "data", ["a"])
    job = _submit(session, rows, alice, _spec(code_id, inputs={"data": "data"}))
    job.outputs_sha256, job.outputs_size, job.tracking = "7" * 64, 1234, {"runs": []}
    assert SCRIPT.shown(job) == {
        "command": ["python", "train.py", "--rank", "$RANK"],
        "distribution": {"launch": "per_process"},
        "inputs": {"data": data.id},
        "environment": job.spec["environment"],
        "outputs": "node0",
        "code": code_id,
        "outputs_sha256": "7" * 64,
        "outputs_size": 1234,
        "tracking": {"runs": []},
    }
    assert SCRIPT.listed(job) == {"command": ["python", "train.py", "--rank", "$RANK"]}
