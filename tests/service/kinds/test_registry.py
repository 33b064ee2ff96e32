"""The service's registry of job kinds (service/services/kinds/__init__.py): one kind per
``JobKind``, found by a job's ``type`` or a request's."""

from __future__ import annotations

import pytest

from service.db.models import Job
from service.services.kinds import KINDS, kind_named, kind_of
from service.services.kinds.evaluate import Evaluate
from service.services.kinds.script import Script
from service.services.kinds.train import Train
from torchyard.contract.jobspec import JOB_TYPES, JobKind


def test_every_job_kind_has_one_kind_that_answers_to_it() -> None:
    assert sorted(KINDS) == sorted(JobKind)
    assert sorted(JOB_TYPES) == sorted(k.value for k in KINDS)
    for name, kind in KINDS.items():
        assert kind.kind is name


@pytest.mark.parametrize(("name", "cls"), [("train", Train), ("script", Script), ("evaluate", Evaluate)])
def test_a_kind_is_found_by_its_name_and_by_a_jobs_type(name: str, cls: type) -> None:
    assert isinstance(kind_named(name), cls)
    job = Job(type=name)  # kind_of reads nothing else of the job
    assert isinstance(kind_of(job), cls)
    assert kind_of(job) is kind_named(name) is KINDS[JobKind(name)]


def test_an_unknown_kind_is_a_value_error() -> None:
    """Requests are validated before: an unknown ``type`` never reaches the registry as a 4xx."""
    with pytest.raises(ValueError, match="'sweep' is not a valid JobKind"):
        kind_named("sweep")


def test_only_training_keeps_a_model_and_only_scripts_keep_outputs() -> None:
    assert {k for k, kind in KINDS.items() if kind.keeps_model} == {JobKind.TRAIN}
    assert {k for k, kind in KINDS.items() if kind.keeps_outputs} == {JobKind.SCRIPT}
