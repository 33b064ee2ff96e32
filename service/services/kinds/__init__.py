"""Job kinds on the service side: one module per kind (:mod:`.train`, :mod:`.script`,
:mod:`.evaluate`), each a :class:`~service.services.kinds.base.Kind`.

A new kind adds its module and one line in :data:`KINDS`.
"""

from __future__ import annotations

from service.db.models import Job
from service.services.kinds.base import Kind
from service.services.kinds.evaluate import Evaluate
from service.services.kinds.script import Script
from service.services.kinds.train import Train
from torchyard.contract.jobspec import JobKind

KINDS: dict[JobKind, Kind] = {kind.kind: kind for kind in (Train(), Script(), Evaluate())}


def kind_of(job: Job) -> Kind:
    """The rules of ``job``'s kind."""
    return KINDS[job.type]


def kind_named(name: str) -> Kind:
    """The rules of the kind called ``name`` (a request's ``type``)."""
    return KINDS[JobKind(name)]


__all__ = ["KINDS", "Kind", "kind_named", "kind_of"]
