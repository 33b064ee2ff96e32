"""Sweeps (docs/sweeps.md): grid search run out vs TPE + ASHA on the digits, and the scheduling
overhead per trial.

Two measurements:

* ``search``: the same space (learning rate × batch size) searched twice through
  torchyard's sweep decisions (``service.services.sweep_rounds.drive`` on a real database):
  a grid run to completion, and TPE with ASHA early stopping. The trials' training is
  done by this process, one epoch per round for every live trial, and reported into the
  database as a worker's reports would (status, attempt, one ``val.top1`` point per epoch):
  a two-layer perceptron on scikit-learn's 8×8 digits (1,437 training, 360 validation
  images), SGD with momentum 0.9, a fixed seed per trial. No agents and no torchrun: the
  figures are the search's, not the cluster's. Printed: best ``val.top1`` and epochs
  spent by each.
* ``overhead``: suggest → job queued for one trial: the time of one decision round that
  asks the sampler for a trial and queues its job (validation, job row, trial row,
  commit), with the sweep's history growing to ``--trials`` trials; on SQLite and on
  PostgreSQL (``--pg-url``, skipped when unreachable), for ``random`` and ``tpe``.

Usage::

    python bench/bench_sweeps.py                  # both
    python bench/bench_sweeps.py --mode search --epochs 20
    python bench/bench_sweeps.py --mode search --epochs 8 --seeds 3 --show-trials   # each trial's curve
    python bench/bench_sweeps.py --mode overhead --trials 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sqlalchemy as sa
from sqlalchemy import select

from service.config import Settings
from service.db.engine import Database
from service.db.migrate import upgrade
from service.db.models import Attempt, Dataset, Job, Metric, Node, Sweep, SweepTrial
from service.db.types import utcnow
from service.schemas.sweeps import SweepCreate
from service.services import sweep_rounds, sweeps
from service.services.tokens import Principal, create_token
from service.states import Role

PG_URL = os.environ.get("TORCHYARD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
LEARNING_RATES = [0.001, 0.01, 0.1, 1.0]
BATCH_SIZES = [16, 64, 256]


def _setup(url: str, data_dir: Path) -> tuple[Database, Settings, Principal, str]:
    upgrade(url)
    settings = Settings(database_url=url, data_dir=data_dir)
    db = Database(settings.sqlalchemy_url)
    with db.transaction() as session:
        token, _plain = create_token(session, f"bench-{uuid.uuid4().hex[:6]}", Role.USER)
        dataset = Dataset(
            owner_id=token.id,
            name="digits",
            source="upload",
            storage_path="unused",
            classes=[str(i) for i in range(10)],
            class_counts={str(i): 1 for i in range(10)},
            num_images=10,
            size_bytes=1,
            sha256="0" * 64,
        )
        # Seen, not ready: submissions fit the cluster and no scheduler places the trials.
        node = Node(
            name=f"bench-{uuid.uuid4().hex[:6]}",
            address="127.0.0.1",
            units=4,
            accelerator="cpu",
            token_id=token.id,
            status="lost",
            last_heartbeat_at=utcnow() + timedelta(days=1),
        )
        session.add_all([dataset, node])
        session.flush()
        principal = Principal(id=token.id, name=token.name, role=Role.USER)
        return db, settings, principal, dataset.id


def _body(dataset: str, **over: Any) -> SweepCreate:
    body: dict[str, Any] = {
        "name": "bench",
        "job": {
            "model": {"architecture": "resnet18"},
            "train_dataset": dataset,
            "validation_dataset": dataset,
            "parameters": {"epochs": 20},
        },
        "search_space": {
            "parameters.learning_rate": {"type": "categorical", "choices": LEARNING_RATES},
            "parameters.batch_size": {"type": "categorical", "choices": BATCH_SIZES},
        },
        "objective": {"metric": "val.top1", "goal": "maximize"},
        "algorithm": "grid",
        "max_trials": len(LEARNING_RATES) * len(BATCH_SIZES),
        "max_concurrent_trials": 4,
        "seed": 1,
    }
    body.update(over)
    return SweepCreate.model_validate(body)


# --- search -------------------------------------------------------------------------------


class Trainer:
    """One trial's model: an MLP on the 8x8 digits, trained one epoch at a time."""

    data: Any = None

    def __init__(self, lr: float, batch_size: int, seed: int) -> None:
        import torch

        if Trainer.data is None:
            torch.set_num_threads(1)
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split

            x, y = load_digits(return_X_y=True)
            xt, xv, yt, yv = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
            Trainer.data = [torch.tensor(a, dtype=torch.float32) for a in (xt, xv)] + [
                torch.tensor(a) for a in (yt, yv)
            ]
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def epoch(self) -> float:
        import torch

        xt, xv, yt, yv = Trainer.data
        order = torch.randperm(len(xt), generator=self.gen)
        for i in range(0, len(xt), self.batch_size):
            idx = order[i : i + self.batch_size]
            self.opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(xt[idx]), yt[idx])
            if not torch.isfinite(loss):
                return float("nan")
            loss.backward()
            self.opt.step()
        with torch.no_grad():
            return float((self.model(xv).argmax(1) == yv).float().mean())


