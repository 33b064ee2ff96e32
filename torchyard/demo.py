"""``torchyard demo``: the whole product in one command, on embedded defaults.

It starts ``torchyard serve --with-worker`` (API + one local worker agent, SQLite) on a
free port with a demo data directory, writes scikit-learn's handwritten digits as PNG
class folders, uploads them as training and validation datasets, trains a ResNet-18
on them, shows the live progress and metrics, downloads and verifies the model
directory, checks it locally, prints the final top-1 and how to go on, and shuts the
service down.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from torchyard.client import Client, Job, ServiceUnreachableError
from torchyard.contract.errors import TorchyardError
from torchyard.extras import require
from torchyard.terminal import LiveProgress

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class DemoService:
    """``torchyard serve --with-worker`` as a child process on a demo data directory."""

    def __init__(self, data_dir: Path, port: int, slots: int | None, log_path: Path) -> None:
        self.data_dir = data_dir
        self.port = port
        self.slots = slots
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "torchyard.cli", "serve", "--with-worker", "--port", str(self.port)]
        if self.slots is not None:
            cmd += ["--worker-slots", str(self.slots)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        env["TORCHYARD_DATA_DIR"] = str(self.data_dir)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"the service exited with status {self.process.returncode}; its log ({self.log_path}) ends with:\n"
                + _tail(self.log_path)
            )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Client:
        """Until the API answers and the local worker's node is registered; a client for it."""
        deadline = time.monotonic() + timeout
        token_file = self.data_dir / "admin.token"
        client: Client | None = None
        try:
            while True:
                self._check_alive()
                if client is None and token_file.is_file():
                    client = Client(self.url, token_file.read_text().strip())
                if client is not None:
                    with contextlib.suppress(ServiceUnreachableError):
                        if client.cluster().ready_nodes >= 1:
                            ready, client = client, None
                            return ready
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the service was not ready after {timeout:.0f} s; see {self.log_path}"
                    )
                time.sleep(0.2)
        finally:
            if client is not None:
                client.close()

    def stop(self) -> int | None:
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return process.returncode


@contextlib.contextmanager
def running_service(service: DemoService) -> Iterator[DemoService]:
    service.start()
    try:
        yield service
    finally:
        service.stop()


def _say(out: TextIO, text: str = "") -> None:
    out.write(text + "\n")
    out.flush()


