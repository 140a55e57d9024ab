"""Swap statistics per backward pass, from counters and CUDA events, read without stalling the device.

A *pass* runs from the end of one backward to the end of the next (so it holds a forward, its
backward, and any forward-only passes in between). Reads are pure: :meth:`StatsCollector.last_pass`
is the most recent finished pass and :meth:`StatsCollector.total` everything so far; a caller that
wants per-optimizer-step figures takes the difference of two totals (:meth:`StepStats.since`).
Copy and wait times come from CUDA events that are resolved once they have completed
(``event.query()``), so a read never synchronises the device unless it passes ``sync=True``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from ..memory.copier import Token, Wait
from ..memory.layout import human_bytes
from ..memory.transport import Copy, Direction
from ..streaming.schedule import Phase
from .listener import Listener


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
    """What swapping cost in one pass (or since some earlier point: see :meth:`since`)."""

    passes: int = 0  # backward passes finished
    uses: int = 0  # streamed-layer uses
    fetches: int = 0  # copies the compute side used
    misses: int = 0  # uses whose layer had no copy on its way
    bytes_moved: int = 0
    copy_ms: float = 0.0  # time the copy streams spent copying (resolved copies only)
    wait_ms: float = 0.0  # time the compute stream waited on weight copies (resolved waits only)
    # time the compute stream waited on activation restores (offload_activations: the inputs of a checkpointed call
    # coming back for its recompute), apart from the weights' waits: a restore issued too late shows here
    activation_wait_ms: float = 0.0
    pending: int = 0  # copies and waits whose timing is not resolved yet
    peak_vram_bytes: int = 0  # torch's max_memory_allocated at the end of the pass (DGLS never resets it)
    pinned_bytes: int = 0
    activation_bytes: int = 0  # checkpointed layers' inputs sent to host memory (offload_activations)
    disk_bytes: int = 0  # read from the disk tier (host_ram_budget)

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.copy_ms / 1e6 if self.copy_ms > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.uses if self.uses else 1.0

    def since(self, earlier: StepStats) -> StepStats:
        """The counters accumulated after ``earlier`` (both totals); peak and pinned are the latest."""
        return replace(
            self,
            passes=self.passes - earlier.passes,
            uses=self.uses - earlier.uses,
            fetches=self.fetches - earlier.fetches,
            misses=self.misses - earlier.misses,
            bytes_moved=self.bytes_moved - earlier.bytes_moved,
            copy_ms=self.copy_ms - earlier.copy_ms,
            wait_ms=self.wait_ms - earlier.wait_ms,
            activation_wait_ms=self.activation_wait_ms - earlier.activation_wait_ms,
            activation_bytes=self.activation_bytes - earlier.activation_bytes,
            disk_bytes=self.disk_bytes - earlier.disk_bytes,
        )

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(gbps=self.gbps, hit_rate=self.hit_rate)
        return d

    def _extras(self) -> str:
        activations = f", activations home {human_bytes(self.activation_bytes)}" if self.activation_bytes else ""
        if self.activation_wait_ms:
            activations += f", waited {self.activation_wait_ms:.1f} ms for their restores"
        return activations + (f", read from disk {human_bytes(self.disk_bytes)}" if self.disk_bytes else "")

    def short(self) -> str:
        return f"streamed {human_bytes(self.bytes_moved)}, waited {self.wait_ms:.1f} ms{self._extras()}"

    def line(self, device_type: str = "cuda") -> str:
        activations = self._extras()
        if device_type != "cuda":
            return (
                f"swap: {human_bytes(self.bytes_moved)} in {self.fetches} copies, hits {self.hit_rate:.0%}"
                + activations
            )
        return (
            f"swap: {human_bytes(self.bytes_moved)} in {self.fetches} copies, {self.gbps:.1f} GB/s, "
            f"compute waited {self.wait_ms:.1f} ms, hits {self.hit_rate:.0%}{activations}, "
            f"peak VRAM {human_bytes(self.peak_vram_bytes)}, pinned {human_bytes(self.pinned_bytes)}"
        )


@dataclass
class _Window:
    """One pass's stats and its event pairs not yet resolved."""

    stats: StepStats = field(default_factory=StepStats)
    copies: list = field(default_factory=list)  # (start, ready) CUDA events
    waits: list = field(default_factory=list)  # (before, after) CUDA events: waits for weight copies
    restores: list = field(default_factory=list)  # (before, after) CUDA events: waits for activation restores

    def unresolved(self) -> int:
        return len(self.copies) + len(self.waits) + len(self.restores)

    def resolve(self, sync: bool) -> tuple[float, float, float]:
        """Add the timings whose events completed (all of them with ``sync``); return the ms added."""
        added = [0.0, 0.0, 0.0]
        for k, pairs in enumerate((self.copies, self.waits, self.restores)):
            left = []
            for start, end in pairs:
                if sync or end.query():  # the end completing implies the start did (same stream)
                    added[k] += start.elapsed_time(end)
                else:
                    left.append((start, end))
            pairs[:] = left
        self.stats.copy_ms += added[0]
        self.stats.wait_ms += added[1]
        self.stats.activation_wait_ms += added[2]
        self.stats.pending = self.unresolved()
        return added[0], added[1], added[2]


