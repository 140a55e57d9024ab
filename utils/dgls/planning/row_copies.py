"""Row copies: which swap units a layer-major step keeps over a layer's micro-batches, and what the rest costs.

Why
    A layer-major step (:mod:`..engine.layer_major`) runs each layer (a *row*) over all N micro-batches. A layer
    streamed as swap units (:mod:`..streaming.units`) uses its K units again in each micro-batch. With K no more than
    the pool's S slots they all stay (each fetched once a direction a step); with more, something must come again in
    each micro-batch after the first. This module is the one rule for what stays (the engine's
    :mod:`..engine.row_keeping` applies it) and the planner's model of what a step then copies and how long it takes
    (:func:`simulate_rows`, used by :func:`.planner.simulate` when the probe's step has such rows).

The rule (:func:`plan_row`), from one micro-batch's uses of the row's streamed units
    - K <= S: every unit is kept (no prefetch evicts it) until the row's last micro-batch.
    - K > S and S >= 3: S - 2 units are kept, chosen greedily to leave the fewest bytes fetched per micro-batch
      after the first (:func:`repeat_misses`: the others share the 2 free slots, least recently used first, so a
      copy can land in one while the other is read); in those micro-batches the prefetch stays within the row's
      units (the next layer's units would take a slot the row needs again). Before, such a row kept none.
    - K > S and S < 3: nothing is kept (no slot to spare beside the one being read and the one being filled).
    - The row's last micro-batch keeps nothing: the units it is done with make room for the next layer's.

The step model (:func:`simulate_rows`)
    - The probe's uses are one step; consecutive uses of one caller layer in one phase are a row; a row whose uses
      are the same run repeated ``micro_batches`` times is a repeated row (:func:`step_rows`).
    - Residency is replayed over the step: a slot per resident entry, at most ``slot_count`` of them; a use of a
      streamed entry that is not resident copies it into a free slot, or else into the least recently used slot that
      no kept unit holds and none of the next ``prefetch`` streamed entries the step uses (the engine's prefetch
      protects them; in a repeated row's micro-batch but the last, none: the units not kept share the other slots
      least recently used first, as :func:`plan_row` counts). The copy
      starts once the copy stream is free and the slot's last use has ended (as :func:`.disk_plan.simulate_reads`,
      whose replay this is with residency: reads from disk precede their copies, one at a time); compute waits for
      it.
    - Prefetch is not replayed: copies start as early as their slot allows (the host runs ahead), which is what
      ``prefetch + 1`` slots bound.

Invariants
    - Pure: no device, no engine; the same inputs give the same answer.
    - A step without repeated rows is not this module's: :func:`.planner.simulate` replays it as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..memory.layout import LayerSizes, human_bytes, slot_count

if TYPE_CHECKING:  # the planner imports this module
    from .planner import StepProfile, UseTiming

SHARED_SLOTS = 2  # slots left to a row's other units while some are kept: one read, one being filled


@dataclass(frozen=True)
class RowPlan:
    """What a row keeps over its micro-batches but the last, and what it fetches again in each after the first."""

    kept: frozenset[int]  # entries no prefetch evicts
    within: frozenset[int] | None  # the prefetch takes only these entries (None: any)
    refetched: tuple[int, ...]  # per micro-batch after the first: the entries fetched again, in order

    @property
    def keeps_all(self) -> bool:
        return not self.refetched


def distinct(uses: Iterable[int]) -> list[int]:
    """Entries in the order of their first use."""
    return list(dict.fromkeys(uses))


def repeat_misses(uses: Sequence[int], kept: Iterable[int], slots: int) -> tuple[int, ...]:
    """The entries fetched again when ``uses`` (one micro-batch's uses of streamed entries) run once more, with
    ``kept`` pinned in their slots and the others sharing the remaining ``slots`` least recently used first (the
    second of two runs: steady state)."""
    kept = frozenset(kept)
    room = max(1, slots - len(kept))
    resident: OrderedDict[int, None] = OrderedDict()
    misses: list[int] = []
    for run in range(2):
        for e in uses:
            if e in kept:
                continue
            if e in resident:
                resident.move_to_end(e)
                continue
            if run:
                misses.append(e)
            resident[e] = None
            if len(resident) > room:
                resident.popitem(last=False)
    return tuple(misses)


def plan_row(uses: Sequence[int], slots: int, nbytes: Mapping[int, int] | None = None) -> RowPlan:
    """The rule of the module doc for a row whose micro-batch uses the streamed entries ``uses`` (in order);
    ``nbytes``: each entry's copy bytes (the fewest bytes fetched again is chosen; None: the fewest fetches)."""
    units = distinct(uses)
    if len(units) <= slots:
        return RowPlan(frozenset(units), None, ())
    budget = slots - SHARED_SLOTS if slots > SHARED_SLOTS else 0
    kept: list[int] = []
    for _ in range(budget):  # greedy: the unit whose keeping leaves the fewest fetches (ties: the earliest used)
        rest = [u for u in units if u not in kept]
        kept.append(min(rest, key=lambda u: (_cost(repeat_misses(uses, [*kept, u], slots), nbytes), units.index(u))))
    return RowPlan(frozenset(kept), frozenset(units) if kept else None, repeat_misses(uses, kept, slots))


def _cost(misses: Sequence[int], nbytes: Mapping[int, int] | None) -> int:
    return sum(nbytes.get(e, 0) for e in misses) if nbytes is not None else len(misses)


# ---------------------------------------------------------------- the step
@dataclass(frozen=True)
class Row:
    """Uses ``start`` to ``stop`` of a step: one caller layer in one phase, ``count`` runs of ``period`` uses."""

    owner: int
    start: int
    stop: int
    period: int

    @property
    def count(self) -> int:
        return (self.stop - self.start) // self.period


def step_rows(uses: Sequence[UseTiming], owners: Mapping[int, int], micro_batches: int) -> list[Row]:
    """The rows of a step's uses (see the module doc); ``owners``: entry -> caller layer."""
    rows: list[Row] = []
    start = 0
    for k in range(1, len(uses) + 1):
        if k < len(uses) and _row_key(uses[k], owners) == _row_key(uses[start], owners):
            continue
        length = k - start
        period = length
        if micro_batches > 1 and length % micro_batches == 0:
            p = length // micro_batches
            layers = [u.layer for u in uses[start:k]]
            if all(layers[i] == layers[i % p] for i in range(length)):
                period = p
        rows.append(Row(owners.get(uses[start].layer, uses[start].layer), start, k, period))
        start = k
    return rows


def _row_key(use: UseTiming, owners: Mapping[int, int]) -> tuple[int, object]:
    return owners.get(use.layer, use.layer), use.phase


@dataclass(frozen=True)
class RowStep:
    """One predicted step in steady state with rows kept as :func:`plan_row` says."""

    step_ms: float
    copied_bytes: int  # weights copied in the step
    refetched_bytes: int  # of which copies of units a micro-batch after the first fetched again
    refetched_layers: tuple[int, ...]  # caller layers whose units were fetched again


def repeated_rows(sizes: Sequence[LayerSizes], profile: StepProfile) -> list[Row]:
    """The step's repeated rows that use more than one entry that can stream per micro-batch ([] without: the step
    model of :func:`.planner.simulate` applies as it is). Whatever a plan streams, so every plan of a profile is
    replayed by one model."""
    if profile.micro_batches < 2:
        return []
    streamed = {s.index for s in sizes if s.streamable_bytes}
    owners = {s.index: s.owner for s in sizes}
    rows = step_rows(profile.uses, owners, profile.micro_batches)
    return [
        r
        for r in rows
        if r.count > 1 and len({u.layer for u in profile.uses[r.start : r.start + r.period]} & streamed) > 1
    ]


class RowModel:
    """What :func:`simulate_rows` derives from the step alone (its rows, each entry's owner and bytes) and the rows'
    plans per streamed set and slot count: built once for a search over many plans of one profile."""

    def __init__(self, sizes: Sequence[LayerSizes], profile: StepProfile) -> None:
        self.owners = {s.index: s.owner for s in sizes}
        self.copy_bytes = {s.index: s.copy_bytes for s in sizes}
        self.rows = [r for r in step_rows(profile.uses, self.owners, profile.micro_batches) if r.count > 1]
        self._uses = profile.uses
        self._plans: dict[tuple[tuple[int, ...], int], RowPlan] = {}

    def plan(self, row: Row, streamed: set[int], slots: int) -> RowPlan:
        first = [u.layer for u in self._uses[row.start : row.start + row.period] if u.layer in streamed]
        key = (tuple(_collapsed(first)), slots)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_row(key[0], slots, self.copy_bytes)
        return plan


def simulate_rows(
    sizes: Sequence[LayerSizes],
    profile: StepProfile,
    streamed: Iterable[int],
    prefetch: int,
    steps: int = 3,
    model: RowModel | None = None,
) -> RowStep:
    """The last of ``steps`` replayed steps (the module doc); ``model``: the profile's, if built already."""
    model = model if model is not None else RowModel(sizes, profile)
    streamed = set(streamed)
    uses, n = profile.uses, len(profile.uses)
    slots = slot_count(len(streamed), prefetch)
    owners, copy_bytes = model.owners, model.copy_bytes
    pinned: list[frozenset[int]] = [frozenset()] * n  # per use: the entries kept while it runs
    horizon = list(range(n, 2 * n))  # per use: where the uses the prefetch sees end (exclusive)
    refetch_at: list[bool] = [False] * n  # per use: a copy there is a micro-batch's refetch
    for row in model.rows:
        plan = model.plan(row, streamed, slots)
        for k in range(row.start, row.stop - row.period):
            pinned[k] = plan.kept
            horizon[k] = k + 1  # the units share what the kept leave least recently used first (plan_row)
        for k in range(row.start + row.period, row.stop):
            refetch_at[k] = True
    layer_of, compute = [u.layer for u in uses], [u.compute_ms for u in uses]
    ahead: dict[int, frozenset[int]] = {}  # per use, once asked: what the prefetch protects (_ahead)
    reads = profile.disk_reads
    resident: OrderedDict[int, None] = OrderedDict()
    last_end: dict[int, float] = {}
    ring_free = [0.0] * 2
    copy_free = reader_free = t = 0.0
    read_count = 0
    step_end = [0.0] * steps
    copied = [0] * steps
    refetched = [0] * steps
    layers: set[int] = set()
    for step in range(steps):
        for j in range(n):
            e = layer_of[j]
            if e not in streamed:
                t += compute[j]
                continue
            if e in resident:
                resident.move_to_end(e)
            else:
                free_at = 0.0
                if len(resident) >= slots:
                    if j not in ahead:
                        ahead[j] = _ahead(layer_of, streamed, prefetch, j, horizon[j])
                    victim = _victim(resident, pinned[j], ahead[j])
                    del resident[victim]
                    free_at = last_end.get(victim, 0.0)
                start = max(free_at, copy_free)
                if e in reads:
                    b = read_count % len(ring_free)
                    read_count += 1
                    reader_free = max(free_at, reader_free, ring_free[b]) + reads[e] / profile.read_bytes_per_ms
                    start = max(start, reader_free)
                copy_free = start + copy_bytes.get(e, 0) / profile.bytes_per_ms
                if e in reads:
                    ring_free[(read_count - 1) % len(ring_free)] = copy_free
                t = max(t, copy_free)
                resident[e] = None
                copied[step] += copy_bytes.get(e, 0)
                if refetch_at[j]:
                    refetched[step] += copy_bytes.get(e, 0)
                    if step == steps - 1:
                        layers.add(owners.get(e, e))
            t += compute[j]
            last_end[e] = t
        step_end[step] = t
    last = steps - 1
    step = step_end[last] - step_end[last - 1] if steps > 1 else step_end[last]
    return RowStep(step, copied[last], refetched[last], tuple(sorted(layers)))


def index_ranges(indices: Iterable[int]) -> str:
    """0,1,2,5,7,8 -> '0-2,5,7-8' (each index once)."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def _ahead(layers: Sequence[int], streamed: set[int], depth: int, j: int, horizon: int) -> frozenset[int]:
    """The next ``depth`` streamed entries other than use ``j``'s that the step (repeated) uses after it, before
    ``horizon``: the engine's prefetch protects them from eviction."""
    n = len(layers)
    found: list[int] = []
    for k in range(j + 1, max(j + 1, min(horizon, j + 1 + n))):
        e = layers[k % n]
        if e in streamed and e != layers[j] and e not in found:
            found.append(e)
            if len(found) == depth:
                break
    return frozenset(found)


def _victim(resident: OrderedDict[int, None], pinned: frozenset[int], ahead: frozenset[int]) -> int:
    """The least recently used resident entry neither kept nor about to be used; else not kept; else any."""
    fallback = None
    for v in resident:
        if v not in pinned:
            if v not in ahead:
                return v
            if fallback is None:
                fallback = v
    return fallback if fallback is not None else next(iter(resident))


def _collapsed(uses: Iterable[int]) -> list[int]:
    """Consecutive uses of one entry as one (a turnaround)."""
    out: list[int] = []
    for e in uses:
        if not out or out[-1] != e:
            out.append(e)
    return out


def refetch_line(micro_batches: int, slots: int, layers: Sequence[int], extra_bytes: int, kept: int) -> str:
    """The start-up line where units are fetched again per micro-batch ('' where none is)."""
    if not layers or micro_batches < 2:
        return ""
    keeping = f"at least {kept} of each layer's units kept, the others" if kept else "none of them kept: their units"
    return (
        f"DGLS: layer-major over {micro_batches} micro-batches: layers {index_ranges(layers)} have more streamed "
        f"swap units than the {slots} slots ({keeping} fetched again in each micro-batch after the first: "
        f"{human_bytes(extra_bytes)} more copied a step); a deeper --prefetch (slots = prefetch + 1), a larger "
        "--swap_unit_mb or a larger --vram_budget keeps them all"
    )
