"""Datasets: ownership and the label checks made at job submission."""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.db.models import Dataset
from service.services.tokens import Principal
from torchyard.errors import InvalidDatasetError, NotFoundError


def get_dataset(session: Session, principal: Principal, dataset_id: str) -> Dataset:
    """The dataset, if the principal may see it; another user's dataset is a 404."""
    row = session.get(Dataset, dataset_id)
    if row is None or (not principal.is_admin and row.owner_id != principal.id):
        raise NotFoundError(f"dataset {dataset_id!r} not found")
    return row


def resolve_job_datasets(
    session: Session, principal: Principal, train_id: str, val_id: str
) -> tuple[Dataset, Dataset]:
    """Both datasets of a job, visible to the submitter and with equal label sets."""
    train = get_dataset(session, principal, train_id)
    val = get_dataset(session, principal, val_id)
    train_labels, val_labels = set(train.classes), set(val.classes)
    if train_labels != val_labels:
        only_train = sorted(train_labels - val_labels)
        only_val = sorted(val_labels - train_labels)
        raise InvalidDatasetError(
            "training and validation datasets must have the same labels: "
            f"missing in validation: {only_train or 'none'}; missing in training: {only_val or 'none'}",
            details={"missing_in_validation": only_train, "missing_in_training": only_val},
        )
    return train, val
