"""What every command shares: the client from ``--url``/``--token`` (then
``TORCHYARD_URL``/``TORCHYARD_TOKEN``, then a local service's data directory), ``--json``
output, notes on stderr, and spec files with ``--set`` overrides."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from torchyard.client import Client, missing_token_message
from torchyard.contract.errors import AuthenticationError, TorchyardError

Handler = Callable[[argparse.Namespace], int]


log = logging.getLogger(__name__)


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
    number = value[:-1].replace(".", "", 1)
    if unit in _DURATION_UNITS and number.isascii() and number.isdigit():
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


def _answer(args: argparse.Namespace, value: Any, text: object) -> int:
    """A command's answer: ``value`` as JSON with ``--json``, else ``text``; exit code 0."""
    if args.json:
        _print_json(value)
    else:
        print(text)
    return 0


def _note(text: str) -> None:
    """A message for the person at the terminal (stderr, so stdout stays clean for pipes)."""
    print(text, file=sys.stderr, flush=True)


def add_client_options(parser: argparse.ArgumentParser, *, default: Any = None) -> None:
    """``--url``, ``--token`` and ``--json`` on ``parser``, each with ``default`` (``--json``:
    False when ``default`` is None)."""
    conn = parser.add_argument_group("connection")
    conn.add_argument(
        "--url", default=default, help="API URL (default: $TORCHYARD_URL, else http://127.0.0.1:8000)"
    )
    conn.add_argument(
        "--token",
        default=default,
        help="API token (default: $TORCHYARD_TOKEN, else <data dir>/admin.token)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if default is None else default,
        help="machine-readable JSON output",
    )


def client_options() -> argparse.ArgumentParser:
    """Options shared by every command that talks to the API. The ``torchyard`` parser has
    them too, with their defaults: here they default to nothing (``SUPPRESS``), so that a
    value given before the command (``torchyard --url U jobs``) is kept, and one given
    after it (``torchyard jobs --url U``) is taken."""
    parent = argparse.ArgumentParser(add_help=False)
    add_client_options(parent, default=argparse.SUPPRESS)
    parent.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging"
    )
    return parent


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


class SpecFileError(ValueError):
    """A spec file that is not a spec: the command's input is wrong (exit status 2)."""


class _AliasFound(Exception):
    def __init__(self, alias: str, line: int, column: int) -> None:
        super().__init__(alias)
        self.alias, self.line, self.column = alias, line, column


def _load_yaml(text: str) -> Any:
    """YAML as ``yaml.safe_load`` reads it, less aliases (``*name``): each one is refused as
    the parser meets it, before anything is built, so a few lines of nested aliases (a
    "billion laughs") cannot expand into billions of values."""
    import yaml

    class _NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                mark = event.start_mark
                raise _AliasFound(f"*{event.anchor}", mark.line + 1, mark.column + 1)
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=_NoAliasLoader)


def load_spec(path: str) -> dict[str, Any]:
    """A job spec from a .yaml/.yml/.json file (``-`` reads standard input)."""
    import yaml

    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    try:
        spec = json.loads(text) if path.endswith(".json") else _load_yaml(text)
    except _AliasFound as exc:
        raise SpecFileError(
            f"{path}: YAML aliases are not allowed in a spec file "
            f"(line {exc.line}, column {exc.column}: {exc.alias}): write the value out"
        ) from None
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if path.endswith(".json") else "YAML"
        raise SpecFileError(f"{path}: not valid {kind}: {exc}") from exc
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise SpecFileError(f"{path}: a job spec must be a mapping")
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


def dataset_names(client: Client, ids: Iterable[Any]) -> dict[str, str]:
    """The names of the datasets of these ids, those that can still be read (a deleted
    dataset is left out: it is shown by its id)."""
    names: dict[str, str] = {}
    for dataset_id in dict.fromkeys(i for i in ids if isinstance(i, str) and i):
        try:
            names[dataset_id] = client.get_dataset(dataset_id).name
        except TorchyardError as exc:
            if exc.status_code != 404:
                raise
    return names


def dataset_text(dataset_id: Any, names: Mapping[str, str], *, with_id: bool = True) -> str:
    """A dataset as people know it: ``digits-train (0123abcd)``, its name and the start of
    its id (which every command takes); its id alone when its name is not known."""
    if not isinstance(dataset_id, str) or dataset_id not in names:
        return "-" if dataset_id is None else str(dataset_id)
    name = names[dataset_id]
    return f"{name} ({dataset_id[:8]})" if with_id else name
