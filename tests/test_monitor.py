"""Memory monitor, the windowed step summary, and how the drop-in reports them (CPU, fast)."""

import dataclasses

import psutil
import pytest

from utils.dgls.memory import monitor as monitor_module
from utils.dgls.memory.monitor import MemoryMonitor, check_pinned_budget, is_wsl
from utils.dgls.trainers.diffusion_pipe import PipelineInterception
from utils.dgls.watching.stats import StepStats, StepWindow, clock

GiB = 1024**3
MiB = 1024**2
WSL_VERSION = "Linux version 5.15.153.1-microsoft-standard-WSL2 (root@941d701f84f1) (gcc (GCC) 11.2.0) #1 SMP"


@pytest.fixture
def not_wsl(monkeypatch):
    monkeypatch.setattr(monitor_module, "_proc_version", lambda: "Linux version 6.8.0-45-generic (gcc 13.2.0)")


@pytest.fixture
def wsl(monkeypatch):
    monkeypatch.setattr(monitor_module, "_proc_version", lambda: WSL_VERSION)


def test_reading_agrees_with_psutil(not_wsl):
    monitor = MemoryMonitor("cpu", lambda: 12345)
    reading = monitor.read()
    vm, rss = psutil.virtual_memory(), psutil.Process().memory_info().rss
    assert reading.ram_total == vm.total
    assert abs(reading.rss - rss) < 64 * MiB
    assert abs(reading.ram_used - (vm.total - vm.available)) < 256 * MiB
    assert 0 <= reading.ram_percent <= 100
    assert abs(reading.swap_used - psutil.swap_memory().used) < 64 * MiB
    assert reading.pinned == 12345
    assert reading.vram_allocated == reading.vram_reserved == reading.vram_peak == 0  # CPU
    line = reading.line()
    assert line.startswith("memory: pinned") and "RSS" in line and "swap" in line and "VRAM" not in line
    scalars = reading.scalars()
    assert scalars["ram_percent"] == reading.ram_percent and scalars["rss_gib"] == pytest.approx(reading.rss / GiB)


def test_warnings_fire_once_per_kind(not_wsl):
    monitor = MemoryMonitor("cpu", lambda: 0, swap_at_start=100 * MiB)
    calm = dataclasses.replace(monitor.read(), ram_percent=50.0, swap_used=200 * MiB)
    assert monitor.warnings(calm) == []
    tight = dataclasses.replace(calm, ram_percent=95.0, ram_used=int(0.95 * 64 * GiB), ram_total=64 * GiB)
    swapping = dataclasses.replace(calm, swap_used=100 * MiB + 2 * GiB)
    (ram,) = monitor.warnings(tight)
    assert "95% used" in ram and "--pinned_ram_budget_gb" in ram and "f8_e4m3" in ram and ".wslconfig" not in ram
    (swap,) = monitor.warnings(swapping)
    assert "swap use grew by 2.00 GiB" in swap
    both = dataclasses.replace(tight, swap_used=swapping.swap_used)
    assert monitor.warnings(both) == []  # each kind once per run


def test_wsl_gets_wsl_advice(wsl):
    assert is_wsl()
    monitor = MemoryMonitor("cpu", lambda: 0)
    (ram,) = monitor.warnings(dataclasses.replace(monitor.read(), ram_percent=97.0))
    assert "%UserProfile%\\.wslconfig" in ram and "memory=" in ram and "pinned memory" in ram
    assert "--pinned_ram_budget_gb" in ram and "--cast_target bf16 f8_e4m3" in ram


def test_pinned_budget_check(not_wsl):
    assert check_pinned_budget(2 * GiB, available_bytes=4 * GiB) is None
    assert check_pinned_budget(6 * GiB, freed_bytes=3 * GiB, available_bytes=4 * GiB) is None
    text = check_pinned_budget(6 * GiB, available_bytes=4 * GiB)
    assert "6.00 GiB of pinned RAM requested but only 4.00 GiB" in text and ".wslconfig" not in text
    assert ".wslconfig" in check_pinned_budget(6 * GiB, available_bytes=4 * GiB, wsl=True)
    assert check_pinned_budget(1) is None  # against the real machine