def _run_sweep(db: Database, settings: Settings, principal: Principal, body: SweepCreate, epochs: int) -> Any:
    """Drive a sweep to its end, training its live trials an epoch per round as a worker would."""
    with db.session() as session:
        sweep_id = sweeps.create_sweep(session, settings, principal, body).id
    trainers: dict[str, Trainer] = {}
    done_epochs: dict[str, int] = {}
    while True:
        with db.transaction() as session:
            live = list(
                session.scalars(
                    select(Job).where(
                        Job.sweep_id == sweep_id, Job.status.in_(["queued", "running", "cancelling"])
                    )
                )
            )
            for job in live:
                _advance(session, job, trainers, done_epochs, epochs)
        sweep_rounds.drive(db, settings)
        with db.read_session() as session:
            sweep = session.get(Sweep, sweep_id)
            assert sweep is not None
            if sweep.status != "running":
                trials = list(session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id)))
                return sweep, trials


def _advance(session: Any, job: Job, trainers: dict[str, Trainer], done: dict[str, int], epochs: int) -> None:
    now = utcnow()
    attempt = session.scalars(select(Attempt).where(Attempt.job_id == job.id)).first()
    if job.status == "cancelling":  # pruned: its ranks stop
        job.status, job.finished_at = "cancelled", now
        if attempt is not None:
            attempt.status, attempt.finished_at = "cancelled", now
        return
    if attempt is None:
        attempt = Attempt(job_id=job.id, number=1, status="running", master_addr="x", master_port=1)
        session.add(attempt)
        session.flush()
        job.status, job.started_at, job.scheduled_at, job.attempts_count = "running", now, now, 1
        params = job.spec["parameters"]
        trainers[job.id] = Trainer(params["learning_rate"], params["batch_size"], params["random_seed"])
        done[job.id] = 0
    done[job.id] += 1
    value = trainers[job.id].epoch()
    if value == value:  # not NaN
        session.add(
            Metric(
                job_id=job.id,
                attempt_id=attempt.id,
                attempt=1,
                name="val.top1",
                value=value,
                epoch=done[job.id],
                step=done[job.id],
                rank=0,
                time=now,
            )
        )
    if done[job.id] >= epochs or value != value:
        job.status, job.finished_at, job.model_sha256 = "succeeded", now, "0" * 64
        attempt.status, attempt.finished_at = "succeeded", now


