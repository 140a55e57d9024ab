"""Timing training steps and their peak memory, and the one deadline a run keeps.

Steps are timed on the host with the device synchronised around each step, so a step's time is
what a training loop sees. A run has one :class:`Deadline`: the runner starts no method past it,
and a timed loop running when it passes stops once it has its minimum of steps.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from units import GiB


@dataclass(frozen=True)
class Deadline:
    """A point in ``time.perf_counter()`` time; ``Deadline.never()`` never passes."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.perf_counter() + seconds)

    @classmethod
    def never(cls) -> Deadline:
        return cls(float("inf"))

    def passed(self) -> bool:
        return time.perf_counter() > self.at


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    step: Callable[[], object],
    device: torch.device,
    warmup: int,
    steps: int,
    after: Callable[[], object] | None = None,
    deadline: Deadline | None = None,
    min_steps: int = 3,
) -> tuple[list[float], list]:
    """``warmup`` + ``steps`` calls of ``step()``; the timed steps' seconds and what ``after()`` returned
    after each (called outside the timing). Past ``deadline`` it stops once ``min_steps`` are timed."""
    times, extras = [], []
    for i in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        elapsed = time.perf_counter() - start
        extra = after() if after is not None else None
        if i >= warmup:
            times.append(elapsed)
            extras.append(extra)
        if deadline is not None and deadline.passed() and len(times) >= min_steps:
            break
    return times, extras


def reset_peaks(device: torch.device) -> None:
    """Start counting peak memory from here (what earlier rows left in reference cycles collected, the cache
    emptied, so reserved memory starts low too)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)


def peaks(device: torch.device) -> dict:
    """Peak allocated and reserved GiB since ``reset_peaks``, and the caching allocator's calls to the driver since
    then: ``cudaMalloc``s (a step that allocates afresh pays for them) and retries (an allocation that failed, freed
    the cache and tried again: each synchronizes the device). Nothing on CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB,
        "device_mallocs": stats.get("num_device_alloc", 0),
        "alloc_retries": stats.get("num_alloc_retries", 0),
    }
