"""The user commands of ``torchyard``: datasets, jobs, logs, metrics, models and the cluster.

Each command talks to the API through :class:`torchyard.client.Client`. The URL and
token come from ``--url``/``--token``, then ``TORCHYARD_URL``/``TORCHYARD_TOKEN``, then
a local service's data directory (``TORCHYARD_DATA_DIR`` or ``./torchyard-data``,
whose ``admin.token`` the local user never has to copy). Every command accepts
``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

from torchyard.apiclient.models import Failure
from torchyard.apiclient.registry import ModelVersion, parse_model_ref
from torchyard.client import Client, Event, Job, JobComparison, MetricPoint, missing_token_message
from torchyard.contract.errors import AuthenticationError, ConflictError
from torchyard.contract.jobspec import JobKind
from torchyard.extras import require
from torchyard.terminal import (
    EpochLines,
    EpochTable,
    LiveProgress,
    ProgressBar,
    describe_status,
    format_duration,
    format_table,
    format_time,
    human_bytes,
    job_timing,
    timing_text,
)

Handler = Callable[[argparse.Namespace], int]

log = logging.getLogger(__name__)

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


_JOB_HELP = "the job's id, name or id prefix (at least 4 characters)"
_DATASET_HELP = "the dataset's id, name or id prefix (at least 4 characters)"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``--since``: a duration before now (``90s``, ``10m``, ``2h``, ``1d``) or an ISO 8601
    time (without a zone: local time)."""
    value = text.strip()
    unit = value[-1:].lower()
    if unit in _DURATION_UNITS and value[:-1].replace(".", "", 1).isdigit():
        now = now or datetime.now(UTC)
        return now - timedelta(seconds=float(value[:-1]) * _DURATION_UNITS[unit])
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a duration such as 10m, 2h or 1d, or an ISO 8601 time, got {text!r}"
        ) from None
    return when if when.tzinfo else when.astimezone()


def _client(args: argparse.Namespace) -> Client:
    client = Client(args.url, args.token)
    if client.token is None:
        client.close()
        raise AuthenticationError(missing_token_message())
    return client


def _print_json(value: Any) -> None:
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if hasattr(v, "model_dump") else v for v in value]
    print(json.dumps(value, indent=2, sort_keys=False))


def _note(text: str) -> None:
    """A message for the person at the terminal (stderr, so stdout stays clean for pipes)."""
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- datasets


def _datasets_upload(args: argparse.Namespace) -> int:
    if len(args.source) == 2:  # `datasets upload NAME PATH`
        if args.name is not None:
            raise ValueError("give the dataset name once: as NAME or as --name")
        args.name, args.source = args.source[0], args.source[1:]
    if len(args.source) > 2 or bool(args.source) == (args.path is not None):
        raise ValueError(
            "give [NAME] PATH of a folder or archive to upload, or --path PATH to register shared storage"
        )
    args.source = args.source[0] if args.source else None
    with _client(args) as client:
        if args.path is not None:
            name = args.name or Path(args.path).name
            dataset = client.register_dataset(
                name, args.path, **({"sample": args.sample} if args.sample else {})
            )
        else:
            source = Path(args.source)
            if not source.exists():
                raise FileNotFoundError(f"no such file or folder: {source}")
            client.whoami()  # the service and the token, before a large folder is packed
            _check_name(client, args, source)
            bar = ProgressBar(f"uploading {source.name}")
            if source.is_dir() and not args.json:
                _note(f"packing {source} ...")
            try:
                dataset = client.upload_dataset(source, args.name, progress=bar)
            finally:
                bar.finish()
            if args.replace:
                _replace_older(client, dataset)
    if args.json:
        _print_json(dataset)
    else:
        print(dataset.id)
        _note(
            f"dataset {dataset.name!r}: {dataset.num_images} images in {len(dataset.classes)} classes "
            f"({human_bytes(dataset.size_bytes)}), sha256 {dataset.sha256[:12]}"
        )
    return 0


def _same_name(client: Client, name: str) -> list[Any]:
    return [d for d in client.iter_datasets() if d.name == name]


def _check_name(client: Client, args: argparse.Namespace, source: Path) -> None:
    """Say so before an upload adds a second dataset of a name (``--replace`` removes the
    older ones once the new one is stored)."""
    name = args.name or source.name.split(".")[0] or "dataset"
    existing = _same_name(client, name)
    if existing and not args.replace:
        ids = ", ".join(d.id for d in existing)
        _note(
            f"note: a dataset named {name!r} exists already ({ids}); this upload adds another one of "
            "that name (jobs and --train/--val take the newest). Use --replace to delete the older "
            "one(s) once this upload is stored."
        )


def _replace_older(client: Client, dataset: Any) -> None:
    for older in _same_name(client, dataset.name):
        if older.id == dataset.id:
            continue
        try:
            client.delete_dataset(older.id)
            _note(f"replaced: deleted the older dataset {older.id} of the name {dataset.name!r}")
        except ConflictError as exc:
            _note(f"kept the older dataset {older.id}: {exc.message}")


