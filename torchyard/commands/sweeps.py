"""``torchyard sweep submit|list|show|trials|cancel``: hyperparameter searches from the terminal."""

from __future__ import annotations

import argparse
from typing import Any

from torchyard.apiclient.sweeps import Sweep, Trial
from torchyard.commands.common import (
    _answer,
    _client,
    _note,
    _print_json,
    _resolve_datasets,
    load_spec,
    parse_value,
    set_path,
)
from torchyard.terminal import format_table, format_time


def build_sweep_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep file, then ``--name``, then ``--set`` overrides (``job.parameters.epochs=2``)."""
    spec = load_spec(args.spec)
    if args.name is not None:
        spec["name"] = args.name
    for item in args.set or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        # A search-space key holds dots of its own: search_space.<dotted key>.<field>.
        if key.startswith("search_space."):
            rest = key.removeprefix("search_space.")
            space = spec.setdefault("search_space", {})
            path, _, field = rest.rpartition(".")
            if not path:
                raise ValueError(f"--set {key}: give search_space.<key>.<field>")
            space.setdefault(path, {})[field] = parse_value(raw)
        else:
            set_path(spec, key.strip(), parse_value(raw))
    return spec


def _value(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _params(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k.rsplit('.', 1)[-1]}={_value(v) if isinstance(v, float) else v}" for k, v in params.items()
    )


def trials_table(trials: list[Trial]) -> str:
    rows = [
        (t.number, t.state, _value(t.value), t.epochs, _params(t.params), t.job_id[:12], t.reason or "")
        for t in trials
    ]
    return format_table(["#", "STATE", "VALUE", "EPOCHS", "PARAMETERS", "JOB", "REASON"], rows)


def sweep_text(sweep: Sweep) -> str:
    objective = f"{sweep.objective.get('goal', '')} {sweep.objective.get('metric', '')}".strip()
    rule = sweep.early_stopping["type"] if sweep.early_stopping else "none"
    counts = ", ".join(f"{n} {state}" for state, n in sorted(sweep.trial_counts.items())) or "none yet"
    lines = [
        f"sweep     {sweep.id}  {sweep.name}",
        f"status    {sweep.status}" + (f" ({sweep.message})" if sweep.message else ""),
        f"search    {sweep.algorithm}, early stopping {rule}, {objective}",
        f"trials    {counts} (max {sweep.max_trials}, {sweep.max_concurrent_trials} at a time); "
        f"{sweep.epochs_run} epochs run",
        f"space     {', '.join(sweep.search_space)}",
        f"created   {format_time(sweep.created_at)}",
    ]
    best = sweep.best_trial
    if best is not None:
        lines.append(
            f"best      trial {best.number}: {_value(best.value)} ({_params(best.params)}), job {best.job_id}"
        )
    return "\n".join(lines)


def _submit(args: argparse.Namespace) -> int:
    spec = build_sweep_spec(args)
    with _client(args) as client:
        job = spec.get("job")
        if isinstance(job, dict):
            _resolve_datasets(client, job)
        if args.dry_run:
            _print_json(spec)
            return 0
        sweep = client.submit_sweep(spec)
    if args.json:
        _print_json(sweep)
        return 0
    print(sweep.id)
    _note(f"submitted sweep {sweep.name!r}: {sweep.algorithm}, up to {sweep.max_trials} trials")
    _note(f"follow it with: torchyard sweep show {sweep.id}   or   torchyard sweep trials {sweep.id}")
    return 0


def _list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        items = client.list_sweeps(status=args.status, limit=args.limit).items
    if args.json:
        _print_json(items)
        return 0
    rows = [
        (
            s.id,
            s.name,
            s.status,
            s.algorithm,
            sum(s.trial_counts.values()),
            _value(s.best_trial.value if s.best_trial else None),
            format_time(s.created_at),
        )
        for s in items
    ]
    print(format_table(["ID", "NAME", "STATUS", "ALGORITHM", "TRIALS", "BEST", "CREATED"], rows))
    return 0


def _show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        sweep = client.get_sweep(args.id)
    return _answer(args, sweep, sweep_text(sweep))


def _trials(args: argparse.Namespace) -> int:
    with _client(args) as client:
        sweep = client.get_sweep(args.id)
    trials = list(sweep.trials or [])
    if args.json:
        _print_json(trials)
        return 0
    if args.sort == "value":
        sign = -1 if sweep.objective.get("goal", "maximize") == "maximize" else 1
        trials.sort(key=lambda t: (t.value is None, sign * (t.value or 0.0), t.number))
    print(trials_table(trials))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    """Cancel a sweep; one that had already ended is left as it is, said on stderr, and is
    no failure (exit status 0), as with ``cancel`` of a job."""
    with _client(args) as client:
        sweep = client.cancel_sweep(args.id)
    if sweep.status != "cancelled":  # only a running sweep is cancelled
        _note(f"sweep {sweep.id} had already ended ({sweep.status}): there was nothing to cancel")
    return _answer(args, sweep, f"sweep {sweep.id} {sweep.status}")


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    sweep = sub.add_parser("sweep", help="hyperparameter searches: submit, list, show, trials, cancel")
    sweep_sub = sweep.add_subparsers(dest="sweep_command", required=True)
    submit = sweep_sub.add_parser(
        "submit",
        parents=[common],
        help="start a sweep from a YAML/JSON file",
        description="Start a sweep. Fields come from FILE, then --set KEY=VALUE (e.g. --set "
        "job.parameters.epochs=2, --set max_trials=8, --set "
        "search_space.parameters.learning_rate.high=0.1). Dataset fields of the job accept a name.",
    )
    submit.add_argument("spec", metavar="FILE", help="sweep spec (.yaml, .yml or .json; - for stdin)")
    submit.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a field by its dotted path"
    )
    submit.add_argument("--name", help="sweep name")
    submit.add_argument("--dry-run", action="store_true", help="print the spec that would be sent")
    submit.set_defaults(handler=_submit)
    ls = sweep_sub.add_parser("list", parents=[common], help="your sweeps, newest first")
    ls.add_argument("--status", action="append", help="only sweeps with this status (repeatable)")
    ls.add_argument("--limit", type=int, default=50)
    ls.set_defaults(handler=_list)
    show = sweep_sub.add_parser(
        "show", parents=[common], help="a sweep's status, trial counts and best trial"
    )
    show.add_argument("id", help="sweep id, name or id prefix")
    show.set_defaults(handler=_show)
    trials = sweep_sub.add_parser("trials", parents=[common], help="a sweep's trials as a table")
    trials.add_argument("id", help="sweep id, name or id prefix")
    trials.add_argument("--sort", choices=["number", "value"], default="number", help="order of the rows")
    trials.set_defaults(handler=_trials)
    cancel = sweep_sub.add_parser(
        "cancel",
        parents=[common],
        help="cancel a sweep and every live trial (a sweep that had already ended is said so, exit status 0)",
    )
    cancel.add_argument("id", help="sweep id, name or id prefix")
    cancel.set_defaults(handler=_cancel)
