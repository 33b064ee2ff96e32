"""The model registry: ``model register|list|show|delete|download``, ``evaluate``, and
``predict --model`` through the service."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torchyard.apiclient.registry import ModelVersion, parse_model_ref
from torchyard.commands.common import _answer, _client, _note, _print_json
from torchyard.commands.job_show import print_job
from torchyard.terminal import (
    describe_status,
    format_table,
)


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


def _version_row(v: ModelVersion) -> list[str]:
    created = v.model_extra.get("created_at", "") if v.model_extra else ""
    return [
        v.name,
        str(v.version),
        v.architecture,
        str(len(v.classes)),
        "-" if v.top1 is None else f"{v.top1:.2%}",
        "yes" if v.onnx else "no",
        v.job_id[:12],
        str(created)[:19],
    ]


_VERSION_HEADER = ["NAME", "VERSION", "ARCHITECTURE", "CLASSES", "TOP-1", "ONNX", "JOB", "CREATED"]


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
    return _answer(args, deleted.model_dump(mode="json"), f"deleted {deleted.name}:{deleted.version}")


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
    return _answer(args, {"model": found.name, "version": found.version, "path": str(path)}, path)


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


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``evaluate`` (``model`` comes from :func:`register_model_commands`)."""
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
