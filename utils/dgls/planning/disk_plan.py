"""Disk plan: which streamed layers' masters go to the disk tier, chosen so their reads hide behind compute, and
the floor the disk sets on a step.

Why: a spilled byte costs many pinned ones (a local disk reads a few GB/s, a PCIe copy runs at tens), so which
layers spill decides whether the disk tier costs nothing or sets the step time. The host RAM budget fixes how many
bytes must spill (:mod:`..streaming.tiers`); this model decides which.

Model (:func:`simulate_reads`): the step's layer uses in order, each with its compute time (measured by the VRAM
planner's probe, :func:`profile_costs`, or estimated from param counts by the builder,
:func:`~..engine.disk_planning.estimated_uses`), replayed as :func:`.planner.simulate` replays them (compute runs
the uses in order; a streamed layer's copy starts once its slot is free and the copy stream is), plus the disk
reader (:mod:`..memory.copier`, :mod:`..memory.disk_tier`):

- a spilled layer's read is issued ahead (:meth:`..engine.swapper.LayerSwapper.read_ahead`): as soon as the reader is
  free and its staging buffer is, not only with its fetch (``prefetch`` streamed uses ahead of its use; with full
  fine-tuning, ``read_ahead`` off, the fetch reads); its copy starts only once the read completed;
- the reads of a step run one at a time, in order, on the reader thread;
- a read lands in one of ``ring`` staging buffers, after the copy that read that buffer before (the ring's depth is
  how far ahead the reads run).

Choice (:func:`choose_spilled`), greedy until what the caller keeps in RAM fits its budget:

- Candidates are the streamed layers with bytes to read: a resident layer never spills.
- Each round takes the candidate that adds the least predicted step time per byte it frees; among those that add
  none (their reads hide), the one whose read has the longest hiding window (:func:`hiding_windows`: the compute
  between its fetch and its use, less its copy), so the layers whose copies hide behind the longest compute go
  first. Candidates are tried in window order and the first whose read hides is taken at once; where none hides, a
  round takes a batch of the cheapest that are not neighbours (thousands of swap units take few rounds).
- The greedy is myopic: where several reads hide, it takes them in window order, often neighbours, and the reads
  of a run of neighbours then queue behind each other with no compute between them (Wan2.1-14B's 160 equal swap
  units at 81 frames, half spilled: it chose the first 80 or so units, about 7% slower in the model than every
  other unit, which hides every read). So each cap also tries the evenly spread choice (:func:`spread_choice`: the
  fewest candidates, evenly spaced in run order, that fit), and the model keeps the faster.
- The staging ring (two buffers of the largest spilled layer) counts against the budget too: the greedy and the
  spread choice run once per cap on the spilled layers' size (a few of their distinct sizes) and the fastest
  predicted choice that fits wins (then the one reading the fewest bytes; the greedy's on a tie).
- The greedy itself (:func:`choose_by_model`) takes any replay: the state plan (:mod:`.state_plan`, full
  fine-tuning's masters and optimizer state) runs it over its own.

Invariants
    - Pure: no I/O, no device; the same inputs give the same choice.
    - Spilling nothing predicts the all-in-RAM step exactly as :func:`.planner.simulate` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..memory.layout import LayerSizes, human_bytes
from ..streaming.tiers import RING_BUFFERS

if TYPE_CHECKING:  # the planner imports this module: its replay runs reads where the probe's profile has them
    from .planner import StepProfile, UseTiming

RING = RING_BUFFERS  # staging buffers the reads land in
MAX_TRIED = 32  # candidates simulated per round when no read hides (the best windows first)
CAPS = 4  # caps on the spilled layers' size tried (the staging ring holds two of the largest)
BATCH_SHARE = 16  # a round of the greedy takes at most this share of the candidates (1 / BATCH_SHARE)
GREEDY_STEPS = 2  # steps replayed to rank candidates (the second is in steady state)
HIDDEN_MS = 1e-6  # a step this much slower, or less, is as fast


@dataclass(frozen=True)
class DiskCosts:
    """What the model replays: one step's uses, the bytes of each layer, the two bandwidths and the prefetch."""

    uses: tuple[UseTiming, ...]  # one whole step, in order (the next step repeats it)
    copy_bytes: Mapping[int, int]  # host->device bytes per fetch, by layer
    read_bytes: Mapping[int, int]  # disk bytes per read (whole pages), by layer
    copy_bytes_per_ms: float
    read_bytes_per_ms: float
    prefetch: int
    ring: int = RING
    measured: bool = False  # the compute times were measured (the VRAM planner's probe), not estimated
    measured_on: str = ""  # where, when not by the probe (:mod:`.disk_check`: "on pass 2")
    read_ahead: bool = True  # reads run ahead of their fetches (not with full fine-tuning: the fetch reads)

    @property
    def compute_ms(self) -> float:
        return sum(u.compute_ms for u in self.uses)


