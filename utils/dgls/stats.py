"""Per-step swap statistics, gathered from CUDA events without stalling the step."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


def human_bytes(n: float) -> str:
    """GiB for large amounts, MiB for small ones (the demo moves a few MiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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
