"""``show``: a job's status, spec, progress, failure, attempts and history, as text."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping
from typing import Any

from torchyard.apiclient.models import Attempt, Failure
from torchyard.client import Job
from torchyard.commands.common import _JOB_HELP, _client, _print_json, dataset_names, dataset_text
from torchyard.contract.jobspec import JobKind
from torchyard.contract.learning_rate import describe_schedule
from torchyard.terminal import format_duration, format_time, human_bytes, job_timing

_PERCENT_KEYS = ("top1", "top5", "accuracy")
# The longest param or tag value ``show`` prints whole (``--json`` has every value whole).
TRACKING_VALUE_CHARS = 100


def _shown_value(key: str, value: Any) -> str:
    """One value as ``show`` prints it: accuracies as %, other floats to 4 significant
    digits, times to the second in local time, booleans and lists as written in a spec."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _shown_float(key, value)
    if isinstance(value, str) and _looks_like_time(value):
        try:
            return format_time(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return "[" + ", ".join(_shown_value(key, v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + _kv(value) + "}"
    return str(value)


def _shown_float(key: str, value: float) -> str:
    if key.rsplit(".", 1)[-1] in _PERCENT_KEYS and 0.0 <= value <= 1.0:
        return f"{value:.2%}"
    return f"{value:.4g}"


def _looks_like_time(value: str) -> bool:
    """An ISO 8601 time (``2026-01-02T03:04:05…``)."""
    return len(value) >= 19 and value[4:5] == "-" and value[10:11] == "T"


def _kv(value: Any) -> str:
    """``key=value, ...`` of a mapping, leaving out unset (null) entries."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={_shown_value(str(k), v)}" for k, v in value.items() if v is not None)
    return str(value)


def job_dataset_ids(job: Job) -> list[str]:
    """The ids of the datasets a job names: training and validation, an evaluation's
    dataset, a script job's inputs."""
    inputs = (job.model_extra or {}).get("inputs")
    found = [job.train_dataset, job.validation_dataset, job.dataset]
    if isinstance(inputs, dict):
        found += list(inputs.values())
    return [i for i in found if isinstance(i, str) and i]


def print_job(job: Job, datasets: Mapping[str, str] | None = None) -> None:
    """What ``show`` prints; ``datasets`` names the datasets by id (else ids are shown)."""
    names = datasets or {}
    print(f"id:          {job.id}")
    print(f"name:        {job.name}")
    print(f"status:      {job.status}")
    _print_labels(job)
    if job.type == JobKind.SCRIPT:
        _print_script(job, names)
    elif job.type == JobKind.EVALUATE:
        print(f"model:       {job.model}")
        print(f"dataset:     {dataset_text(job.dataset, names)}")
    else:
        _print_train(job, names)
    print(f"resources:   {_kv(job.resources)}")
    _print_tracking(job)
    _print_outcome(job)
    _print_attempts(job)
    _print_times(job)


def _print_labels(job: Job) -> None:
    """The tags, the note, why the job waits and how it failed, those it has."""
    if job.tags:
        print(f"tags:        {', '.join(job.tags)}")
    if job.note:
        print("note:        " + job.note.rstrip().replace("\n", "\n             "))
    if job.reason:
        print(f"waiting:     {job.reason}")
    if job.failure is not None:
        _print_failure(job.failure)


def _print_script(job: Job, names: Mapping[str, str]) -> None:
    extra = job.model_extra or {}
    print(f"type:        script, {(extra.get('distribution') or {}).get('launch', 'per_process')}")
    print(f"code:        {job.code}")
    print(f"command:     {shlex.join(job.command or [])}")
    if extra.get("inputs"):
        inputs = ", ".join(f"{k}={dataset_text(v, names)}" for k, v in extra["inputs"].items())
        print(f"inputs:      {inputs}")
    if job.outputs_sha256:
        print(f"outputs:     sha256 {job.outputs_sha256} ({human_bytes(job.outputs_size or 0)})")


def _print_train(job: Job, names: Mapping[str, str]) -> None:
    print(f"model:       {_kv(job.model)}")
    print(
        f"datasets:    train {dataset_text(job.train_dataset, names)}, "
        f"validation {dataset_text(job.validation_dataset, names)}"
    )
    print(f"parameters:  {_kv(job.parameters)}")
    # The rate the trainer runs at: scaled by the processes, after the warm-up.
    print(f"lr schedule: {describe_schedule(job.parameters, job.resources)}")


def _tracking_value(value: Any) -> str:
    text = " ".join(str(value).splitlines())
    return text if len(text) <= TRACKING_VALUE_CHARS else text[: TRACKING_VALUE_CHARS - 1] + "…"


def _print_tracking(job: Job) -> None:
    """A script job's MLflow runs: each with its rank, status and experiment (and attempt,
    after a restart), then its params and tags, one a line (MLflow's own ``mlflow.*`` tags
    left out)."""
    runs = [r for r in (job.tracking or {}).get("runs") or [] if isinstance(r, dict)]
    if not runs:
        return
    restarted = len({r.get("attempt") for r in runs}) > 1
    print("mlflow runs:")
    for run in runs:
        _print_run(run, restarted=restarted)


def _print_run(run: dict[str, Any], *, restarted: bool) -> None:
    about = [
        f"rank {run.get('rank', 0)}",
        str(run.get("status", "")).lower(),
        f"experiment {run.get('experiment')}",
    ]
    if restarted:
        about.append(f"attempt {run.get('attempt')}")
    print(f"  {run.get('name') or run.get('id')}  ({', '.join(a for a in about if a)})")
    rows = _run_rows(run)
    if not rows:
        print("    no params or tags")
        return
    key_width = max(len(k) for _, k, _ in rows)
    for what, key, value in rows:
        print(f"    {what:<5}  {key.ljust(key_width)}  {value}".rstrip())


def _run_rows(run: dict[str, Any]) -> list[tuple[str, str, str]]:
    """A run's params, then its tags (not MLflow's own), each cut to a line."""
    params = sorted((run.get("params") or {}).items())
    tags = sorted((k, v) for k, v in (run.get("tags") or {}).items() if not k.startswith("mlflow."))
    return [("param", k, _tracking_value(v)) for k, v in params] + [
        ("tag", k, _tracking_value(v)) for k, v in tags
    ]


def _print_attempts(job: Job) -> None:
    """Restarts used and one line per attempt: nodes, times and why it ended."""
    limit = job.resources.get("max_restarts")
    if job.restarts or (job.attempts and len(job.attempts) > 1):
        print(f"restarts:    {job.restarts}" + (f" of {limit}" if limit is not None else ""))
    if not job.attempts:
        return
    print("attempts:")
    for attempt in job.attempts:
        print(_attempt_line(attempt))


def _attempt_line(a: Attempt) -> str:
    times = " -> ".join(format_time(t) for t in (a.started_at or a.created_at, a.finished_at) if t)
    ended = f"  {a.end_reason.code}: {a.end_reason.message}" if a.end_reason else ""
    return f"  #{a.number}  {a.status:<9}  on {', '.join(a.nodes) or '-'}  {times}{ended}"


def _print_failure(failure: Failure) -> None:
    where = ", ".join(
        f"{k} {v}" for k, v in (("rank", failure.rank), ("node", failure.node)) if v is not None
    )
    print(f"failure:     {failure.code}: {failure.message}" + (f" [{where}]" if where else ""))
    if failure.traceback:
        print("traceback:\n  " + failure.traceback.rstrip().replace("\n", "\n  "))


_PROGRESS_KEYS = {
    "epoch",
    "epochs",
    "step",
    "total_steps",
    "fraction",
    "attempt",
    "time",
    "eta_s",
    "steps_per_s",
}


def _progress_line(progress: dict[str, Any]) -> str:
    """``epoch 3/5, step 120/200 (60.0%), attempt 1, at 2026-01-02 03:04:05``: what of the
    progress a job reported is known."""
    parts = [_epoch_part(progress), _step_part(progress)]
    if isinstance(progress.get("eta_s"), int | float):
        parts.append(f"ETA {format_duration(progress['eta_s'])}")
    if progress.get("attempt") is not None:
        parts.append(f"attempt {progress['attempt']}")
    if progress.get("time"):
        parts.append(f"at {_shown_value('time', progress['time'])}")
    rest = {k: v for k, v in progress.items() if k not in _PROGRESS_KEYS}
    known = [p for p in parts if p]
    return ", ".join(known + ([_kv(rest)] if rest else [])) or "-"


def _epoch_part(progress: dict[str, Any]) -> str:
    epoch, epochs = progress.get("epoch"), progress.get("epochs")
    if epoch is None:
        return ""
    return f"epoch {epoch}" + (f"/{epochs}" if epochs else "")


def _step_part(progress: dict[str, Any]) -> str:
    step, total = progress.get("step"), progress.get("total_steps")
    if step is None:
        return ""
    fraction = progress.get("fraction")
    shown = f" ({fraction:.1%})" if isinstance(fraction, int | float) else ""
    return f"step {step}" + (f"/{total}" if total else "") + shown


def _print_outcome(job: Job) -> None:
    """Progress, timing, best metrics, nodes and the model directory, those the job has."""
    if job.progress and any(v is not None for v in job.progress.values()):
        print(f"progress:    {_progress_line(job.progress)}")
    fraction = (job.progress or {}).get("fraction")
    timing = job_timing(
        job.started_at, job.finished_at, fraction if isinstance(fraction, int | float) else None
    )
    if timing:
        print(f"time:        {timing}")
    if job.best:
        print(f"best:        {_kv(job.best)}")
    if job.nodes:
        print(f"nodes:       {', '.join(job.nodes)}")
    if job.model_sha256:
        size = f" ({human_bytes(job.model_size)})" if job.model_size else ""
        print(f"model dir:   sha256 {job.model_sha256}{size}")


def _print_times(job: Job) -> None:
    print(f"created:     {format_time(job.created_at)}")
    if job.started_at:
        print(f"started:     {format_time(job.started_at)}")
    if job.finished_at:
        print(f"finished:    {format_time(job.finished_at)}")
    if job.history:
        print("history:")
        for change in job.history:
            print(
                f"  {format_time(change.at)}  {change.status}"
                + (f"  {change.message}" if change.message else "")
            )


def _show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.get_job(args.id)
        if args.json:
            _print_json(job)
            return 0
        names = dataset_names(client, job_dataset_ids(job))
    print_job(job, names)
    return 0


def add_show(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``show``."""
    show_job = sub.add_parser("show", parents=[common], help="a job's status, progress, failure and history")
    show_job.add_argument("id", metavar="JOB", help=_JOB_HELP)
    show_job.set_defaults(handler=_show)
