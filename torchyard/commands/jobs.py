"""The job commands: ``submit``, ``jobs``, ``show``, ``delete``, ``tag``, ``note``, ``clone``,
``cancel`` and ``download``."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchyard.apiclient.models import Failure
from torchyard.client import Client, Job
from torchyard.commands.common import (
    _JOB_HELP,
    _answer,
    _client,
    _note,
    _print_json,
    _resolve_datasets,
    dataset_names,
    dataset_text,
    load_spec,
    parse_value,
    set_path,
)
from torchyard.contract.archive import (
    MAX_OUTPUTS_FILES,
    MAX_OUTPUTS_UNCOMPRESSED_BYTES,
    ExtractionLimits,
    extract_archive,
)
from torchyard.contract.errors import InvalidDatasetError, TorchyardError
from torchyard.contract.jobspec import JobKind
from torchyard.terminal import (
    LiveProgress,
    ProgressBar,
    format_table,
    format_time,
    human_bytes,
    job_timing,
)

# Handy submit flags: (flag, spec path, type, help).
_SUBMIT_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--arch", "model.architecture", str, "torchvision architecture, e.g. resnet18"),
    ("--init-from-job", "model.init_from_job", str, "fine-tune from a succeeded job's model"),
    ("--epochs", "parameters.epochs", int, "passes over the training set"),
    ("--batch-size", "parameters.batch_size", int, "images per batch per process"),
    ("--warmup-epochs", "parameters.warmup_epochs", int, "epochs of linear warm-up"),
    ("--lr", "parameters.learning_rate", float, "initial learning rate"),
    ("--seed", "parameters.random_seed", int, "random seed"),
    ("--patience", "parameters.patience", int, "early-stopping patience (epochs)"),
    ("--print-frequency", "parameters.print_frequency", int, "a training log line every N iterations"),
    ("--image-size", "parameters.image_size", int, "training/eval crop size (16..1024)"),
    ("--augmentation", "parameters.augmentation", str, "standard, light or none"),
    ("--nodes", "resources.node_count", int, "nodes to train on"),
    ("--procs", "resources.process_count_per_node", int, "processes (ranks) per node"),
    ("--max-runtime", "resources.max_runtime_s", int, "seconds the job may run before TimeoutError"),
    ("--max-restarts", "resources.max_restarts", int, "restarts after retryable failures (0..100)"),
    ("--hang-timeout", "resources.hang_timeout_s", int, "seconds without a training step before HangError"),
    ("--priority", "priority", int, "higher runs first (-100..100)"),
)


def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The spec file, then the handy flags, then ``--set`` overrides (most explicit wins)."""
    spec = load_spec(args.spec) if args.spec else {}
    if args.name is not None:
        spec["name"] = args.name
    if args.train is not None:
        spec["train_dataset"] = args.train
    if args.val is not None:
        spec["validation_dataset"] = args.val
    if args.pretrained:
        set_path(spec, "model.pretrained", True)
    for flag, dotted, _type, _help in _SUBMIT_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            set_path(spec, dotted, value)
    for item in args.set or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        set_path(spec, key.strip(), parse_value(raw))
    return spec


def follow_job(client: Client, job: Job, *, show_logs: bool = False, out: Any = None) -> Job:
    """Print a job's live progress until it ends; return the final job."""
    progress = LiveProgress(
        out,
        show_logs=show_logs,
        epochs=job.parameters.get("epochs"),
        by="epoch" if job.type == JobKind.TRAIN else None,
    )
    for event in client.events(job.id, logs=show_logs, ranks=[0] if show_logs else None):
        progress.handle(event.kind, event.data)
    return client.get_job(job.id)


