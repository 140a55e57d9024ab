"""Per-step swap statistics, gathered from CUDA events without stalling the step."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch


def human_bytes(n: float) -> str:
    """GiB for large amounts, MiB for small ones (the demo moves a few MiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def timestamp(device: torch.device):
    """Now, as seen by the compute stream: a recorded CUDA event, or ``perf_counter()`` on the CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def elapsed_ms(start, end) -> float:
    """Milliseconds between two ``timestamp`` values (CUDA events must have completed)."""
    return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else (end - start) * 1000.0


@dataclass
class StepStats:
    """What swapping cost in one step (or since the last call to ``step_stats``)."""

    uses: int = 0  # streamed-layer uses
    fetches: int = 0
    misses: int = 0  # uses whose layer had not been prefetched
    bytes_moved: int = 0
    copy_ms: float = 0.0  # time the copy streams spent copying
    wait_ms: float = 0.0  # time the compute stream waited on copies
    peak_vram_bytes: int = 0
    pinned_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.copy_ms / 1e6 if self.copy_ms > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.uses if self.uses else 1.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(gbps=self.gbps, hit_rate=self.hit_rate)
        return d

    def short(self) -> str:
        return f"streamed {human_bytes(self.bytes_moved)}, waited {self.wait_ms:.1f} ms"

    def line(self, device_type: str = "cuda") -> str:
        if device_type != "cuda":
            return f"swap: {human_bytes(self.bytes_moved)} in {self.fetches} copies, hits {self.hit_rate:.0%}"
        return (
            f"swap: {human_bytes(self.bytes_moved)} in {self.fetches} copies, {self.gbps:.1f} GB/s, "
            f"compute waited {self.wait_ms:.1f} ms, hits {self.hit_rate:.0%}, "
            f"peak VRAM {human_bytes(self.peak_vram_bytes)}, pinned {human_bytes(self.pinned_bytes)}"
        )


@dataclass
class StatsCollector:
    """Accumulates counters and event pairs; resolves the timings when a step is read."""

    device: torch.device
    current: StepStats = field(default_factory=StepStats)
    _copy_events: list = field(default_factory=list)
    _wait_events: list = field(default_factory=list)

    def fetched(self, nbytes: int, demand: bool, start, end) -> None:
        self.current.fetches += 1
        self.current.bytes_moved += nbytes
        if start is not None:
            self._copy_events.append((start, end))

    def used(self, missed: bool) -> None:
        self.current.uses += 1
        self.current.misses += int(missed)

    def waited(self, before, after) -> None:
        self._wait_events.append((before, after))

    def take(self, pinned_bytes: int, reset_peak: bool) -> StepStats:
        """Close the step: read the event timings (waits for them) and start a new one."""
        stats, self.current = self.current, StepStats()
        if self._copy_events or self._wait_events:
            torch.cuda.synchronize(self.device)
        stats.copy_ms = sum(a.elapsed_time(b) for a, b in self._copy_events)
        stats.wait_ms = sum(a.elapsed_time(b) for a, b in self._wait_events)
        self._copy_events.clear()
        self._wait_events.clear()
        stats.pinned_bytes = pinned_bytes
        if self.device.type == "cuda":
            stats.peak_vram_bytes = torch.cuda.max_memory_allocated(self.device)
            if reset_peak:
                torch.cuda.reset_peak_memory_stats(self.device)
        return stats


def clock(seconds: float) -> str:
    """h:mm:ss (or m:ss under an hour) for an ETA."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@dataclass(frozen=True)
class WindowSummary:
    """The steps of one window together: a per-step line is too noisy to read trends from."""

    first_step: int
    last_step: int
    median_s: float
    mean_s: float
    gbps: float  # bytes copied / time the copy streams spent copying, over the window
    wait_ms: float  # total time compute waited on copies in the window
    hit_rate: float
    peak_vram_bytes: int
    eta_s: float | None  # steps left x median step time; None when the run length is unknown

    def line(self, device_type: str = "cuda") -> str:
        text = (
            f"steps {self.first_step}-{self.last_step}: median {self.median_s * 1000:.0f} ms, "
            f"mean {self.mean_s * 1000:.0f} ms, hits {self.hit_rate:.0%}"
        )
        if device_type == "cuda":
            text += (
                f", copies {self.gbps:.1f} GB/s, compute waited {self.wait_ms:.0f} ms, "
                f"peak VRAM {human_bytes(self.peak_vram_bytes)}"
            )
        if self.eta_s:  # None: run length unknown; 0: nothing left
            text += f"; ETA {clock(self.eta_s)}"
        return text


@dataclass
class StepWindow:
    """Collects step times and stats; every ``every`` steps gives a summary of that window
    (with an ETA when ``total_steps`` is known)."""

    every: int
    total_steps: int | None = None
    device_type: str = "cuda"
    steps_done: int = 0
    last: WindowSummary | None = None  # the latest summary
    _seconds: list[float] = field(default_factory=list, init=False)
    _stats: list[StepStats] = field(default_factory=list, init=False)

    def add(self, seconds: float, stats: StepStats | None = None) -> str | None:
        """Record one step; return the window's summary line when the window is full."""
        self._seconds.append(seconds)
        if stats is not None:
            self._stats.append(stats)
        self.steps_done += 1
        return self.flush() if len(self._seconds) >= self.every else None

    def flush(self) -> str | None:
        """Summarise the steps collected so far (a partial window at the end of a run) and start anew."""
        if not self._seconds:
            return None
        seconds, stats = self._seconds, self._stats
        self._seconds, self._stats = [], []
        median = statistics.median(seconds)
        copy_ms = sum(s.copy_ms for s in stats)
        uses = sum(s.uses for s in stats)
        left = None if self.total_steps is None else max(0, self.total_steps - self.steps_done)
        self.last = WindowSummary(
            first_step=self.steps_done - len(seconds) + 1,
            last_step=self.steps_done,
            median_s=median,
            mean_s=statistics.fmean(seconds),
            gbps=sum(s.bytes_moved for s in stats) / copy_ms / 1e6 if copy_ms > 0 else 0.0,
            wait_ms=sum(s.wait_ms for s in stats),
            hit_rate=1.0 - sum(s.misses for s in stats) / uses if uses else 1.0,
            peak_vram_bytes=max((s.peak_vram_bytes for s in stats), default=0),
            eta_s=None if left is None else left * median,
        )
        return self.last.line(self.device_type)