def test_pinned_budget_check_detects_wsl(wsl):
    assert ".wslconfig" in check_pinned_budget(6 * GiB, available_bytes=4 * GiB)


def stats(**kw):
    return StepStats(**kw)


def test_step_window_aggregates_and_estimates():
    window = StepWindow(every=3, total_steps=10)
    s1 = stats(uses=10, misses=1, bytes_moved=2 * 10**9, copy_ms=100.0, wait_ms=5.0, peak_vram_bytes=3 * GiB)
    s2 = stats(uses=10, misses=0, bytes_moved=1 * 10**9, copy_ms=50.0, wait_ms=1.0, peak_vram_bytes=4 * GiB)
    s3 = stats(uses=20, misses=3, bytes_moved=3 * 10**9, copy_ms=150.0, wait_ms=0.5, peak_vram_bytes=2 * GiB)
    assert window.add(1.0, s1) is None and window.add(6.0, s2) is None
    line = window.add(2.0, s3)
    w = window.last
    assert (w.first_step, w.last_step) == (1, 3)
    assert w.median_s == 2.0 and w.mean_s == pytest.approx(3.0)
    assert w.gbps == pytest.approx(6e9 / 300.0 / 1e6)  # total bytes over total copy time, not a mean of rates
    assert w.wait_ms == pytest.approx(6.5)
    assert w.hit_rate == pytest.approx(1 - 4 / 40)
    assert w.peak_vram_bytes == 4 * GiB
    assert w.eta_s == pytest.approx(7 * 2.0)  # 7 steps left x the median
    assert line == "steps 1-3: median 2000 ms, mean 3000 ms, hits 90%, copies 20.0 GB/s, compute waited 6 ms, " + (
        "peak VRAM 4.00 GiB; ETA 0:14"
    )
    # A partial window at the end, and the next full one start where the last ended.
    assert window.add(4.0, s1) is None
    assert window.flush().startswith("steps 4-4: median 4000 ms")
    assert window.last.eta_s == pytest.approx(6 * 4.0)
    assert window.flush() is None


def test_step_window_without_total_or_cuda():
    window = StepWindow(every=2, device_type="cpu")
    window.add(0.1, stats(uses=4, misses=1))
    line = window.add(0.3)  # steps without stats (swapping off) still count
    assert window.last.eta_s is None and "ETA" not in line
    assert line == "steps 1-2: median 200 ms, mean 200 ms, hits 75%"


def test_clock():
    assert clock(14) == "0:14" and clock(3599) == "59:59" and clock(3 * 3600 + 62) == "3:01:02"


class FakeWriter:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, key, value, step):
        self.scalars[(key, step)] = value


class FakeSwapper:
    device = type("Device", (), {"type": "cpu"})()


def test_drop_in_reports_window_memory_and_tensorboard(not_wsl):
    lines = []
    interception = PipelineInterception({"verbose": True, "verbose_every": 2}, log=lines.append)
    interception.swapper, interception.writer = FakeSwapper(), FakeWriter()
    interception.monitor = MemoryMonitor("cpu", lambda: 0, swap_at_start=0)
    interception.window.device_type = "cpu"
    reading = dataclasses.replace(interception.monitor.read(), ram_percent=99.0, swap_used=0)
    for step in (1, 2, 3):
        interception.report(stats(uses=5, fetches=5, bytes_moved=10), step, 0.5, reading)
    text = "\n".join(lines)
    assert "dgls step 3: swap:" in text
    assert "dgls steps 1-2: median 500 ms" in text and "ETA" not in text  # run length unknown: no ETA
    assert "dgls memory: pinned" in text
    assert text.count("system RAM is 99% used") == 1
    writer = interception.writer.scalars
    assert writer[("dgls/bytes_moved", 3)] == 10
    assert writer[("dgls/memory/ram_percent", 2)] == 99.0 and ("dgls/memory/rss_gib", 1) in writer