def _datasets_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        items = list(client.iter_datasets()) if args.all else client.list_datasets(limit=args.limit).items
    if args.json:
        _print_json(items)
        return 0
    rows = [
        (
            d.id,
            d.name,
            d.source or "-",
            len(d.classes),
            d.num_images,
            human_bytes(d.size_bytes),
            format_time(d.created_at),
        )
        for d in items
    ]
    print(format_table(["ID", "NAME", "SOURCE", "CLASSES", "IMAGES", "SIZE", "CREATED"], rows))
    return 0


def _datasets_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        dataset = client.get_dataset(args.id)
    if args.json:
        _print_json(dataset)
        return 0
    extra = dataset.model_extra or {}
    print(f"id:       {dataset.id}")
    print(f"name:     {dataset.name}")
    print(f"source:   {dataset.source}" + (f" ({extra['path']})" if extra.get("path") else ""))
    print(f"images:   {dataset.num_images} ({human_bytes(dataset.size_bytes)})")
    print(f"sha256:   {dataset.sha256}")
    print(f"created:  {format_time(dataset.created_at)}")
    print(f"classes:  {len(dataset.classes)}")
    print(format_table(["CLASS", "IMAGES"], [(c, dataset.class_counts.get(c, 0)) for c in dataset.classes]))
    return 0


def _datasets_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_dataset(args.id)
    if args.json:
        _print_json({"id": args.id, "deleted": True})
    else:
        _note(f"deleted dataset {args.id}")
    return 0


# --------------------------------------------------------------------------- submit


def parse_value(text: str) -> Any:
    """A ``--set`` value: JSON when it parses (numbers, true/false, null, lists), else text."""
    try:
        return json.loads(text)
    except ValueError:
        lowered = text.strip().lower()
        if lowered in ("true", "yes", "on"):
            return True
        if lowered in ("false", "no", "off"):
            return False
        return text


