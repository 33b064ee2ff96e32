"""The trainer's extension point: code of the node's own, told where a rank is in its training.

``TORCHYARD_TRAINER_HOOKS`` (a node setting: the agent passes its environment on to every
rank) names Python modules, separated by commas, each a file (an absolute path,
``/opt/site/hooks.py``: the agent shows it to the ranks' sandbox, read-only) or an
importable name (``site_hooks.trainer``). Each is imported once per process; when a rank
sets up its training it calls the module's ``trainer_hooks(rank, run_dir)``, which returns
a :class:`Hooks` (None: nothing for that rank). Its methods, each a no-op here:

* ``before_step(step)``: before each training step (``step``: the job's optimizer steps so far);
* ``at_point(point, epoch)``: at ``train`` (half-way through the epoch's batches),
  ``validation`` (before the epoch's validation) and ``checkpoint`` (the epoch's checkpoint
  file written, not yet in place: on the background writer's thread, training goes on);
* ``writes_checkpoints()``: False turns the checkpoints off (a benchmark's baseline: such a
  job cannot resume).

An exception from a hook fails the rank as any error of its training does. The test suite
uses them to fail a rank at a given step and to hold one at a given point
(``tests/support/trainer_hooks.py``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from torchyard.contract.jobfile import TRAINER_HOOKS_VARIABLE

HOOKS_VAR = TRAINER_HOOKS_VARIABLE
FACTORY = "trainer_hooks"


class Hooks:
    """A rank's hooks: override what you need."""

    def before_step(self, step: int) -> None:
        return None

    def at_point(self, point: str, epoch: int) -> None:
        return None

    def writes_checkpoints(self) -> bool:
        return True


class _Every(Hooks):
    """The hooks of every module named, called in their order."""

    def __init__(self, hooks: Sequence[Hooks]) -> None:
        self.hooks = list(hooks)

    def before_step(self, step: int) -> None:
        for hooks in self.hooks:
            hooks.before_step(step)

    def at_point(self, point: str, epoch: int) -> None:
        for hooks in self.hooks:
            hooks.at_point(point, epoch)

    def writes_checkpoints(self) -> bool:
        return all(hooks.writes_checkpoints() for hooks in self.hooks)


def load_hooks(rank: int, run_dir: Path, environ: Mapping[str, str] | None = None) -> Hooks:
    """The hooks of ``rank`` from the modules ``TORCHYARD_TRAINER_HOOKS`` names (none: :class:`Hooks`)."""
    raw = (os.environ if environ is None else environ).get(HOOKS_VAR, "")
    found: list[Hooks] = []
    for name in (part.strip() for part in raw.split(",")):
        if not name:
            continue
        factory = getattr(_module(name), FACTORY, None)
        if not callable(factory):
            raise ValueError(f"{HOOKS_VAR}: {name} defines no {FACTORY}(rank, run_dir)")
        hooks = factory(rank, Path(run_dir))
        if hooks is not None:
            if not isinstance(hooks, Hooks):
                raise TypeError(f"{HOOKS_VAR}: {name}'s {FACTORY} returned {type(hooks).__name__}, not Hooks")
            found.append(hooks)
    if not found:
        return Hooks()
    return found[0] if len(found) == 1 else _Every(found)


def _module(name: str) -> ModuleType:
    """The module named: a file (imported once, under a name of its own) or an importable name."""
    if not (name.endswith(".py") or os.sep in name):
        return importlib.import_module(name)
    path = Path(name).resolve()
    key = f"_torchyard_trainer_hooks_{hashlib.sha256(str(path).encode()).hexdigest()[:16]}"
    loaded = sys.modules.get(key)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{HOOKS_VAR}: cannot import {name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module