def _submit(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    with _client(args) as client:
        _resolve_datasets(client, spec)
        if args.dry_run:
            _print_json(spec)
            return 0
        job = client.submit_job(spec)
        if args.json and not args.follow:
            _print_json(job)
            return 0
        print(job.id)
        what = (
            job.model.get("architecture")
            if isinstance(job.model, dict) and job.type == JobKind.TRAIN
            else f"{job.type} job"
        )
        _note(f"submitted job {job.name!r} ({what}), status {job.status}")
        if not args.follow:
            _note(f"follow it with: torchyard logs {job.id} -f   or   torchyard metrics {job.id} --watch")
            return 0
        final = follow_job(client, job, show_logs=args.logs, out=sys.stderr if args.json else None)
    if args.json:
        _print_json(final)
    return 0 if final.status == "succeeded" else 1


def _progress_text(job: Job) -> str:
    progress = job.progress or {}
    epoch, epochs = progress.get("epoch"), progress.get("epochs") or job.parameters.get("epochs")
    if epoch is None:
        return "-"
    return f"epoch {epoch}/{epochs}" if epochs else f"epoch {epoch}"


def _best_top1(job: Job) -> str:
    best = job.best or {}
    value = best.get("val.top1", best.get("top1"))
    return f"{float(value):.2%}" if isinstance(value, int | float) else "-"


# The widest the TAGS column of ``torchyard jobs`` gets: more is cut short with "…".
TAGS_WIDTH = 24


def tags_text(tags: list[str], width: int = TAGS_WIDTH) -> str:
    """A job's tags for a table column: ``a,b,c``, cut short with ``…`` past ``width``."""
    text = ",".join(tags)
    return text if len(text) <= width else text[: width - 1] + "…"


def _jobs(args: argparse.Namespace) -> int:
    filters: dict[str, Any] = {"status": args.status, "tag": args.tag, "sweep": args.sweep}
    with _client(args) as client:
        if args.all:
            items = list(client.iter_jobs(**filters))
        else:
            items = client.list_jobs(limit=args.limit, **filters).items
    if args.json:
        _print_json(items)
        return 0
    rows = [
        (
            j.id,
            j.name,
            j.status,
            _progress_text(j),
            _best_top1(j),
            tags_text(j.tags) or "-",
            format_time(j.created_at),
        )
        for j in items
    ]
    print(format_table(["ID", "NAME", "STATUS", "PROGRESS", "BEST TOP-1", "TAGS", "CREATED"], rows))
    return 0


_PERCENT_KEYS = ("top1", "top5", "accuracy")


def _shown_value(key: str, value: Any) -> str:
    """One value as ``show`` prints it: accuracies as %, other floats to 4 significant
    digits, times to the second in local time, booleans and lists as written in a spec."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if key.rsplit(".", 1)[-1] in _PERCENT_KEYS and 0.0 <= value <= 1.0:
            return f"{value:.2%}"
        return f"{value:.4g}"
    if isinstance(value, str) and len(value) >= 19 and value[4:5] == "-" and value[10:11] == "T":
        try:
            return format_time(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return "[" + ", ".join(_shown_value(key, v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + _kv(value) + "}"
    return str(value)


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
    if job.tags:
        print(f"tags:        {', '.join(job.tags)}")
    if job.note:
        print("note:        " + job.note.rstrip().replace("\n", "\n             "))
    if job.reason:
        print(f"waiting:     {job.reason}")
    if job.failure is not None:
        _print_failure(job.failure)
    if job.type == JobKind.SCRIPT:
        extra = job.model_extra or {}
        print(f"type:        script, {(extra.get('distribution') or {}).get('launch', 'per_process')}")
        print(f"code:        {job.code}")
        print(f"command:     {shlex.join(job.command or [])}")
        if extra.get("inputs"):
            inputs = ", ".join(f"{k}={dataset_text(v, names)}" for k, v in extra["inputs"].items())
            print(f"inputs:      {inputs}")
        if job.outputs_sha256:
            print(f"outputs:     sha256 {job.outputs_sha256} ({human_bytes(job.outputs_size or 0)})")
    elif job.type == JobKind.EVALUATE:
        print(f"model:       {job.model}")
        print(f"dataset:     {dataset_text(job.dataset, names)}")
    else:
        print(f"model:       {_kv(job.model)}")
        print(
            f"datasets:    train {dataset_text(job.train_dataset, names)}, "
            f"validation {dataset_text(job.validation_dataset, names)}"
        )
        print(f"parameters:  {_kv(job.parameters)}")
    print(f"resources:   {_kv(job.resources)}")
    _print_tracking(job)
    _print_outcome(job)
    _print_attempts(job)
    _print_times(job)


# The longest param or tag value ``show`` prints whole (``--json`` has every value whole).
TRACKING_VALUE_CHARS = 100


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
    attempts = {r.get("attempt") for r in runs}
    print("mlflow runs:")
    for run in runs:
        about = [
            f"rank {run.get('rank', 0)}",
            str(run.get("status", "")).lower(),
            f"experiment {run.get('experiment')}",
        ]
        if len(attempts) > 1:
            about.append(f"attempt {run.get('attempt')}")
        print(f"  {run.get('name') or run.get('id')}  ({', '.join(a for a in about if a)})")
        params = sorted((run.get("params") or {}).items())
        tags = sorted((k, v) for k, v in (run.get("tags") or {}).items() if not k.startswith("mlflow."))
        rows = [("param", k, _tracking_value(v)) for k, v in params] + [
            ("tag", k, _tracking_value(v)) for k, v in tags
        ]
        if not rows:
            print("    no params or tags")
            continue
        key_width = max(len(k) for _, k, _ in rows)
        for what, key, value in rows:
            print(f"    {what:<5}  {key.ljust(key_width)}  {value}".rstrip())


def _print_attempts(job: Job) -> None:
    """Restarts used and one line per attempt: nodes, times and why it ended."""
    limit = job.resources.get("max_restarts")
    if job.restarts or (job.attempts and len(job.attempts) > 1):
        print(f"restarts:    {job.restarts}" + (f" of {limit}" if limit is not None else ""))
    if not job.attempts:
        return
    print("attempts:")
    for a in job.attempts:
        times = " -> ".join(format_time(t) for t in (a.started_at or a.created_at, a.finished_at) if t)
        ended = f"  {a.end_reason.code}: {a.end_reason.message}" if a.end_reason else ""
        print(f"  #{a.number}  {a.status:<9}  on {', '.join(a.nodes) or '-'}  {times}{ended}")


def _print_failure(failure: Failure) -> None:
    where = ", ".join(
        f"{k} {v}" for k, v in (("rank", failure.rank), ("node", failure.node)) if v is not None
    )
    print(f"failure:     {failure.code}: {failure.message}" + (f" [{where}]" if where else ""))
    if failure.traceback:
        print("traceback:\n  " + failure.traceback.rstrip().replace("\n", "\n  "))


def _progress_line(progress: dict[str, Any]) -> str:
    """``epoch 3/5, step 120/200 (60.0%), attempt 1, at 2026-01-02 03:04:05``: what of the
    progress a job reported is known."""
    parts = []
    epoch, epochs = progress.get("epoch"), progress.get("epochs")
    if epoch is not None:
        parts.append(f"epoch {epoch}" + (f"/{epochs}" if epochs else ""))
    step, total = progress.get("step"), progress.get("total_steps")
    if step is not None:
        fraction = progress.get("fraction")
        shown = f" ({fraction:.1%})" if isinstance(fraction, int | float) else ""
        parts.append(f"step {step}" + (f"/{total}" if total else "") + shown)
    if progress.get("attempt") is not None:
        parts.append(f"attempt {progress['attempt']}")
    if progress.get("time"):
        parts.append(f"at {_shown_value('time', progress['time'])}")
    known = {"epoch", "epochs", "step", "total_steps", "fraction", "attempt", "time"}
    rest = {k: v for k, v in progress.items() if k not in known}
    return ", ".join(parts + ([_kv(rest)] if rest else [])) or "-"


def _print_outcome(job: Job) -> None:
    """Progress, timing, best metrics, nodes and the model directory, those the job has."""
    if job.progress:
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


def _delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        deleted = client.delete_job(args.id)
    return _answer(
        args,
        deleted,
        f"deleted job {deleted['id']} ({deleted['name']}): its metrics, logs, checkpoints and files",
    )


def _tag(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.get_job(args.id)
        tags = list(job.tags)
        if args.remove:
            missing = [t for t in args.tags if t not in tags]
            if missing:
                raise ValueError(f"job {job.id} has no tag {', '.join(map(repr, missing))}")
            tags = [t for t in tags if t not in args.tags]
        else:
            tags += [t for t in args.tags if t not in tags]
        job = client.update_job(job.id, tags=tags)
    return _answer(args, job, f"{job.id} tags: {', '.join(job.tags) or '-'}")


def _note_command(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.update_job(args.id, note=args.text or None)
    return _answer(args, job, f"{job.id} note: {job.note or '-'}")


def _clone(args: argparse.Namespace) -> int:
    with _client(args) as client:
        source = client.get_job(args.id)
        job = client.clone_job(source.id)
        if args.json and not args.follow:
            _print_json(job)
            return 0
        print(job.id)
        _note(f"submitted job {job.name!r} again as {job.id}, status {job.status}")
        if not args.follow:
            return 0
        final = follow_job(client, job, out=sys.stderr if args.json else None)
    if args.json:
        _print_json(final)
    return 0 if final.status == "succeeded" else 1


def _cancel(args: argparse.Namespace) -> int:
    """Cancel a job; one that had already ended is left as it is, said on stderr, and is
    no failure (exit status 0), as with ``sweep cancel``."""
    with _client(args) as client:
        before = client.get_job(args.id)
        job = client.cancel_job(before.id)
        if args.wait and not job.is_final:
            job = client.wait(job.id)
    if before.is_final and before.status != "cancelled":
        _note(f"job {job.id} had already ended ({job.status}): there was nothing to cancel")
    return _answer(args, job, f"{job.id} {job.status}")


# ``download --outputs -o NAME``: a NAME with one of these endings is the archive itself.
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")


def unpack_outputs(archive: Path, target: Path) -> Path:
    """Unpack a downloaded outputs archive into the new folder ``target``: regular files and
    folders only, every member inside it (no link, no absolute path or ``..``), within the
    outputs' limits; on any refusal nothing is left. A folder appears whole or not at all."""
    limits = ExtractionLimits(max_bytes=MAX_OUTPUTS_UNCOMPRESSED_BYTES, max_files=MAX_OUTPUTS_FILES)
    try:
        unpacked = extract_archive(archive, target.parent, limits)
    except InvalidDatasetError as exc:  # the archive's checks speak of datasets
        raise TorchyardError(f"the outputs archive was not unpacked: {exc.message}") from exc
    try:
        if target.is_dir():
            target.rmdir()  # empty: checked before the download
        os.replace(unpacked, target)
    except OSError:
        shutil.rmtree(unpacked, ignore_errors=True)
        raise
    mask = os.umask(0)
    os.umask(mask)
    target.chmod(0o777 & ~mask)  # made under a temporary name, private until now
    return target


def _download_outputs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.get_job(args.id)
        if args.path:  # one file of the outputs, as it is
            out = Path(args.output) if args.output else Path(Path(args.path).name)
            path = client.download_outputs(job.id, out, path=args.path)
            return _answer(args, {"job": job.id, "path": str(path), "sha256": job.outputs_sha256}, path)
        out = Path(args.output) if args.output else Path(f"outputs-{job.id}")
        if out.name.endswith(ARCHIVE_SUFFIXES):  # the archive as the service keeps it
            path = client.download_outputs(job.id, out)
            return _answer(args, {"job": job.id, "path": str(path), "sha256": job.outputs_sha256}, path)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"{out} already exists and is not empty")
        archive = client.download_outputs(job.id, out.with_name(out.name + ".tar.gz"))
    try:
        path = unpack_outputs(archive, out)
    finally:
        if not args.keep_archive:
            archive.unlink(missing_ok=True)
    return _answer(args, {"job": job.id, "path": str(path), "sha256": job.outputs_sha256}, path)