def _rel(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd()))
    return str(path)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    require("demo", "all")
    from torchyard.sample_data import write_digits

    out = out or sys.stdout
    started = time.monotonic()
    # torch takes seconds to import: have it ready for the model check at the end.
    threading.Thread(target=_preload_torch, name="preload-torch", daemon=True).start()
    root = Path(args.dir)
    data_dir = (root / "data").resolve()
    port = args.port or _free_port()
    service = DemoService(data_dir, port, args.slots, root / "serve.log")
    _say(out, f"torchyard demo: API + local worker on {service.url} (data in {_rel(data_dir)}, SQLite)")
    with running_service(service):
        digits = root / "digits"
        _say(out, "writing scikit-learn's handwritten digits as PNG class folders ...")
        train_dir, val_dir = write_digits(digits, per_class=args.per_class, size=32)
        client = service.wait_ready()
        try:
            node = client.cluster().nodes[0]
            _say(out, f"worker node {node.name!r} ready: {node.units} {node.accelerator} unit(s)")
            _say(
                out,
                f"web UI: {service.url}/ while the demo runs (sign in with the token in "
                f"{_rel(data_dir / 'admin.token')}; --keep-running keeps it up afterwards)",
            )
            train, train_reused = client.upload_or_reuse_dataset(train_dir, name="digits-train")
            val, val_reused = client.upload_or_reuse_dataset(val_dir, name="digits-val")
            how = (
                "reused (the same images were uploaded before)" if train_reused and val_reused else "uploaded"
            )
            _say(
                out,
                f"{how} digits-train ({train.num_images} images) and digits-val ({val.num_images} images), "
                f"{len(train.classes)} classes",
            )
            job = client.submit_job(
                {
                    "name": "digits-resnet18",
                    "model": {"architecture": "resnet18", "pretrained": False},
                    "train_dataset": train.id,
                    "validation_dataset": val.id,
                    "parameters": {
                        "epochs": args.epochs,
                        "batch_size": args.batch_size,
                        "learning_rate": args.lr,
                        # a short warm-up keeps the first steps at this rate stable
                        "warmup_epochs": 1 if args.epochs > 1 else 0,
                        "image_size": 32,
                        "augmentation": "light",
                        "patience": max(3, args.epochs),
                        "print_frequency": 5,
                    },
                    "resources": {"node_count": 1, "process_count_per_node": args.procs},
                }
            )
            _say(
                out,
                f"submitted job {job.id}: resnet18, image_size 32, augmentation light, {args.epochs} epochs",
            )
            final = _follow(client, job, out)
            if final.status != "succeeded":
                _say(out, f"the job ended {final.status}; rank 0's log ends with:")
                with contextlib.suppress(TorchyardError):
                    _say(out, "\n".join(client.logs(final.id, rank=0).splitlines()[-20:]))
                return 1
            model_dir = root / "models" / final.id
            client.download_model(final.id, model_dir)
            _say(
                out,
                f"model directory downloaded and verified: {_rel(model_dir)} (sha256 {final.model_sha256})",
            )
            _local_check(model_dir, val_dir, out)
            _summary(out, final, service, data_dir, model_dir, val_dir, time.monotonic() - started, args)
            if args.keep_running:
                _say(
                    out,
                    f"\nthe service keeps running: web UI at {service.url}/, API at {service.url}; "
                    "press Ctrl-C to stop it",
                )
                with contextlib.suppress(KeyboardInterrupt):
                    while service.process is not None and service.process.poll() is None:
                        time.sleep(0.5)
        except KeyboardInterrupt:
            _say(out, "\ninterrupted: stopping the service")
            return 130
        finally:
            client.close()
            _say(out, "shutting the service down ...")
    _say(out, "service stopped.")
    return 0


def _preload_torch() -> None:
    with contextlib.suppress(Exception):
        import torchyard.contract.model_archive
        import torchyard.modeldir  # noqa: F401


def _follow(client: Client, job: Job, out: TextIO) -> Job:
    progress = LiveProgress(out, epochs=job.parameters.get("epochs"))
    for event in client.events(job.id, logs=False):
        progress.handle(event.kind, event.data)
    return client.get_job(job.id)


def _local_check(model_dir: Path, val_dir: Path, out: TextIO) -> None:
    from torchyard.modeldir import evaluate_dir

    result = evaluate_dir(model_dir, val_dir)
    _say(
        out,
        f"local check with torchyard.modeldir: top-1 {result['top1']:.2%} "
        f"({result['correct']}/{result['n']} validation images)",
    )