@dataclass(frozen=True)
class StepTimes:
    """One predicted step in steady state."""

    step_ms: float
    read_ms: float  # the reader's busy time in the step
    read_bytes: int  # bytes read from disk in the step
    reads: int


def simulate_reads(costs: DiskCosts, streamed: Iterable[int], spilled: Iterable[int], steps: int = 3) -> StepTimes:
    """The last of ``steps`` replayed steps with ``spilled`` (streamed layers) read from disk (the module doc)."""
    streamed, spilled = set(streamed), set(spilled)
    uses, n = costs.uses, len(costs.uses)
    slots, ring = max(costs.prefetch, 0) + 1, max(costs.ring, 1)
    hold_end: list[float] = []  # per copy: when its layer's run of consecutive uses ends
    ring_free = [0.0] * ring  # per staging buffer: when the copy that read it last ended
    copy_free = reader_free = t = 0.0
    read_count = 0
    step_end = [0.0] * steps
    busy = [0.0] * steps
    nbytes = [0] * steps
    counts = [0] * steps
    for k in range(steps * n):
        use = uses[k % n]
        layer = use.layer
        continues = k > 0 and uses[(k - 1) % n].layer == layer
        if layer in streamed and not continues:
            issue = hold_end[-slots] if len(hold_end) >= slots else 0.0
            start = max(issue, copy_free)
            if layer in spilled:
                b = read_count % ring
                read_count += 1
                read_start = max(reader_free, ring_free[b])  # read ahead: not bound to the fetch
                if not costs.read_ahead:
                    read_start = max(read_start, issue)
                read_ms = costs.read_bytes.get(layer, 0) / costs.read_bytes_per_ms
                reader_free = read_start + read_ms
                start = max(start, reader_free)
                busy[k // n] += read_ms
                nbytes[k // n] += costs.read_bytes.get(layer, 0)
                counts[k // n] += 1
            copy_free = start + costs.copy_bytes.get(layer, 0) / costs.copy_bytes_per_ms
            if layer in spilled:
                ring_free[(read_count - 1) % ring] = copy_free
            t = max(t, copy_free)
            hold_end.append(0.0)
        t += use.compute_ms
        if layer in streamed:
            hold_end[-1] = t
        step_end[k // n] = t
    last = steps - 1
    step = step_end[last] - step_end[last - 1] if steps > 1 else step_end[last]
    return StepTimes(step, busy[last], nbytes[last], counts[last])


def hiding_windows(costs: DiskCosts, streamed: Iterable[int]) -> dict[int, float]:
    """Per streamed layer: the shortest, over its fetches in a step with nothing on disk, of the time between its
    fetch and its use less its copy (the time a read of it has to hide in)."""
    streamed = set(streamed)
    uses, n = costs.uses, len(costs.uses)
    slots = max(costs.prefetch, 0) + 1
    hold_end: list[float] = []
    copy_free = t = 0.0
    windows: dict[int, float] = {}
    for k in range(2 * n):  # the second step: its first fetches overlap the first step's end
        use = uses[k % n]
        continues = k > 0 and uses[(k - 1) % n].layer == use.layer
        if use.layer in streamed and not continues:
            issue = hold_end[-slots] if len(hold_end) >= slots else 0.0
            copy_ms = costs.copy_bytes.get(use.layer, 0) / costs.copy_bytes_per_ms
            copy_free = max(issue, copy_free) + copy_ms
            t = max(t, copy_free)
            hold_end.append(0.0)
            if k >= n:
                window = t - issue - copy_ms
                windows[use.layer] = min(windows.get(use.layer, window), window)
        t += use.compute_ms
        if use.layer in streamed:
            hold_end[-1] = t
    return windows


def choose_spilled(
    costs: DiskCosts, streamed: Sequence[int], over: Callable[[list[int]], int], tried: int = MAX_TRIED
) -> list[int]:
    """Streamed layers to spill, in the order chosen, until ``over(chosen)`` (bytes over the RAM budget with
    ``chosen`` spilled, the staging ring included) is no more than 0 (the module doc; :func:`choose_by_model`, with
    this module's replay). Returns every candidate when no choice fits (the caller says so)."""
    candidates = [i for i in streamed if costs.read_bytes.get(i, 0) > 0]

    def score(chosen: list[int]) -> tuple[float, int]:
        times = simulate_reads(costs, streamed, chosen, GREEDY_STEPS)
        return times.step_ms, times.read_bytes

    def final(chosen: list[int]) -> tuple[float, int]:
        times = simulate_reads(costs, streamed, chosen)
        return times.step_ms, times.read_bytes

    position = {layer: k for k, layer in enumerate(streamed)}
    return choose_by_model(
        candidates, hiding_windows(costs, streamed), costs.read_bytes, score, over, position,
        max(costs.prefetch, 0) + 1, tried, final,
    )  # fmt: skip


def choose_by_model(
    candidates: Sequence[int],
    windows: Mapping[int, float],
    sizes: Mapping[int, int],
    score: Callable[[list[int]], tuple[float, int]],
    over: Callable[[list[int]], int],
    position: Mapping[int, int],
    near: int,
    tried: int = MAX_TRIED,
    final: Callable[[list[int]], tuple[float, int]] | None = None,
    spread_tries: bool = False,
) -> list[int]:
    """The greedy of the module doc over any model of the step (this module's, or the state plan's:
    :mod:`.state_plan`): ``candidates`` (in their run order), each one's hiding ``windows`` (ms; the longest first)
    and ``sizes`` (bytes it frees; the buffers are sized by the largest spilled), ``score(chosen)``: (predicted step
    ms, bytes moved a step), ``position`` and ``near`` (two layers within ``near`` positions of each other never enter
    one batch: their transfers would meet), ``final`` (the score the caps' choices are compared by; ``score`` if
    None), ``spread_tries`` (a round scores half its tries from the top of the ranking, half spread over the rest:
    where the windows say little, a transfer that hides may lie far down it). Each cap on the spilled layers' size (a
    few of the distinct sizes) gets its own greedy, and the fastest predicted (then the fewest bytes moved) that fits
    wins. Returns every candidate when no choice fits: the largest cap's greedy ends fitting or with every candidate,
    so a choice fits whenever spilling all of them does."""
    candidates = list(candidates)
    if over([]) <= 0:
        return []
    if not candidates:
        return candidates
    order = {layer: k for k, layer in enumerate(candidates)}
    ranked = sorted(candidates, key=lambda i: (-windows.get(i, 0.0), order[i]))
    distinct = sorted({sizes[i] for i in candidates})
    caps = sorted({distinct[min(len(distinct) - 1, (len(distinct) * q) // CAPS)] for q in range(1, CAPS + 1)})
    best: tuple[float, int, list[int]] | None = None
    for cap in caps:
        capped = [i for i in ranked if sizes[i] <= cap]
        greedy = _greedy(capped, sizes, score, over, position, near, tried, spread_tries)
        for chosen in (greedy, spread_choice(capped, position, over)):
            if over(chosen) > 0:
                continue
            step_ms, moved = (final or score)(chosen)
            if best is None or (step_ms, moved) < best[:2]:
                best = (step_ms, moved, chosen)
    return best[2] if best is not None else candidates


def spread_choice(
    candidates: Sequence[int], position: Mapping[int, int], over: Callable[[list[int]], int]
) -> list[int]:
    """The fewest of ``candidates`` that fit (``over`` no more than 0), evenly spaced in run order (``position``):
    k of n, the middle of each of k equal runs, so each spilled layer has about n / k layers' compute before it for
    its read. Every candidate when none fits. A bisection over k: the k it returns always fits (k = n is every
    candidate, which fits or nothing does); it is the fewest where the bytes freed grow with k, as they do where the
    sizes are alike (elsewhere a smaller k that fits may be missed, never one that does not fit taken)."""
    ordered = sorted(candidates, key=lambda i: position[i])
    n = len(ordered)

    def pick(k: int) -> list[int]:
        return [ordered[((2 * j + 1) * n) // (2 * k)] for j in range(k)]

    if n == 0 or over(ordered) > 0:
        return ordered
    low, high = 1, n  # over(pick(high)) <= 0
    while low < high:
        mid = (low + high) // 2
        if over(pick(mid)) <= 0:
            high = mid
        else:
            low = mid + 1
    return pick(low)


def _greedy(
    ranked: list[int],
    sizes: Mapping[int, int],
    score: Callable[[list[int]], tuple[float, int]],
    over: Callable[[list[int]], int],
    position: Mapping[int, int],
    near: int,
    tried: int,
    spread_tries: bool = False,
) -> list[int]:
    """Spill from ``ranked`` (the longest hiding window first) until ``over`` is no more than 0, or all of them.
    Each round scores up to ``tried`` of the rest in that order: the first that adds no step time is taken alone;
    else a batch of the least added step time per byte (at most a ``BATCH_SHARE``-th of the candidates, no two within
    ``near`` of each other in ``position``), so many layers take few rounds."""
    largest_batch = max(1, len(ranked) // BATCH_SHARE)
    chosen: list[int] = []
    base = score(chosen)[0]
    while over(chosen) > 0 and len(chosen) < len(ranked):
        taken = set(chosen)
        scored: list[tuple[float, int]] = []
        for layer in _tries([c for c in ranked if c not in taken], tried, spread_tries):
            added = score([*chosen, layer])[0] - base
            if added <= HIDDEN_MS:
                scored = [(0.0, layer)]
                break
            scored.append((added / sizes[layer], layer))
        batch: list[int] = []
        for _, layer in sorted(scored):
            if len(batch) >= largest_batch or (batch and over([*chosen, *batch]) <= 0):
                break
            if all(abs(position[layer] - position[other]) > near for other in batch):
                batch.append(layer)
        chosen += batch
        base = score(chosen)[0]
    return chosen


def _tries(rest: list[int], tried: int, spread_tries: bool) -> list[int]:
    """The ``tried`` candidates a round scores: the first of ``rest``, or half of them and half spread over the rest."""
    if not spread_tries or len(rest) <= tried:
        return rest[:tried]
    top = tried // 2
    tail = rest[top:]
    return rest[:top] + [tail[(j * len(tail)) // (tried - top)] for j in range(tried - top)]


@dataclass(frozen=True)
class DiskForecast:
    """The prediction the start-up line says: the disk floor against the step's compute, and whether reads hide."""

    costs: DiskCosts
    spilled: tuple[int, ...]
    streamed: int
    with_disk: StepTimes
    in_ram: StepTimes

    @property
    def floor_ms(self) -> float:
        """Bytes read from disk in a step over the disk's bandwidth: no step is faster."""
        return self.with_disk.read_bytes / self.costs.read_bytes_per_ms

    @property
    def added_ms(self) -> float:
        return self.with_disk.step_ms - self.in_ram.step_ms

    @property
    def hides(self) -> bool:
        return self.added_ms <= HIDDEN_MS + 0.01 * self.in_ram.step_ms

    def line(self) -> str:
        c = self.costs
        compute = (
            f"measured {c.measured_on or 'by the probe'}"
            if c.measured
            else "estimated from param counts, as long as the step's copies"
        )
        head = "DGLS disk plan, measured:" if c.measured_on else "DGLS disk plan:"  # disk_check's line: its own head
        said = (
            f"{head} {len(self.spilled)} of {self.streamed} streamed layers read from disk, "
            f"{human_bytes(self.with_disk.read_bytes)} a step at {c.read_bytes_per_ms / 1e6:.2f} GB/s: disk floor "
            f"{_ms(self.floor_ms)} against {_ms(c.compute_ms)} of compute a step ({compute}); predicted step "
            f"{_ms(self.with_disk.step_ms)}, {_ms(self.in_ram.step_ms)} with every streamed layer in RAM"
        )
        if self.hides:
            return said + ": the reads hide behind compute"
        # the reads run ahead on their own (the ring's depth, not --prefetch); without it a fetch starts each read
        earlier = "" if c.read_ahead else ", or a deeper --prefetch starts each read earlier"
        return said + f": the reads add {_ms(self.added_ms)} (raise --host_ram_budget{earlier})"


def _ms(value: float) -> str:
    return f"{value:.0f} ms" if value >= 100 else f"{value:.3g} ms"


def forecast(costs: DiskCosts, streamed: Sequence[int], spilled: Iterable[int]) -> DiskForecast:
    spilled = tuple(sorted(set(spilled)))
    return DiskForecast(
        costs, spilled, len(streamed), simulate_reads(costs, streamed, spilled), simulate_reads(costs, streamed, ())
    )


def profile_costs(sizes: Sequence[LayerSizes], profile: StepProfile, prefetch: int) -> DiskCosts:
    """The model's inputs from the VRAM planner's probe (measured compute and copies; the disk tier's reads, which
    the builder gives the planner: none where no layer is on disk)."""
    return DiskCosts(
        uses=profile.uses,
        copy_bytes={s.index: s.copy_bytes for s in sizes},
        read_bytes=dict(profile.disk_reads),
        copy_bytes_per_ms=profile.bytes_per_ms,
        read_bytes_per_ms=profile.read_bytes_per_ms,
        prefetch=prefetch,
        measured=True,
    )
