"""A sweep's search space (docs/sweeps.md): its ranges as stored in the sweep's spec, the
values each can produce, the grid a grid sweep enumerates, and how many points the space
holds. The checks of the space against the job spec are in :mod:`sweep_validation`.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import TypeAdapter

from service.db.models import Sweep
from service.schemas.sweeps import Categorical, FloatRange, IntRange, SearchRange
from torchyard.contract.errors import RequestValidationError

# The largest grid a grid sweep may enumerate.
MAX_GRID = 10_000

Range = FloatRange | IntRange | Categorical

_RANGE: TypeAdapter[Range] = TypeAdapter(SearchRange)


def invalid(
    field_name: str, message: str, allowed: str | None = None, suggestion: str | None = None
) -> RequestValidationError:
    """The 422 naming a field of the sweep (``allowed``: the values it takes; ``suggestion``:
    what an unknown name most likely means)."""
    item: dict[str, Any] = {"field": field_name, "message": message}
    if allowed is not None:
        item["allowed"] = allowed
    if suggestion is not None:
        item["message"] = message = f"{message}: did you mean {suggestion!r}?"
        item["suggestion"] = suggestion
    text = f"{field_name}: {message}" + (f" (allowed: {allowed})" if allowed else "")
    return RequestValidationError(f"invalid request: {text}", details={**item, "errors": [item]})


def ranges(spec: dict[str, Any]) -> dict[str, Range]:
    """The search space of a stored sweep spec, each key's range parsed."""
    return {k: _RANGE.validate_python(v) for k, v in spec["search_space"].items()}


def set_path(spec: dict[str, Any], path: list[str], value: Any) -> None:
    """Set a dotted path (split) of a job spec, making the mappings on the way."""
    node = spec
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def produced_values(key: str, rng: Range) -> list[Any]:
    """Every value the range can produce that bounds what it can produce: its ends, or each
    choice (a 422 naming the range when it is not one)."""
    where = f"search_space.{key}"
    if isinstance(rng, Categorical):
        if not rng.choices:
            raise invalid(f"{where}.choices", "no choices: give at least one value", "1..100 values")
        if len({repr(c) for c in rng.choices}) != len(rng.choices):
            raise invalid(f"{where}.choices", "a choice is given twice")
        return list(rng.choices)
    if rng.low > rng.high:
        raise invalid(f"{where}.low", f"low {rng.low} is above high {rng.high}", "low <= high")
    if rng.log:
        _check_log(where, rng)
    return [rng.low, rng.high]


def _check_log(where: str, rng: FloatRange | IntRange) -> None:
    if rng.low <= 0:
        raise invalid(f"{where}.low", f"a log range needs low > 0, not {rng.low}", "> 0 with log")
    stepped = rng.step is not None if isinstance(rng, FloatRange) else rng.step != 1
    if stepped:
        raise invalid(f"{where}.step", "step cannot be used with log")


def _axis_count(key: str, rng: Range) -> int:
    """How many values a grid takes from one range, counted without listing them (a 422
    naming the range when it is more than a grid may hold)."""
    where = f"search_space.{key}"
    if isinstance(rng, Categorical):
        return len(rng.choices)
    if isinstance(rng, IntRange):
        if rng.log:
            raise invalid(f"{where}.log", "a grid enumerates values: use a step, or categorical choices")
        count = max(0, (rng.high - rng.low) // rng.step + 1)
        field_name = where
    else:
        if rng.step is None:
            raise invalid(f"{where}.step", "a grid of floats needs a step (or categorical choices)")
        steps = (rng.high - rng.low) / rng.step + 1e-9
        if not math.isfinite(steps):
            raise invalid(f"{where}.step", "too many values: more than a grid may hold", f"<= {MAX_GRID}")
        count = max(0, math.floor(steps) + 1)
        field_name = f"{where}.step"
    if count > MAX_GRID:
        raise invalid(field_name, f"{count} values: more than a grid may hold", f"<= {MAX_GRID}")
    return count


def grid(search_space: dict[str, Range]) -> dict[str, list[Any]]:
    """Every value of each range, for a grid sweep (a 422 naming the range, or the whole
    space, that holds more than a grid may)."""
    # Every axis and their product are counted before a single value is listed.
    counts = {key: _axis_count(key, rng) for key, rng in search_space.items()}
    size = math.prod(counts.values())
    if size > MAX_GRID:
        raise invalid("search_space", f"the grid has {size} points", f"<= {MAX_GRID}")
    values: dict[str, list[Any]] = {}
    for key, rng in search_space.items():
        if isinstance(rng, Categorical):
            values[key] = list(rng.choices)
        elif isinstance(rng, IntRange):
            values[key] = list(range(rng.low, rng.high + 1, rng.step))
        else:
            assert rng.step is not None
            values[key] = [round(rng.low + i * rng.step, 12) for i in range(counts[key])]
    return values


def sweep_grid(sweep: Sweep) -> dict[str, list[Any]] | None:
    """The grid of a grid sweep; None for the other algorithms."""
    if sweep.spec["algorithm"] != "grid":
        return None
    return grid(ranges(sweep.spec))


def target_trials(sweep: Sweep) -> int:
    """How many trials the sweep runs: ``max_trials``, or fewer when its grid is smaller."""
    if sweep.algorithm != "grid":
        return sweep.max_trials
    size = math.prod(len(v) for v in grid(ranges(sweep.spec)).values())
    return min(size, sweep.max_trials)


def space_size(sweep: Sweep) -> int | None:
    """How many points the search space holds (None: a float range without a step)."""
    size = 1
    for rng in ranges(sweep.spec).values():
        if isinstance(rng, Categorical):
            size *= len(rng.choices)
        elif isinstance(rng, IntRange):
            size *= (rng.high - rng.low) // rng.step + 1
        elif rng.step is not None:
            size *= math.floor((rng.high - rng.low) / rng.step + 1e-9) + 1
        else:
            return None
    return size
