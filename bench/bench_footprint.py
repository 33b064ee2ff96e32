"""Footprint of the parts of torchyard (README.md): API process memory and client install size.

1. API memory: starts ``torchyard serve`` (SQLite, a temporary data directory, a free port)
   from this working tree and, with ``--before REF``, from the git revision REF as well
   (exported with ``git archive`` to a temporary folder and run with the same interpreter;
   only the code differs). VmRSS of the process is read from /proc when /healthz first
   answers, then again after one job submission that goes through architecture validation
   and once RSS has stopped changing for 3 s. Whether torch was loaded is read from the
   process's memory maps.
2. Client install: a fresh venv, ``pip install <this tree>`` (the base install, no extra),
   then the size of its site-packages, with and without pip and setuptools (which every
   venv brings).

Usage::

    python bench/bench_footprint.py                   # this tree's API + the client install
    python bench/bench_footprint.py --before 2b8fbc7  # and the API of an older revision for comparison
    python bench/bench_footprint.py --skip-install    # API memory only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torchyard", "service", "worker", "migrations")
# What every venv holds before anything is installed into it.
VENV_OWN = ("pip", "setuptools", "_distutils_hack", "distutils-precedence.pth", "pkg_resources")


@dataclass
class ApiFootprint:
    label: str
    rss_at_healthz_mib: float
    rss_settled_mib: float
    torch_loaded: bool
    startup_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def vm_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def torch_mapped(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps or "/torch/_C" in maps


@contextlib.contextmanager
def exported(ref: str) -> Iterator[Path]:
    """The code of git revision ``ref``, in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="torchyard-ref-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", ref, *PACKAGES],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        yield Path(tmp)


def measure_api(label: str, source: Path) -> ApiFootprint:
    """Start ``torchyard serve`` with the code under ``source``; read its VmRSS."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="torchyard-footprint-") as data:
        env = {
            **os.environ,
            "PYTHONPATH": str(source),
            "TORCHYARD_DATA_DIR": data,
            "TORCHYARD_ENV": "local",
        }
        for name in ("TORCHYARD_DATABASE_URL", "TORCHYARD_TOKEN", "TORCHYARD_URL"):
            env.pop(name, None)
        # the code that runs is the code under `source`, not the installed one
        where = subprocess.run(
            [sys.executable, "-c", "import torchyard; print(torchyard.__file__)"],
            env=env, cwd=data, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        if not Path(where).is_relative_to(source):
            raise RuntimeError(f"{label}: torchyard imports from {where}, not {source}")
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchyard.cli", "serve", "--port", str(port), "--log-level", "warning"],
            env=env, cwd=data, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = started + 120
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{label}: torchyard serve exited with {proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label}: /healthz did not answer in 120 s")
                time.sleep(0.1)
            startup = time.monotonic() - started
            at_healthz = vm_rss_mib(proc.pid)
            token = (Path(data) / "admin.token").read_text().strip()
            httpx.post(
                f"{url}/v1/jobs",
                json={"model": {"architecture": "resnet19"}, "train_dataset": "x", "validation_dataset": "x"},
                headers={"Authorization": f"Bearer {token}"},
                timeout=120,
            )
            settled, stable_since, last = at_healthz, time.monotonic(), -1.0
            while time.monotonic() - stable_since < 3 and time.monotonic() < deadline + 60:
                time.sleep(0.5)
                settled = vm_rss_mib(proc.pid)
                if abs(settled - last) > 1:
                    stable_since, last = time.monotonic(), settled
            return ApiFootprint(label, at_healthz, settled, torch_mapped(proc.pid), startup)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _size_mib(path: Path) -> float:
    if path.is_file():
        return path.stat().st_size / 2**20
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def measure_client_install() -> tuple[float, float, list[str]]:
    """``pip install`` this tree (no extra) into a fresh venv: (site-packages MiB, MiB
    without what every venv brings, the distributions installed)."""
    with tempfile.TemporaryDirectory(prefix="torchyard-client-") as tmp:
        source = Path(tmp) / "src"
        source.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, source / name)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
        env_dir = Path(tmp) / "venv"
        venv.EnvBuilder(with_pip=True).create(env_dir)
        python = str(env_dir / "bin" / "python")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        pip = subprocess.run(
            [python, "-m", "pip", "install", "--quiet", str(source)], env=env, capture_output=True, text=True
        )
        if pip.returncode != 0:
            raise RuntimeError(f"pip install failed:\n{pip.stdout}{pip.stderr}")
        site = next((env_dir / "lib").glob("python3*/site-packages"))
        total = _size_mib(site)
        own = sum(_size_mib(p) for p in site.iterdir() if p.name.split("-")[0] in VENV_OWN)
        listed = subprocess.run(
            [python, "-m", "pip", "list", "--format=freeze"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return total, total - own, listed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--before", metavar="REF", help="also measure the API of this git revision (e.g. main)"
    )
    parser.add_argument("--skip-install", action="store_true", help="leave out the client install")
    args = parser.parse_args()

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{datetime.date.today().isoformat()}"
    )
    results = []
    if args.before:
        with exported(args.before) as old:
            results.append(measure_api(f"before ({args.before})", old))
    results.append(measure_api("after (this tree)", ROOT))
    print("\nAPI process (torchyard serve, SQLite), VmRSS in MiB")
    print(f"{'code':<22} {'at /healthz':>12} {'settled':>9} {'torch loaded':>13} {'start-up':>9}")
    for r in results:
        print(
            f"{r.label:<22} {r.rss_at_healthz_mib:>12.1f} {r.rss_settled_mib:>9.1f} "
            f"{'yes' if r.torch_loaded else 'no':>13} {r.startup_s:>8.1f}s"
        )
    if not args.skip_install:
        total, own, listed = measure_client_install()
        print("\nclient-only install (pip install torchyard, no extra)")
        print(f"site-packages: {total:.1f} MiB; without pip and setuptools: {own:.1f} MiB")
        print("installed: " + " ".join(listed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
