"""Evaluation mode of the trainer program: a model directory scored on a labeled dataset.

The agent runs it for an evaluation job (docs/models.md) with ``"task": "evaluate"`` in
``job.json``: ``init_from_dir`` is the registered model's directory, ``val_dir`` the
dataset, ``classes`` the model's classes in output order. Images go through the
validation transform, so on the training job's own validation set the figures are the
ones training reported for the saved epoch. Rank 0 writes the result event: top-1,
top-5, mean loss, per-class precision/recall/F1 and the confusion matrix (rows: true
labels, columns: predictions).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from torchyard import modeldir
from worker.trainer.config import JobConfig
from worker.trainer.distributed import DistEnv
from worker.trainer.events import EVENTS_FILE, EventWriter

log = logging.getLogger(__name__)


def class_scores(confusion: torch.Tensor, classes: list[str]) -> list[dict[str, Any]]:
    """Per-class precision, recall, F1 and support from a confusion matrix (0 where undefined)."""
    out = []
    for index, label in enumerate(classes):
        true_positive = float(confusion[index, index])
        predicted = float(confusion[:, index].sum())
        actual = float(confusion[index, :].sum())
        precision = true_positive / predicted if predicted else 0.0
        recall = true_positive / actual if actual else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        out.append(
            {"label": label, "precision": precision, "recall": recall, "f1": f1, "support": int(actual)}
        )
    return out


@torch.inference_mode()
def evaluate(model_dir: str | Path, data_dir: str | Path, batch_size: int = 64) -> dict[str, Any]:
    """The evaluation figures of a model directory over a labeled ImageDirectory."""
    model, classes, config = modeldir.load_model(model_dir)
    samples = modeldir.image_directory_samples(data_dir, classes)
    geometry = modeldir.eval_geometry(int(config["image_size"]))
    mean, std = config.get("mean", modeldir.IMAGENET_MEAN), config.get("std", modeldir.IMAGENET_STD)
    n = len(classes)
    k = min(5, n)
    confusion = torch.zeros(n, n, dtype=torch.int64)
    loss_sum = top_k = 0.0
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        images = torch.stack([geometry(modeldir.load_rgb_image(path)) for path, _ in chunk])
        labels = torch.tensor([label for _, label in chunk])
        logits = model(modeldir.normalize_batch(images, mean, std)).float()
        loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
        top_k += float((logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum())
        confusion += torch.bincount(labels * n + logits.argmax(dim=1), minlength=n * n).view(n, n)
    count = len(samples)
    return {
        "num_images": count,
        "loss": loss_sum / count,
        "top1": float(confusion.diagonal().sum()) / count,
        "top5": top_k / count if n >= 5 else None,
        "classes": classes,
        "per_class": class_scores(confusion, classes),
        "confusion_matrix": confusion.tolist(),
    }


def run_evaluation(job: JobConfig, env: DistEnv) -> dict[str, Any] | None:
    """Rank 0 evaluates and writes the result event; other ranks have nothing to do."""
    if not env.is_primary:
        return None
    if job.init_from_dir is None:
        raise modeldir.InvalidModelDirectoryError("the evaluation job names no model directory")
    started = time.perf_counter()
    batch_size = int(job.parameters.batch_size)
    figures = evaluate(job.init_from_dir, job.val_dir, batch_size=batch_size)
    log.info(
        "evaluated %d images in %.1fs: top-1 %.4f%s, loss %.4f",
        figures["num_images"],
        time.perf_counter() - started,
        figures["top1"],
        "" if figures["top5"] is None else f", top-5 {figures['top5']:.4f}",
        figures["loss"],
    )
    best = {"val.loss": figures["loss"], "val.top1": figures["top1"]}
    if figures["top5"] is not None:
        best["val.top5"] = figures["top5"]
    output_dir = Path(job.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    events = EventWriter(output_dir / EVENTS_FILE)
    try:
        events.result(
            best_epoch=0, best=best, final=None, stopped_early=False, epochs_run=0, evaluation=figures
        )
    finally:
        events.close()
    return figures
