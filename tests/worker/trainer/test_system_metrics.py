"""Each rank's system sampler (worker/trainer/system_metrics.py) under a fake clock, and its
readings of this very process from ``/proc``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torchyard.contract.metrics import SYS_METRIC_NAMES
from worker.system_probe import GpuProbe, process_rss_bytes, process_tree_cpu_seconds, sampling_interval
from worker.trainer.system_metrics import SystemSampler


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.wall = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def read_points(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def make_sampler(tmp_path: Path, clock: FakeClock, cpu: list[float], *, rank: int = 3) -> SystemSampler:
    return SystemSampler(
        tmp_path / "sys.jsonl",
        rank,
        5.0,
        pid=1234,
        clock=clock,
        wall=lambda: clock.wall,
        cpu_seconds=lambda pid: cpu[0],
        rss_bytes=lambda pid: 200 << 20,
    )


def test_samples_once_per_interval_with_the_window_figures(tmp_path: Path) -> None:
    clock, cpu = FakeClock(), [10.0]
    sampler = make_sampler(tmp_path, clock, cpu)
    # 4 steps of 1 s each, 0.25 s of each waiting for the batch: under the 5 s interval, nothing yet.
    for step in range(1, 5):
        started = clock.now
        clock.now += 1.0
        sampler.step_done(1, step, started=started, fetched=started + 0.25, now=clock.now)
    assert read_points(tmp_path / "sys.jsonl") == []
    # The fifth step ends 5 s in, 1.5 CPU-s later (30 % of one core), having waited 0.75 s.
    cpu[0] = 11.5
    started = clock.now
    clock.now += 1.0
    sampler.step_done(1, 5, started=started, fetched=started + 0.75, now=clock.now)
    points = {p["name"]: p for p in read_points(tmp_path / "sys.jsonl")}
    assert set(points) == {"sys.cpu_percent", "sys.rss_bytes", "sys.input_wait_fraction"}
    assert points["sys.cpu_percent"]["value"] == pytest.approx(30.0)
    assert points["sys.rss_bytes"]["value"] == 200 << 20
    assert points["sys.input_wait_fraction"]["value"] == pytest.approx((4 * 0.25 + 0.75) / 5.0)
    assert {(p["rank"], p["epoch"], p["step"], p["time"]) for p in points.values()} == {(3, 1, 5, clock.wall)}
    # The next window starts there: nothing until 5 s more have passed.
    started = clock.now
    clock.now += 4.0
    sampler.step_done(1, 6, started=started, fetched=started, now=clock.now)
    assert len(read_points(tmp_path / "sys.jsonl")) == 3
    clock.now += 1.0
    sampler.step_done(1, 7, started=clock.now - 1.0, fetched=clock.now - 1.0, now=clock.now)
    later = [p for p in read_points(tmp_path / "sys.jsonl") if p["step"] == 7]
    assert {p["name"]: p["value"] for p in later}["sys.input_wait_fraction"] == 0.0
    assert {p["name"]: p["value"] for p in later}["sys.cpu_percent"] == 0.0  # no CPU time since


def test_an_epoch_end_samples_a_short_window_once(tmp_path: Path) -> None:
    clock, cpu = FakeClock(), [1.0]
    sampler = make_sampler(tmp_path, clock, cpu, rank=0)
    sampler.flush(1, 0)  # no step yet: nothing
    assert read_points(tmp_path / "sys.jsonl") == []
    clock.now += 0.5
    sampler.step_done(1, 1, started=100.0, fetched=100.4, now=clock.now)
    sampler.flush(1, 1)
    sampler.flush(1, 1)  # the window is empty again: no second point at the same step
    points = read_points(tmp_path / "sys.jsonl")
    assert sorted(p["name"] for p in points) == [
        "sys.cpu_percent",
        "sys.input_wait_fraction",
        "sys.rss_bytes",
    ]
    assert {p["name"]: p["value"] for p in points}["sys.input_wait_fraction"] == pytest.approx(0.8)


def test_gpu_figures_join_when_there_is_a_probe_and_are_left_out_when_unreadable(tmp_path: Path) -> None:
    class Utilization:
        gpu = 87

    class Memory:
        used = 3 << 30

    class FakeNvml:
        broken = False

        def nvmlDeviceGetUtilizationRates(self, handle: object) -> Utilization:
            if self.broken:
                raise RuntimeError("GPU is lost")
            return Utilization()

        def nvmlDeviceGetMemoryInfo(self, handle: object) -> Memory:
            return Memory()

    nvml = FakeNvml()
    clock, cpu = FakeClock(), [0.0]
    sampler = make_sampler(tmp_path, clock, cpu)
    sampler.gpu = GpuProbe(nvml, handle=object())
    clock.now += 5
    sampler.step_done(2, 9, started=clock.now - 1, fetched=clock.now - 1, now=clock.now)
    values = {p["name"]: p["value"] for p in read_points(tmp_path / "sys.jsonl")}
    assert values["sys.gpu_util"] == 87 and values["sys.gpu_memory_bytes"] == 3 << 30
    assert set(values) == set(SYS_METRIC_NAMES)
    nvml.broken = True
    clock.now += 5
    sampler.step_done(2, 10, started=clock.now - 1, fetched=clock.now - 1, now=clock.now)
    names = {p["name"] for p in read_points(tmp_path / "sys.jsonl") if p["step"] == 10}
    assert names == {"sys.cpu_percent", "sys.rss_bytes", "sys.input_wait_fraction"}


def test_no_nvml_device_means_no_probe() -> None:
    # No GPU on this machine, or a UUID no GPU has: absent, never an error.
    assert GpuProbe.open(uuid="GPU-00000000-0000-0000-0000-000000000000") is None
    assert GpuProbe.open() is None


def test_the_interval_setting() -> None:
    assert sampling_interval({}) == 5.0
    assert sampling_interval({"TORCHYARD_SYS_METRICS_INTERVAL_S": "0"}) == 0.0
    assert sampling_interval({"TORCHYARD_SYS_METRICS_INTERVAL_S": " 0.5 "}) == 0.5
    for bad in ("-1", "soon", "nan", "inf"):
        with pytest.raises(ValueError, match="TORCHYARD_SYS_METRICS_INTERVAL_S"):
            sampling_interval({"TORCHYARD_SYS_METRICS_INTERVAL_S": bad})


def test_proc_readings_count_a_busy_child_and_the_resident_memory() -> None:
    before = process_tree_cpu_seconds(os.getpid())
    assert before is not None
    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\nprint('done', flush=True)\ninput()"
    child = subprocess.Popen(
        [sys.executable, "-c", busy], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        # The live child's 0.3 CPU-s count in this process's tree.
        after = process_tree_cpu_seconds(os.getpid())
        assert after is not None and after - before >= 0.3
    finally:
        child.communicate("\n", timeout=10)
    rss = process_rss_bytes(os.getpid())
    assert rss is not None and rss > 10 << 20
    gone = child.pid
    assert process_tree_cpu_seconds(gone) is None and process_rss_bytes(gone) is None