def set_path(spec: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``spec["a"]["b"] = value`` for ``"a.b"``, creating the levels in between."""
    parts = dotted.split(".")
    if not all(parts):
        raise ValueError(f"bad field path {dotted!r}")
    node = spec
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{dotted}: {part!r} is not an object in the spec")
        node = child
    node[parts[-1]] = value


def load_spec(path: str) -> dict[str, Any]:
    """A job spec from a .yaml/.yml/.json file (``-`` reads standard input)."""
    import yaml

    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    try:
        spec = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from exc
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a job spec must be a mapping")
    return spec


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


def _resolve_datasets(client: Client, spec: dict[str, Any]) -> None:
    """Dataset fields may name a dataset (or give a unique id prefix) instead of its id;
    so may ``model.init_from_job`` for the job."""
    for key in ("train_dataset", "validation_dataset"):
        ref = spec.get(key)
        if isinstance(ref, str) and ref:
            spec[key] = client.find_dataset(ref).id
    inputs = spec.get("inputs")
    if isinstance(inputs, dict):  # a script job's input datasets
        for name, ref in inputs.items():
            if isinstance(ref, str) and ref:
                inputs[name] = client.find_dataset(ref).id
    model = spec.get("model")
    if isinstance(model, dict) and isinstance(model.get("init_from_job"), str) and model["init_from_job"]:
        model["init_from_job"] = client.get_job(model["init_from_job"]).id


def follow_job(client: Client, job: Job, *, show_logs: bool = False, out: Any = None) -> Job:
    """Print a job's live progress until it ends; return the final job."""
    progress = LiveProgress(out, show_logs=show_logs, epochs=job.parameters.get("epochs"))
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


# --------------------------------------------------------------------------- jobs


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


def _jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.all:
            items = list(client.iter_jobs(status=args.status))
        else:
            items = client.list_jobs(status=args.status, limit=args.limit).items
    if args.json:
        _print_json(items)
        return 0
    rows = [
        (j.id, j.name, j.status, _progress_text(j), _best_top1(j), format_time(j.created_at)) for j in items
    ]
    print(format_table(["ID", "NAME", "STATUS", "PROGRESS", "BEST TOP-1", "CREATED"], rows))
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


def print_job(job: Job) -> None:
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
            print(f"inputs:      {_kv(extra['inputs'])}")
        if job.outputs_sha256:
            print(f"outputs:     sha256 {job.outputs_sha256} ({human_bytes(job.outputs_size or 0)})")
    else:
        print(f"model:       {_kv(job.model)}")
        print(f"datasets:    train {job.train_dataset}, validation {job.validation_dataset}")
        print(f"parameters:  {_kv(job.parameters)}")
    print(f"resources:   {_kv(job.resources)}")
    _print_outcome(job)
    _print_attempts(job)
    _print_times(job)


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
    else:
        print_job(job)
    return 0


def _delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        deleted = client.delete_job(args.id)
    if args.json:
        _print_json(deleted)
    else:
        print(f"deleted job {deleted['id']} ({deleted['name']}): its metrics, logs, checkpoints and files")
    return 0


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
    if args.json:
        _print_json(job)
    else:
        print(f"{job.id} tags: {', '.join(job.tags) or '-'}")
    return 0


def _note_command(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.update_job(args.id, note=args.text or None)
    if args.json:
        _print_json(job)
    else:
        print(f"{job.id} note: {job.note or '-'}")
    return 0


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
    with _client(args) as client:
        before = client.get_job(args.id)
        job = client.cancel_job(before.id)
        if args.wait and not job.is_final:
            job = client.wait(job.id)
    ended = before.is_final and before.status != "cancelled"
    if args.json:
        _print_json(job)
    elif ended:
        _note(f"job {job.id} had already ended ({job.status}): there was nothing to cancel")
    else:
        print(f"{job.id} {job.status}")
    return 1 if ended else 0


def _epoch_notes(client: Client, job: Job, out: TextIO) -> None:
    """A line on ``out`` as each epoch of ``job`` ends, with the elapsed training time
    and an estimate of the time left; returns when the job ends."""
    epochs = job.parameters.get("epochs")
    table = EpochTable()
    noted: set[int] = set()
    for event in client.events(job.id, logs=False):
        note = requeue_note(event)
        if note:
            out.write(note + "\n")
            out.flush()
        if event.kind != "metric":
            continue
        epoch = table.add(event.data)
        if table.is_complete(epoch) and epoch not in noted:
            noted.add(epoch)
            timing = timing_text(*table.timing(epoch, epochs))
            total = f"/{epochs}" if epochs else ""
            out.write(f"-- epoch {epoch}{total} done" + (f": {timing}" if timing else "") + "\n")
            out.flush()


def _logs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.follow:
            job = client.get_job(args.id)
            # Epoch progress goes to stderr beside the log, from a second connection, so
            # that stdout stays the log's exact text.
            notes = threading.Thread(target=_notes_quietly, args=(args, job), name="epoch-notes", daemon=True)
            if not args.json:
                notes.start()
            for text in client.follow_logs(
                job.id,
                rank=args.rank,
                stream=args.stream,
                offset=args.offset,
                attempt=args.attempt,
                tail=args.tail,
                since=args.since,
            ):
                sys.stdout.write(text)
                sys.stdout.flush()
            if notes.is_alive():
                notes.join(timeout=30.0)  # the job is over: its last epoch's note is on its way
        else:
            sys.stdout.write(
                client.logs(
                    args.id,
                    rank=args.rank,
                    stream=args.stream,
                    offset=args.offset,
                    attempt=args.attempt,
                    tail=args.tail,
                    since=args.since,
                )
            )
    sys.stdout.flush()
    return 0


def _notes_quietly(args: argparse.Namespace, job: Job) -> None:
    try:
        with Client(args.url, args.token) as client:
            _epoch_notes(client, job, sys.stderr)
    except Exception as exc:  # progress notes are a convenience: the log itself carries on
        log.debug("epoch progress notes stopped: %s", exc)


def _points_table(points: Iterable[MetricPoint]) -> str:
    rows = [(p.seq, p.name, f"{p.value:.6g}", p.epoch, p.step, p.rank, format_time(p.time)) for p in points]
    return format_table(["SEQ", "NAME", "VALUE", "EPOCH", "STEP", "RANK", "TIME"], rows)


def _metrics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.watch:
            return _watch_metrics(client, args)
        points = list(client.iter_metrics(args.id, name=args.name))
        if args.name and not args.watch:
            missing = sorted(set(args.name) - {p.name for p in points})
            if missing:
                known = sorted(client.metric_names(args.id))
                raise ValueError(
                    f"job {args.id} has no metric {', '.join(map(repr, missing))}; its metrics: "
                    + (", ".join(known) or "none yet")
                )
    if args.json:
        _print_json(points)
    elif args.name or args.raw:
        print(_points_table(points))
    else:
        table = EpochTable()
        for p in points:
            table.add(p.model_dump())
        print(table.render() if table.rows else "no metrics yet")
    return 0


def _compare(args: argparse.Namespace) -> int:
    with _client(args) as client:
        comparison = client.compare(args.ids, metrics=args.metric)
    if args.json:
        _print_json(comparison)
    else:
        print(comparison_text(comparison))
    return 0


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


def comparison_text(comparison: JobComparison) -> str:
    """What ``torchyard compare`` prints: the parameters that differ, then one row per job
    with its status, duration, images/s and each metric's best (epoch) and final value."""
    jobs = comparison.jobs
    labels = [j.id[:8] for j in jobs]
    if comparison.differing:
        rows = [[key, *(_shown(j.parameters.get(key)) for j in jobs)] for key in comparison.differing]
        parameters = format_table(["PARAMETER", *labels], rows)
    else:
        parameters = "no parameter differs"
    headers = ["JOB", "NAME", "STATUS", "DURATION", "IMAGES/S"]
    for name in comparison.metrics:
        goal = comparison.goals.get(name, "max")
        headers += [f"{name} BEST ({goal})", f"{name} FINAL"]
    rows = []
    for label, job in zip(labels, jobs, strict=True):
        row: list[Any] = [
            label,
            job.name,
            job.status,
            format_duration(job.duration_s),
            "-" if job.images_per_sec is None else f"{job.images_per_sec:.1f}",
        ]
        for name in comparison.metrics:
            metric = job.metrics.get(name)
            best = metric.best if metric else None
            final = metric.final if metric else None
            row.append("-" if best is None else f"{best.value:.4g} (epoch {best.epoch})")
            row.append("-" if final is None else f"{final.value:.4g}")
        rows.append(row)
    return f"{parameters}\n\n{format_table(headers, rows)}"


def _watch_metrics(client: Client, args: argparse.Namespace) -> int:
    """Live table: redrawn in place on a terminal, one fixed-width line per finished epoch
    otherwise (a pipe or a file), each with the elapsed training time and the time left."""
    job = client.get_job(args.id)  # the full id, whatever the user typed, and the epoch count
    view = _MetricsView(job.id, job.parameters.get("epochs"), as_json=args.json)
    for event in client.events(job.id, logs=False):
        if event.kind == "metric":
            if args.name and event.data.get("name") not in args.name:
                continue
            view.table.add(event.data)
            view.note_point(event.data)
        elif event.kind == "status":
            view.status = describe_status(event.data)
        view.emit(event)
    if not args.json and not view.tty:
        print(f"status: {view.status}")
    return 0


def requeue_note(event: Event) -> str | None:
    """The line shown when a job goes back to the queue (a restart or a preemption)."""
    if event.kind != "status" or not event.data.get("requeued"):
        return None
    return f"-- back in the queue: {event.data.get('message') or 'requeued'}"


class _MetricsView:
    """What ``metrics --watch`` shows of the events: JSON lines, a table redrawn in place on
    a terminal, or one line per finished epoch."""

    def __init__(self, job_id: str, epochs: Any, *, as_json: bool) -> None:
        self.job_id = job_id
        self.epochs = epochs
        self.as_json = as_json
        self.tty = sys.stdout.isatty() and not as_json
        self.table = EpochTable()
        self.status = "-"
        self.printed: set[int] = set()
        self.lines: EpochLines | None = None
        self.requeues: list[str] = []
        # The newest training step seen: (epoch, step, train.loss), shown until its epoch ends.
        self.step: tuple[int, int, float] | None = None
        self._step_shown_at: float | None = None

    def note_point(self, data: dict[str, Any]) -> None:
        if data.get("name") == "train.loss" and int(data.get("rank", 0)) == 0:
            self.step = (int(data["epoch"]), int(data.get("step", 0)), float(data["value"]))

    def step_text(self) -> str | None:
        """``epoch 0/5  step 40  train.loss 0.5321`` while an epoch is under way."""
        if self.step is None or self.table.is_complete(self.step[0]):
            return None
        epoch, step, loss = self.step
        total = f"/{self.epochs}" if self.epochs else ""
        return f"epoch {epoch}{total}  step {step}  train.loss {loss:.4f}"

    def redraw(self) -> None:
        table, epochs = self.table, self.epochs
        done = [e for e in sorted(table.rows) if table.is_complete(e)]
        where = ""
        if done:
            timing = timing_text(*table.timing(done[-1], epochs))
            where = (
                f"  epoch {done[-1]}" + (f"/{epochs}" if epochs else "") + (f"  {timing}" if timing else "")
            )
        sys.stdout.write("\x1b[H\x1b[2J")
        notes = "".join(f"{line}\n" for line in self.requeues[-3:])
        current = self.step_text()
        if current:
            notes += f"now: {current}\n"
        sys.stdout.write(f"job {self.job_id}  status {self.status}{where}\n{notes}\n{table.render()}\n")
        sys.stdout.flush()

    def emit(self, event: Event) -> None:
        if self.as_json:
            print(json.dumps({"event": event.kind, "id": event.id, "data": event.data}), flush=True)
            return
        requeue = requeue_note(event)
        if requeue:
            self.requeues.append(requeue)
        if self.tty:
            self.redraw()
            return
        if requeue:
            print(requeue, flush=True)
        self._print_step()
        for epoch in sorted(self.table.rows):
            if epoch in self.printed or not (self.table.is_complete(epoch) or event.is_final):
                continue
            if self.lines is None:
                self.lines = EpochLines(self.table, self.epochs)
                print(self.lines.header())
            print(self.lines.row(epoch), flush=True)
            self.printed.add(epoch)

    def _print_step(self) -> None:
        """A line with the step reached, while no epoch has ended yet or an epoch is long:
        the first one at once, then at most one per :data:`STEP_LINE_INTERVAL_S`."""
        current = self.step_text()
        now = time.monotonic()
        if current is None or (
            self._step_shown_at is not None and now - self._step_shown_at < STEP_LINE_INTERVAL_S
        ):
            return
        self._step_shown_at = now
        print(f"-- {current}", flush=True)


# Least time between two step lines of `metrics --watch` on a pipe or in a file.
STEP_LINE_INTERVAL_S = 30.0


# --------------------------------------------------------------------------- model, cluster, predict


def _code_upload(args: argparse.Namespace) -> int:
    from torchyard.apiclient.code import IGNORE_FILE, code_files

    folder = Path(args.folder)
    if folder.is_dir():
        files, skipped = code_files(folder)
        size = sum((folder / rel).stat().st_size for rel in files)
        # As the seed warns: the whole folder is sent. Say so before it is.
        _note(
            f"uploading the WHOLE folder {folder}: {len(files)} files ({human_bytes(size)}); keep secrets "
            f"and data out of it, or list them in {IGNORE_FILE} (gitignore syntax)"
        )
        for rel in skipped:
            _note(f"left out {rel}: not a regular file (links are not uploaded)")
        if not files:
            raise ValueError(f"{folder} has no files to upload")
    with _client(args) as client:
        package = client.upload_code(folder, args.name)
    if args.json:
        _print_json(package)
    else:
        print(package.id)
        _note(
            f"code {package.name!r}: {package.files} files ({human_bytes(package.size_bytes)}), sha256 {package.sha256[:12]}"
        )
    return 0


def _code_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        items = client.list_code(limit=args.limit).items
    if args.json:
        _print_json(items)
        return 0
    rows = [(c.id[:12], c.name, c.files, human_bytes(c.size_bytes), format_time(c.created_at)) for c in items]
    print(format_table(["ID", "NAME", "FILES", "SIZE", "CREATED"], rows))
    return 0


def _code_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        package = client.get_code(args.id)
    if args.json:
        _print_json(package)
        return 0
    print(f"id:       {package.id}")
    print(f"name:     {package.name}")
    print(f"files:    {package.files} ({human_bytes(package.size_bytes)})")
    print(f"sha256:   {package.sha256}")
    print(f"created:  {format_time(package.created_at)}")
    return 0


def _code_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_code(args.id)
    _note(f"deleted code package {args.id}")
    return 0


def _download_outputs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.get_job(args.id)
        default = Path(args.path).name if args.path else f"outputs-{job.id}.tar.gz"
        out = Path(args.output) if args.output else Path(default)
        path = client.download_outputs(job.id, out, path=args.path)
    if args.json:
        _print_json({"job": job.id, "path": str(path), "sha256": job.outputs_sha256})
    else:
        print(path)
    return 0


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


def _cluster(args: argparse.Namespace) -> int:
    with _client(args) as client:
        cluster = client.cluster()
    if args.json:
        _print_json(cluster)
        return 0
    print(
        f"nodes ready: {cluster.ready_nodes}   max nodes: {cluster.max_nodes}   "
        f"max units per node: {cluster.max_units_per_node}"
    )
    rows = [
        (n.name, n.status, n.accelerator, n.units, n.free_units, n.address, format_time(n.last_heartbeat_at))
        for n in cluster.nodes
    ]
    print(format_table(["NODE", "STATUS", "ACCEL", "UNITS", "FREE", "ADDRESS", "HEARTBEAT"], rows))
    return 0


def _node_drain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        node = client.drain_node(args.node)
    if args.json:
        _print_json(node)
    else:
        jobs = f"; preempted jobs: {', '.join(node.preempted_jobs)}" if node.preempted_jobs else ""
        print(f"node {node.name} {node.status}{jobs}")
    return 0


def _node_undrain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        node = client.undrain_node(args.node)
    if args.json:
        _print_json(node)
    else:
        print(f"node {node.name} {node.status}")
    return 0


# --------------------------------------------------------------------------- tokens


def _tokens_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        tokens = client.list_tokens(include_revoked=not args.active)
    if args.json:
        _print_json(tokens)
        return 0
    rows = [
        (
            t.id,
            t.name,
            t.role,
            format_time(t.created_at),
            format_time(t.last_used_at) if t.last_used_at else "never",
            f"revoked {format_time(t.revoked_at)}" if t.revoked_at else "active",
        )
        for t in tokens
    ]
    print(format_table(["ID", "NAME", "ROLE", "CREATED", "LAST USED", "STATUS"], rows))
    return 0


def _token_revoke(args: argparse.Namespace) -> int:
    with _client(args) as client:
        tokens = client.list_tokens()
        if not any(t.id == args.token_ref for t in tokens):
            # Not an id: a name, if exactly one token that is still valid bears it.
            named = [t for t in tokens if t.name == args.token_ref and t.revoked_at is None]
            if len(named) > 1:
                ids = ", ".join(t.id for t in named)
                raise ValueError(
                    f"{len(named)} valid tokens are named {args.token_ref!r} ({ids}): give the id"
                )
            if not named:
                raise ValueError(f"no token has the id {args.token_ref!r}, and no valid token that name")
            args.token_ref = named[0].id
        token = client.revoke_token(args.token_ref)
    if args.json:
        _print_json(token)
    else:
        print(f"revoked token {token.id} ({token.name}, {token.role}): requests with it now get 401")
    return 0


def register_token_commands(
    token_sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """``torchyard token list`` and ``token revoke``, through the API (admin token)."""
    common = client_options()
    ls = token_sub.add_parser(
        "list", parents=[common], help="list tokens: id, name, role, created, last used (never the secret)"
    )
    ls.add_argument("--active", action="store_true", help="leave out revoked tokens")
    ls.set_defaults(handler=_tokens_list)
    revoke = token_sub.add_parser(
        "revoke", parents=[common], help="revoke a token: every request with it gets 401 from now on"
    )
    revoke.add_argument(
        "token_ref", metavar="ID", help="the token's id (or its name, when one valid token has it)"
    )
    revoke.set_defaults(handler=_token_revoke)


def _predict(args: argparse.Namespace) -> int:
    if args.model:
        return _predict_remote(args)
    if len(args.paths) < 2:
        raise ValueError("give a model directory and one or more images (or --model NAME[:VERSION] IMAGES)")
    model_dir, images = args.paths[0], args.paths[1:]
    require("predict", "worker")
    from torchyard.modeldir import predict

    missing = [image for image in images if not Path(image).is_file()]
    if missing:
        raise FileNotFoundError(f"no such image file: {', '.join(missing)}")

    results = predict(model_dir, images, topk=args.topk, device=args.device)
    if args.json:
        # The shape of the service's predictions (POST .../predict), as with --model.
        _print_json(
            [
                {"file": str(image), "top": [{"label": c, "probability": p} for c, p in top]}
                for image, top in zip(images, results, strict=True)
            ]
        )
        return 0
    for image, top in zip(images, results, strict=True):
        print(f"{image}: " + "  ".join(f"{c} ({p:.1%})" for c, p in top))
    return 0


def _predict_remote(args: argparse.Namespace) -> int:
    """``predict --model NAME[:VERSION] IMAGES``: the service scores the images."""
    name, version = parse_model_ref(args.model)
    with _client(args) as client:
        results = client.predict(name, args.paths, version=version, top_k=args.topk)
    if args.json:
        _print_json([{"file": r["file"], "top": r["top"]} for r in results])
        return 0
    for r in results:
        print(f"{r['file']}: " + "  ".join(f"{t['label']} ({t['probability']:.1%})" for t in r["top"]))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    """``torchyard evaluate MODEL DATASET``: an evaluation job, followed to its end, as a table."""
    with _client(args) as client:
        dataset = client.find_dataset(args.dataset)
        job = client.submit_job({"type": "evaluate", "model": args.model, "dataset": dataset.id})
        _note(f"evaluation job {job.id} submitted: {args.model} on dataset {dataset.name}")
        # Each status as it comes (waiting for a worker, loading, running), not silence.
        for event in client.events(job.id, metrics=False, logs=False, timeout=args.timeout):
            if event.kind == "status":
                _note(f"  {describe_status(event.data)}")
        job = client.get_job(job.id)
        if job.status != "succeeded":
            print_job(job)
            return 1
        result = client.job_result(job.id)
    if args.json:
        _print_json(result)
        return 0
    print_evaluation(result)
    return 0


def print_evaluation(result: dict[str, Any]) -> None:
    top5 = result.get("top5")
    print(
        f"{result['model']} on {result['num_images']} images: top-1 {result['top1']:.2%}"
        + ("" if top5 is None else f", top-5 {top5:.2%}")
        + f", loss {result['loss']:.4f}"
    )
    rows = [
        (c["label"], f"{c['precision']:.3f}", f"{c['recall']:.3f}", f"{c['f1']:.3f}", c["support"])
        for c in result["per_class"]
    ]
    print(format_table(["CLASS", "PRECISION", "RECALL", "F1", "IMAGES"], rows))
    classes = result["classes"]
    if len(classes) <= 20:
        print("confusion matrix (rows: true label, columns: predicted):")
        matrix = [[label, *row] for label, row in zip(classes, result["confusion_matrix"], strict=True)]
        print(format_table(["", *classes], matrix))


# --------------------------------------------------------------------------- model registry


def _version_row(v: ModelVersion) -> list[str]:
    created = v.model_extra.get("created_at", "") if v.model_extra else ""
    return [
        v.name,
        str(v.version),
        v.architecture,
        str(len(v.classes)),
        "yes" if v.onnx else "no",
        v.job_id[:12],
        str(created)[:19],
    ]


_VERSION_HEADER = ["NAME", "VERSION", "ARCHITECTURE", "CLASSES", "ONNX", "JOB", "CREATED"]


def _model_register(args: argparse.Namespace) -> int:
    if args.job and args.job_option and args.job != args.job_option:
        raise ValueError("give the job once: JOB or --job JOB")
    job = args.job_option or args.job
    if not job:
        raise ValueError("name the job whose model to register: --job JOB")
    with _client(args) as client:
        version = client.register_model(args.name, job, args.path)
    if args.json:
        _print_json(version.model_dump(mode="json"))
    else:
        print(f"{version.name}:{version.version}")
        source = f" outputs folder {version.path}" if version.path else ""
        _note(f"registered from job {version.job_id}{source} (sha256 {version.sha256})")
    return 0


def _model_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        models = client.list_models()
    if args.json:
        _print_json([m.model_dump(mode="json") for m in models])
        return 0
    rows = [_version_row(m.versions[-1]) for m in models if m.versions]
    print(format_table(_VERSION_HEADER, rows) if rows else "no models")
    return 0


def _model_show(args: argparse.Namespace) -> int:
    name, version = args.ref.partition(":")[0], args.ref.partition(":")[2]
    with _client(args) as client:
        versions = [client.get_model_version(name, version)] if version else client.get_model(name).versions
    if args.json:
        _print_json([v.model_dump(mode="json") for v in versions])
        return 0
    print(format_table(_VERSION_HEADER, [_version_row(v) for v in versions]))
    if version:
        print(f"classes: {', '.join(versions[0].classes)}")
        print(f"sha256:  {versions[0].sha256}")
    return 0


def _model_delete(args: argparse.Namespace) -> int:
    name, version = parse_model_ref(args.ref)
    if version == "latest" and ":" not in args.ref:
        raise ValueError("name the version to delete: NAME:VERSION")
    with _client(args) as client:
        deleted = client.delete_model_version(name, version)
    if args.json:
        _print_json(deleted.model_dump(mode="json"))
    else:
        print(f"deleted {deleted.name}:{deleted.version}")
    return 0


def _model_download(args: argparse.Namespace) -> int:
    name, version = parse_model_ref(args.ref)
    with _client(args) as client:
        found = client.get_model_version(name, version)
        if args.onnx:
            out = Path(args.output or f"{found.name}-{found.version}.onnx")
            path = client.registry.download_version_onnx(found.name, found.version, out)
        else:
            out = Path(args.output or f"{found.name}-{found.version}")
            path = client.download_model(found.job_id, out)
    if args.json:
        _print_json({"model": found.name, "version": found.version, "path": str(path)})
    else:
        print(path)
    return 0


def register_model_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    model = sub.add_parser("model", help="the model registry: register, list, show, delete, download")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    reg = model_sub.add_parser(
        "register",
        parents=[common],
        help="register a succeeded job's model as the next version of NAME",
        description="Register a succeeded training job's model directory, or (with --path) the "
        "model directory a succeeded script job wrote to a folder of its outputs.",
    )
    reg.add_argument("name", metavar="NAME")
    reg.add_argument("job", metavar="JOB", nargs="?", help="the job's id, name or id prefix (or --job)")
    reg.add_argument("--job", dest="job_option", metavar="JOB", help="the job's id, name or id prefix")
    reg.add_argument(
        "--path",
        default=None,
        help="script jobs: the folder of the job's outputs holding the model directory, e.g. model "
        '(node-0/model with "outputs": "all")',
    )
    reg.set_defaults(handler=_model_register)
    ls = model_sub.add_parser("list", parents=[common], help="your models and their latest versions")
    ls.set_defaults(handler=_model_list)
    show = model_sub.add_parser("show", parents=[common], help="a model's versions, or one version")
    show.add_argument("ref", metavar="NAME[:VERSION]")
    show.set_defaults(handler=_model_show)
    delete = model_sub.add_parser("delete", parents=[common], help="delete one version (NAME:VERSION)")
    delete.add_argument("ref", metavar="NAME:VERSION")
    delete.set_defaults(handler=_model_delete)
    download = model_sub.add_parser(
        "download", parents=[common], help="download a version's model directory (or --onnx its export)"
    )
    download.add_argument("ref", metavar="NAME[:VERSION]")
    download.add_argument("-o", "--output", help="destination (default NAME-VERSION[.onnx])")
    download.add_argument("--onnx", action="store_true", help="the ONNX export instead of the directory")
    download.set_defaults(handler=_model_download)


# --------------------------------------------------------------------------- parser


def client_options() -> argparse.ArgumentParser:
    """Options shared by every command that talks to the API."""
    parent = argparse.ArgumentParser(add_help=False)
    conn = parent.add_argument_group("connection")
    conn.add_argument(
        "--url", default=None, help="API URL (default: $TORCHYARD_URL, else http://127.0.0.1:8000)"
    )
    conn.add_argument(
        "--token", default=None, help="API token (default: $TORCHYARD_TOKEN, else <data dir>/admin.token)"
    )
    parent.add_argument("--json", action="store_true", help="machine-readable JSON output")
    return parent


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the user commands to the ``torchyard`` parser."""
    common = client_options()

    datasets = sub.add_parser("datasets", help="upload, list, show and delete datasets")
    ds_sub = datasets.add_subparsers(dest="datasets_command", required=True)
    up = ds_sub.add_parser(
        "upload",
        parents=[common],
        help="upload a folder of class sub-folders or an archive; --path registers shared storage",
    )
    up.add_argument(
        "source",
        nargs="*",
        metavar="[NAME] PATH",
        help="folder (packed to .tar.gz on the fly) or .zip/.tar/.tar.gz archive, optionally after its name",
    )
    up.add_argument(
        "--path", help="register this folder on the service's shared storage instead of uploading"
    )
    up.add_argument("--name", help="dataset name (default: the folder or file name)")
    up.add_argument("--sample", type=int, help="with --path: decode only this many images (large sets)")
    up.add_argument(
        "--replace",
        action="store_true",
        help="once the upload is stored, delete your older datasets of the same name "
        "(one a job still uses is kept)",
    )
    up.set_defaults(handler=_datasets_upload)
    ls = ds_sub.add_parser("list", parents=[common], help="list datasets, newest first")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--all", action="store_true", help="every page")
    ls.set_defaults(handler=_datasets_list)
    show = ds_sub.add_parser("show", parents=[common], help="one dataset with its per-class counts")
    show.add_argument("id", metavar="DATASET", help=_DATASET_HELP)
    show.set_defaults(handler=_datasets_show)
    delete = ds_sub.add_parser(
        "delete", parents=[common], help="delete a dataset (refused while a job uses it)"
    )
    delete.add_argument("id", metavar="DATASET", help=_DATASET_HELP)
    delete.set_defaults(handler=_datasets_delete)

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

    cancel = sub.add_parser("cancel", parents=[common], help="cancel a job (idempotent)")
    cancel.add_argument("id", metavar="JOB", help=_JOB_HELP)
    cancel.add_argument("--wait", action="store_true", help="wait until the job is cancelled")
    cancel.set_defaults(handler=_cancel)

    logs = sub.add_parser("logs", parents=[common], help="a job's log (rank 0 unless --rank/--stream)")
    logs.add_argument("id", metavar="JOB", help=_JOB_HELP)
    logs.add_argument("-f", "--follow", action="store_true", help="stream new lines until the job ends")
    logs.add_argument("--rank", type=int, default=None, help="global rank (default 0)")
    logs.add_argument("--stream", default=None, help="a stream by name, e.g. the agent log")
    logs.add_argument("--offset", type=int, default=0, help="start at this byte offset")
    logs.add_argument("--attempt", type=int, default=None, help="this attempt's log (default: the latest)")
    logs.add_argument(
        "--tail", "-n", type=_positive_int, default=None, metavar="N", help="start with the last N lines"
    )
    logs.add_argument(
        "--since",
        type=parse_since,
        default=None,
        metavar="WHEN",
        help="only text that arrived since WHEN: a duration ago (30s, 10m, 2h, 1d) or an ISO 8601 time",
    )
    logs.set_defaults(handler=_logs)

    metrics = sub.add_parser("metrics", parents=[common], help="a job's metrics as a per-epoch table")
    metrics.add_argument("id", metavar="JOB", help=_JOB_HELP)
    metrics.add_argument("--watch", "-w", action="store_true", help="refresh live until the job ends")
    metrics.add_argument("--name", action="append", help="only this metric (repeatable); lists the points")
    metrics.add_argument("--raw", action="store_true", help="list every point instead of the epoch table")
    metrics.set_defaults(handler=_metrics)

    compare = sub.add_parser(
        "compare",
        parents=[common],
        help="several jobs side by side: the parameters that differ and each metric's best and final value",
    )
    compare.add_argument("ids", nargs="+", metavar="JOB", help="up to 20 jobs: ids, names or id prefixes")
    compare.add_argument("--metric", action="append", help="only this metric (repeatable; default: all)")
    compare.set_defaults(handler=_compare)

    download = sub.add_parser(
        "download", parents=[common], help="download, verify and unpack a succeeded job's model directory"
    )
    download.add_argument("id", metavar="JOB", help=_JOB_HELP)
    download.add_argument("-o", "--output", help="directory to create (default: ./model-<job id>)")
    download.add_argument("--keep-archive", action="store_true", help="keep the .tar.gz beside the directory")
    download.add_argument(
        "--outputs", action="store_true", help="a script job's outputs folder as .tar.gz instead of a model"
    )
    download.add_argument("--path", help="with --outputs: only this file of the outputs")
    download.set_defaults(handler=_download)

    code = sub.add_parser("code", help="upload, list, show and delete code packages for script jobs")
    code_sub = code.add_subparsers(dest="code_command", required=True)
    code_up = code_sub.add_parser(
        "upload",
        parents=[common],
        help="upload a source folder (the whole folder, minus .torchyardignore) and print its id",
    )
    code_up.add_argument("folder", help="the folder (or a .zip/.tar.gz of it)")
    code_up.add_argument("--name", help="package name (default: the folder name)")
    code_up.set_defaults(handler=_code_upload)
    code_ls = code_sub.add_parser("list", parents=[common], help="list code packages, newest first")
    code_ls.add_argument("--limit", type=int, default=50)
    code_ls.set_defaults(handler=_code_list)
    code_show = code_sub.add_parser("show", parents=[common], help="show a code package")
    code_show.add_argument("id", help="code id, name or id prefix")
    code_show.set_defaults(handler=_code_show)
    code_rm = code_sub.add_parser("delete", parents=[common], help="delete a code package")
    code_rm.add_argument("id", metavar="CODE", help="the code package's id, name or id prefix")
    code_rm.set_defaults(handler=_code_delete)

    cluster = sub.add_parser("cluster", parents=[common], help="nodes, processing units and limits")
    cluster.set_defaults(handler=_cluster)

    node = sub.add_parser("node", help="drain or undrain a node (admin token)")
    node_sub = node.add_subparsers(dest="node_command", required=True)
    for verb, text in (
        ("drain", "take no new work; the node's jobs checkpoint and go back to the queue"),
        ("undrain", "make a drained node ready again"),
    ):
        cmd = node_sub.add_parser(verb, parents=[common], help=text)
        cmd.add_argument("node", metavar="NAME", help="node name or id")
        cmd.set_defaults(handler=_node_drain if verb == "drain" else _node_undrain)

    predict = sub.add_parser(
        "predict",
        parents=[common],
        help="classify images: MODEL_DIR IMAGES locally (no service), or --model NAME[:VERSION] IMAGES "
        "through the service",
    )
    predict.add_argument("paths", nargs="+", metavar="[MODEL_DIR] IMAGE")
    predict.add_argument(
        "--model", metavar="NAME[:VERSION]", help="a registered model, scored by the service"
    )
    predict.add_argument("--topk", type=int, default=5, help="classes to show per image")
    predict.add_argument(
        "--device", default="cpu", help="torch device for a local model directory (default cpu)"
    )
    predict.set_defaults(handler=_predict)
    register_model_commands(sub, common)
    evaluate = sub.add_parser(
        "evaluate",
        parents=[common],
        help="evaluate a registered model on a labeled dataset (runs on a worker)",
    )
    evaluate.add_argument("model", metavar="NAME[:VERSION]")
    evaluate.add_argument("dataset", metavar="DATASET", help="the dataset's id, name or id prefix")
    evaluate.add_argument(
        "--timeout", type=float, default=None, help="give up waiting after this many seconds"
    )
    evaluate.set_defaults(handler=_evaluate)
    from torchyard.sweep_commands import register_sweep_commands

    register_sweep_commands(sub, common)