def _download(args: argparse.Namespace) -> int:
    if args.outputs or args.path:
        return _download_outputs(args)
    with _client(args) as client:
        job = client.get_job(args.id)  # the full id, whatever the user typed
        out = Path(args.output) if args.output else Path(f"model-{job.id}")
        bar = ProgressBar(f"model {job.id[:12]}")
        try:
            path = client.download_model(
                job.id,
                out,
                progress=bar,
                keep_archive=args.keep_archive,
                on_resume=lambda n: _note(f"resuming the download at byte {n}"),
            )
        finally:
            bar.finish()
        job = client.get_job(job.id)
    if args.json:
        _print_json({"job": job.id, "path": str(path), "sha256": job.model_sha256, "verified": True})
    else:
        print(path)
        _note(
            f"model directory verified (sha256 {job.model_sha256}); load it with torchyard.modeldir.load_model"
        )
    return 0


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The job commands."""
    submit = sub.add_parser(
        "submit",
        parents=[common],
        help="submit a training job from a YAML/JSON spec, with flag overrides",
        description="Submit a job. Fields come from SPEC, then the flags below, then --set KEY=VALUE "
        "(e.g. --set parameters.epochs=3). Dataset fields accept an id or a dataset name.",
    )
    submit.add_argument("spec", nargs="?", help="job spec file (.yaml, .yml or .json; - for stdin)")
    submit.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a spec field by its dotted path"
    )
    submit.add_argument("--name", help="job name")
    submit.add_argument("--train", help="training dataset (id or name)")
    submit.add_argument("--val", help="validation dataset (id or name)")
    submit.add_argument(
        "--pretrained", action="store_true", default=None, help="start from offline pretrained weights"
    )
    for flag, _dotted, kind, text in _SUBMIT_FLAGS:
        submit.add_argument(flag, type=kind, default=None, help=text)
    submit.add_argument("--follow", "-f", action="store_true", help="show live progress until the job ends")
    submit.add_argument("--logs", action="store_true", help="with --follow: also print rank 0's log")
    submit.add_argument("--dry-run", action="store_true", help="print the spec that would be sent")
    submit.set_defaults(handler=_submit)

    jobs = sub.add_parser("jobs", parents=[common], help="list jobs, newest first")
    jobs.add_argument("--status", action="append", help="only jobs with this status (repeatable)")
    jobs.add_argument(
        "--tag", action="append", help="only jobs with this tag (repeatable: jobs with every one of them)"
    )
    jobs.add_argument(
        "--sweep", metavar="SWEEP", help="only the trials of this sweep (id, name or id prefix)"
    )
    jobs.add_argument("--limit", type=int, default=50)
    jobs.add_argument("--all", action="store_true", help="every page")
    jobs.set_defaults(handler=_jobs)

    show_job = sub.add_parser("show", parents=[common], help="a job's status, progress, failure and history")
    show_job.add_argument("id", metavar="JOB", help=_JOB_HELP)
    show_job.set_defaults(handler=_show)

    delete_job = sub.add_parser(
        "delete",
        parents=[common],
        help="delete a finished job with its metrics, logs, checkpoints, model directory and outputs",
        description="Delete a finished job: its metrics, logs, checkpoints, model directory and outputs "
        "go. A job that has not ended is refused (cancel it first), and so is one whose model is a "
        "registered model version (delete the version first).",
    )
    delete_job.add_argument("id", metavar="JOB", help=_JOB_HELP)
    delete_job.set_defaults(handler=_delete)

    tag = sub.add_parser("tag", parents=[common], help="add tags to a job (or --remove them)")
    tag.add_argument("id", metavar="JOB", help=_JOB_HELP)
    tag.add_argument("tags", nargs="+", metavar="TAG", help="a label without spaces or commas")
    tag.add_argument("--remove", action="store_true", help="remove these tags instead")
    tag.set_defaults(handler=_tag)

    note = sub.add_parser("note", parents=[common], help="set a job's note (an empty TEXT clears it)")
    note.add_argument("id", metavar="JOB", help=_JOB_HELP)
    note.add_argument("text", metavar="TEXT", help="free text, up to 10,000 characters")
    note.set_defaults(handler=_note_command)

    clone = sub.add_parser(
        "clone",
        aliases=["resubmit"],
        parents=[common],
        help="submit a job's spec again as a new job",
        description="Submit a job's spec again as a new job (any status): same model, datasets, "
        "parameters and resources, or for a script job the same code, command and inputs.",
    )
    clone.add_argument("id", metavar="JOB", help=_JOB_HELP)
    clone.add_argument("--follow", "-f", action="store_true", help="show live progress until the job ends")
    clone.set_defaults(handler=_clone)

    cancel = sub.add_parser(
        "cancel",
        parents=[common],
        help="cancel a job (idempotent; a job that had already ended is said so, exit status 0)",
    )
    cancel.add_argument("id", metavar="JOB", help=_JOB_HELP)
    cancel.add_argument("--wait", action="store_true", help="wait until the job is cancelled")
    cancel.set_defaults(handler=_cancel)
    download = sub.add_parser(
        "download",
        parents=[common],
        help="download, verify and unpack a succeeded job's model directory (or a script job's outputs)",
        description="Download a job's model directory, or with --outputs a script job's outputs "
        "folder: checked against its sha256 and unpacked into a new directory (-o). With --outputs, "
        "an -o ending in .tar.gz or .tgz is the archive itself, not unpacked; --path gets one file.",
    )
    download.add_argument("id", metavar="JOB", help=_JOB_HELP)
    download.add_argument(
        "-o",
        "--output",
        help="directory to create (default: ./model-<job id>, with --outputs ./outputs-<job id>); "
        "with --outputs, NAME.tar.gz or NAME.tgz keeps the archive as it is instead",
    )
    download.add_argument("--keep-archive", action="store_true", help="keep the .tar.gz beside the directory")
    download.add_argument(
        "--outputs", action="store_true", help="a script job's outputs folder instead of a model"
    )
    download.add_argument("--path", help="with --outputs: only this file of the outputs, as it is")
    download.set_defaults(handler=_download)