def _summary(
    out: TextIO,
    job: Job,
    service: DemoService,
    data_dir: Path,
    model_dir: Path,
    val_dir: Path,
    seconds: float,
    args: argparse.Namespace,
) -> None:
    best = job.best or {}
    top1 = best.get("val.top1")
    epoch = best.get("epoch")
    top1_text = f"{float(top1):.2%}" if isinstance(top1, int | float) else "n/a"
    env = f"TORCHYARD_DATA_DIR={shlex.quote(_rel(data_dir))}"
    sample = next(iter(sorted((val_dir / "7").glob("*.png"))), None)
    command, setup = command_hint(Path(sys.executable), os.environ.get("PATH"))
    _say(out)
    _say(
        out,
        f"final top-1 (validation): {top1_text}" + (f" (best epoch {epoch})" if epoch is not None else ""),
    )
    _say(out, f"done in {seconds:.0f} s.")
    _say(out)
    _say(out, "How to go on:")
    _say(out, f"  command:       {command}")
    if args.keep_running:
        _say(
            out, f"  web UI:        {service.url}/ (up until you press Ctrl-C; sign in with the admin token)"
        )
    else:
        _say(
            out,
            "  web UI:        the service stops when the demo ends: run `torchyard demo --keep-running` to keep "
            "it and its web UI up, or start `torchyard serve --with-worker` and open http://127.0.0.1:8000/",
        )
    _say(out, f"  admin token:   {_rel(data_dir / 'admin.token')} (mode 0600; the CLI reads it, no copying)")
    _say(out, f"  model:         {_rel(model_dir)}")
    _say(
        out,
        f"  sample data:   {_rel(val_dir.parent / 'train')} and {_rel(val_dir)}: class folders of PNGs that "
        "`torchyard demo` wrote (upload them with `torchyard datasets upload NAME FOLDER`)",
    )
    _say(out, "  next commands:")
    if setup:
        _say(out, f"    {setup}{' ' * max(1, 36 - len(setup))}# puts `torchyard` on PATH in this shell")
    _say(out, f"    {env} torchyard serve --with-worker     # start the service again")
    again = f" (and `{setup}` there too)" if setup else ""
    _say(out, f"    export {env}                            # then, in another terminal{again}:")
    _say(out, "    torchyard jobs")
    # By id prefix: a name may fit several jobs (the demo's job has the same name each run).
    _say(out, f"    torchyard metrics {job.id[:8]}                  # a job's id, id prefix or (unique) name")
    _say(out, f"    torchyard logs {job.id[:8]} --rank 0")
    if sample is not None:
        _say(
            out, f"    torchyard predict {shlex.quote(_rel(model_dir))} {shlex.quote(_rel(sample))} --topk 3"
        )
    _say(
        out,
        "    torchyard submit --train digits-train --val digits-val --arch resnet18 "
        f"--image-size 32 --augmentation light --epochs {max(10, args.epochs)} --lr {args.lr} --follow",
    )


def command_hint(executable: Path, search_path: str | None) -> tuple[str, str | None]:
    """Where the ``torchyard`` command is, and the shell line that puts it on PATH
    (None when ``search_path`` already finds it). ``make demo`` installs it in
    ``.venv/bin``, which a fresh shell does not search."""
    script = executable.parent / "torchyard"
    found = shutil.which("torchyard", path=search_path)
    if found is not None and (not script.is_file() or Path(found).resolve() == script.resolve()):
        return f"`torchyard` ({found}) is on your PATH", None
    if not script.is_file():
        python = shlex.quote(str(executable))
        return f"`torchyard` is not installed as a command: run it as {python} -m torchyard.cli", None
    where = shlex.quote(_rel(script))
    activate = executable.parent / "activate"
    if not activate.is_file():
        return f"{where} (its folder is not on your PATH: type the whole path)", None
    line = f"source {shlex.quote(_rel(activate))}"
    return f"{where}, not on your PATH: run `{line}` in each new shell, or type {where}", line


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="run the whole product once: service + worker, digits datasets, a ResNet-18 job, the model",
    )
    demo.add_argument("--dir", default="torchyard-demo", help="working folder (default ./torchyard-demo)")
    demo.add_argument("--epochs", type=int, default=5, help="training epochs (default 5)")
    demo.add_argument(
        "--per-class", type=int, default=None, help="images per digit (default: all, about 180)"
    )
    demo.add_argument("--batch-size", type=int, default=32, help="images per batch (default 32)")
    demo.add_argument(
        "--lr",
        type=float,
        default=0.02,
        help="learning rate (default 0.02: the validation loss falls every epoch; 0.05 makes it jump)",
    )
    demo.add_argument("--procs", type=int, default=1, help="training processes (default 1)")
    demo.add_argument("--slots", type=int, default=None, help="CPU slots of the local worker")
    demo.add_argument("--port", type=int, default=None, help="API port (default: a free one)")
    demo.add_argument(
        "--keep-running",
        action="store_true",
        help="leave the service (API and web UI) up at the end, until Ctrl-C",
    )
    demo.set_defaults(handler=lambda args: run(args))
