"""The user commands of ``torchyard``, one module per noun: datasets, jobs, logs, metrics,
code, cluster, teams, tokens, models and sweeps.

Each command talks to the API through :class:`torchyard.client.Client`; a command only
parses and prints. The URL and token come from ``--url``/``--token``, then
``TORCHYARD_URL``/``TORCHYARD_TOKEN``, then a local service's data directory
(``TORCHYARD_DATA_DIR`` or ``./torchyard-data``, whose ``admin.token`` the local user never
has to copy). Every command accepts ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torchyard.commands import (
    cluster,
    code,
    datasets,
    jobs,
    login,
    logs,
    metrics,
    models,
    sweeps,
    teams,
    webhooks,
    weights,
)
from torchyard.commands.audit import register as register_audit_commands
from torchyard.commands.common import _print_json, client_options, parse_since
from torchyard.commands.metrics import comparison_text
from torchyard.commands.models import _predict_remote, register_model_commands
from torchyard.commands.tokens import register_token_commands
from torchyard.extras import require

__all__ = [
    "client_options",
    "comparison_text",
    "parse_since",
    "register",
    "register_model_commands",
    "register_token_commands",
    "require",
]


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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the user commands to the ``torchyard`` parser."""
    common = client_options()
    datasets.register(sub, common)
    jobs.register(sub, common)
    logs.register(sub, common)
    metrics.register(sub, common)
    code.register(sub, common)
    weights.register(sub, common)
    webhooks.register(sub, common)
    cluster.register(sub, common)
    teams.register(sub, common)
    login.register(sub, common)
    register_audit_commands(sub, common)
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
    models.register(sub, common)
    sweeps.register(sub, common)