def search(epochs: int, seeds: list[int], show_trials: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        db, settings, principal, dataset = _setup(url, Path(tmp) / "data")
        grid_size = len(LEARNING_RATES) * len(BATCH_SIZES)
        rows = []
        for seed in seeds:
            started = time.perf_counter()
            _grid, grid_trials = _run_sweep(db, settings, principal, _body(dataset, seed=seed), epochs)
            grid_s = time.perf_counter() - started
            started = time.perf_counter()
            _tpe, tpe_trials = _run_sweep(
                db,
                settings,
                principal,
                _body(
                    dataset,
                    name="tpe-asha",
                    algorithm="tpe",
                    early_stopping={"type": "asha", "min_epochs": 1, "reduction_factor": 3},
                    seed=seed,
                ),
                epochs,
            )
            tpe_s = time.perf_counter() - started
            for name, trials, seconds in (("grid", grid_trials, grid_s), ("tpe+asha", tpe_trials, tpe_s)):
                best = max((t.value for t in trials if t.value is not None), default=float("nan"))
                spent = sum(t.epochs for t in trials)
                pruned = sum(t.state == "pruned" for t in trials)
                rows.append((seed, name, len(trials), pruned, best, spent, seconds))
                if show_trials:
                    for t in sorted(trials, key=lambda t: t.number):
                        curve = " ".join(f"{t.steps()[e]:.3f}" for e in sorted(t.steps()))
                        print(f"  #{t.number:<2} {t.params} {t.state:9} {t.epochs:>2} epochs: {curve}")
                print(
                    f"seed {seed} {name}: {len(trials)} trials, {pruned} pruned, best {best:.4f}, "
                    f"{spent} epochs, {seconds:.1f} s",
                    flush=True,
                )
        print(
            f"search space: {len(LEARNING_RATES)} learning rates x {len(BATCH_SIZES)} batch sizes "
            f"({grid_size} points), {epochs} epochs per trial, 4 trials at a time"
        )
        print(
            f"{'seed':>4}  {'search':9} {'trials':>6} {'pruned':>6} {'best val.top1':>13} {'epochs':>7} {'wall s':>7}"
        )
        for seed, name, n, pruned, best, spent, seconds in rows:
            print(f"{seed:>4}  {name:9} {n:>6} {pruned:>6} {best:>13.4f} {spent:>7} {seconds:>7.1f}")
        for seed in seeds:
            g = next(r for r in rows if r[0] == seed and r[1] == "grid")
            t = next(r for r in rows if r[0] == seed and r[1] == "tpe+asha")
            print(
                f"seed {seed}: TPE+ASHA best {100 * (t[4] - g[4]):+.2f} points vs the grid's, "
                f"with {100 * t[5] / g[5]:.0f} % of its epochs"
            )
        db.dispose()


# --- overhead -----------------------------------------------------------------------------


def overhead(url: str, label: str, trials: int, algorithm: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db, settings, principal, dataset = _setup(url, Path(tmp) / "data")
        body = _body(
            dataset,
            algorithm=algorithm,
            max_trials=trials,
            max_concurrent_trials=1,
            search_space={
                "parameters.learning_rate": {"type": "float", "low": 0.001, "high": 1.0, "log": True},
                "parameters.batch_size": {"type": "int", "low": 8, "high": 256, "log": True},
            },
        )
        with db.session() as session:
            sweep_id = sweeps.create_sweep(session, settings, principal, body).id
        times = []
        for n in range(1, trials):
            with db.transaction() as session:
                job = session.scalars(
                    select(Job).where(Job.sweep_id == sweep_id, Job.status == "queued")
                ).one()
                now = utcnow()
                attempt = Attempt(job_id=job.id, number=1, status="succeeded", master_addr="x", master_port=1)
                session.add(attempt)
                session.flush()
                session.add(
                    Metric(
                        job_id=job.id,
                        attempt_id=attempt.id,
                        name="val.top1",
                        value=(n % 7) / 7,
                        epoch=1,
                        step=1,
                        rank=0,
                        time=now,
                    )
                )
                job.status, job.started_at, job.finished_at, job.model_sha256 = (
                    "succeeded",
                    now,
                    now,
                    "0" * 64,
                )
            started = time.perf_counter()
            result = sweep_rounds.drive(db, settings)  # records the ended trial, asks and queues the next
            times.append(time.perf_counter() - started)
            assert len(result.created) == 1, result
        times.sort()
        p50 = statistics.median(times)
        p95 = times[int(0.95 * (len(times) - 1))]
        print(
            f"{label:10} {algorithm:6} {trials:>6} trials: suggest -> queued p50 {1000 * p50:6.1f} ms, "
            f"p95 {1000 * p95:6.1f} ms, last 10 mean {1000 * statistics.mean(times[-10:]):6.1f} ms"
        )
        db.dispose()


def _pg_database() -> str | None:
    try:
        admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
        name = f"torchyard_bench_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        return sa.make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    except Exception as exc:  # skipped, said so
        print(f"PostgreSQL skipped: {exc}")
        return None


def _drop_pg(url: str) -> None:
    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{sa.make_url(url).database}" WITH (FORCE)'))
    admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["search", "overhead", "both"], default="both")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--show-trials", action="store_true", help="print every trial's curve")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    if args.mode in ("search", "both"):
        search(args.epochs, args.seeds, args.show_trials)
    if args.mode in ("overhead", "both"):
        with tempfile.TemporaryDirectory() as tmp:
            for algorithm in ("random", "tpe"):
                overhead(f"sqlite:///{tmp}/{algorithm}.db", "SQLite", args.trials, algorithm)
        for algorithm in ("random", "tpe"):
            url = _pg_database()
            if url is None:
                break
            try:
                overhead(url, "PostgreSQL", args.trials, algorithm)
            finally:
                _drop_pg(url)


if __name__ == "__main__":
    main()