def across_ranks(stats: StepStats, device: torch.device) -> StepStats:
    """``stats`` summed over every process of a ``torch.distributed`` job (every GPU, every pipeline
    stage), peak VRAM and pinned RAM the largest; unchanged in a one-process run. Every process must
    call it at the same point (it is two collectives)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stats
    counters = (
        "passes",
        "uses",
        "fetches",
        "misses",
        "bytes_moved",
        "copy_ms",
        "wait_ms",
        "activation_wait_ms",
        "pending",
        "activation_bytes",
        "disk_bytes",
    )
    summed = torch.tensor([float(getattr(stats, k)) for k in counters], dtype=torch.float64, device=device)
    largest = torch.tensor(
        [float(stats.peak_vram_bytes), float(stats.pinned_bytes)], dtype=torch.float64, device=device
    )
    dist.all_reduce(summed)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    total = {k: v.item() for k, v in zip(counters, summed)}
    timings = ("copy_ms", "wait_ms", "activation_wait_ms")
    ints = {k: int(v) for k, v in total.items() if k not in timings}
    peak, pinned = (int(v) for v in largest.tolist())
    return StepStats(**ints, **{k: total[k] for k in timings}, peak_vram_bytes=peak, pinned_bytes=pinned)


class StepReader:
    """Swap stats per training step from a swapper's running totals: :meth:`begin` before a step (optional:
    the end of the last step is a begin too), :meth:`end` after it. ``end`` sums over every process of a
    ``torch.distributed`` job, so every process calls it at the same point. ``sync`` waits for the GPU
    so that every copy and wait of the step is timed."""

    def __init__(self, swapper, sync: bool = False) -> None:
        self.swapper, self.sync = swapper, sync
        self.begin()

    def begin(self) -> None:
        self.mark = self.swapper.total_stats(self.sync)

    def end(self) -> StepStats:
        now = self.swapper.total_stats(self.sync)
        stats, self.mark = now.since(self.mark), now
        return across_ranks(stats, self.swapper.device)


class StatsCollector(Listener):
    """Counts uses, copies and waits per pass; keeps the last finished pass and the running total."""

    def __init__(self, device: torch.device, pinned_bytes: Callable[[], int]) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._pinned_bytes = pinned_bytes
        self._open = _Window()
        self._last = _Window()
        self._total = StepStats()
        self._unresolved: list[_Window] = []

    # ---------------------------------------------------------------- listener
    def use_started(self, layer: int, phase: Phase, streamed: bool, missed: bool) -> None:
        if streamed:
            self._open.stats.uses += 1
            self._open.stats.misses += missed
            self._total.uses += 1
            self._total.misses += missed

    def fetched(self, token: Token) -> None:
        s = self._open.stats
        s.fetches += 1
        s.bytes_moved += token.nbytes
        self._total.fetches += 1
        self._total.bytes_moved += token.nbytes
        if token.start is not None:
            self._open.copies.append((token.start, token.ready))

    def waited(self, wait: Wait) -> None:
        self._open.waits.append((wait.before, wait.after))

    def acquired(self, copy: Copy, before, after) -> None:
        """Waits for activation restores (those for weight copies come through :meth:`waited`, with their layer)."""
        if copy.direction is Direction.ACTIVATIONS_IN:
            self._open.restores.append((before, after))

    def copied(self, copy: Copy) -> None:
        if copy.direction is Direction.ACTIVATIONS_OUT:  # checkpointed inputs and recomputed tensors sent home
            self._open.stats.activation_bytes += copy.nbytes
            self._total.activation_bytes += copy.nbytes
        elif copy.direction is Direction.DISK_IN:  # the disk tier's reads (possibly on the copy worker)
            self._open.stats.disk_bytes += copy.nbytes
            self._total.disk_bytes += copy.nbytes

    def pass_ended(self) -> None:
        window, self._open = self._open, _Window()
        window.stats.passes = 1
        self._total.passes += 1
        if self.cuda:
            window.stats.peak_vram_bytes = torch.cuda.max_memory_allocated(self.device)
            self._total.peak_vram_bytes = max(self._total.peak_vram_bytes, window.stats.peak_vram_bytes)
        if window.unresolved():
            self._unresolved.append(window)
        self._last = window

    # ---------------------------------------------------------------- reads
    def _resolve(self, sync: bool) -> None:
        if sync and self.cuda and (self._unresolved or self._open.unresolved()):
            torch.cuda.synchronize(self.device)
        for window in [*self._unresolved, self._open]:
            copy_ms, wait_ms, restore_ms = window.resolve(sync)
            self._total.copy_ms += copy_ms
            self._total.wait_ms += wait_ms
            self._total.activation_wait_ms += restore_ms
        self._unresolved = [w for w in self._unresolved if w.unresolved()]

    def last_pass(self, sync: bool = False) -> StepStats:
        """The most recent finished pass (all zeros before the first one)."""
        self._resolve(sync)
        return replace(self._last.stats, pinned_bytes=self._pinned_bytes())

    def total(self, sync: bool = False) -> StepStats:
        """Everything so far, the pass in progress included."""
        self._resolve(sync)
        pending = sum(w.unresolved() for w in [*self._unresolved, self._open])
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else 0
        return replace(self._total, pending=pending, peak_vram_bytes=peak, pinned_bytes=self._pinned_bytes())


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
