"""Planner: the fastest placement that fits a VRAM budget, from measured sizes and timings.

A probe (the first real training steps, run with every layer streamed) gives one step's
sequence of layer uses with each use's compute time, the activation peak and the copy
bandwidth. ``simulate`` replays that sequence on a model of the two streams: compute
runs the uses in order and waits for a streamed layer's copy; the copy stream copies one
layer at a time, each copy issued ``prefetch`` streamed uses ahead and into the slot that
the use ``prefetch + 1`` streamed uses earlier has finished with. ``plan_for_budget``
searches which layers stay resident (which ones, not only how many: resident layers
spread between streamed ones give the copies compute to hide behind) and the prefetch
depth, and keeps the placement with the lowest predicted step time that fits;
``shortlist`` also returns the best plans of other families predicted close to it, which
the placement driver measures on real steps before it settles (:mod:`.autoplan`).

Activations are planned with the weights. With activation offload the probe sends home the
inputs of every checkpointed call but the last ``prefetch`` (the smallest footprint) and
measures the largest call's inputs. Placements are searched at that footprint; then each plan
keeps on the device as many calls' inputs as its leftover budget holds (``keep_activations``):
offload only what the budget needs. Weights take the room first, since a resident byte saves two
copies a step (forward and backward fetch) and a kept activation byte one (its restore; the copy
home runs on the otherwise idle direction). The time model leaves restores out; the measured
trials rank the plans.

Layer-major accumulation (:mod:`..engine.layer_major`): the probe step runs its N micro-batches layer by layer, so its
use sequence is one micro-batch's (each use computing N of them) and its activation peak holds what the N micro-batches
keep together: each layer boundary's N tensors and each checkpointed call's N inputs. The weights and slots a plan
places are searched under what is left of the budget, so more micro-batches leave fewer resident layers, or (with
activation offload) more inputs sent home; the last layer's N calls always stay (``StepProfile.micro_batches``).

Full fine-tuning (a layer's every param trains) adds what the trainer keeps on the device for the params of
resident layers: their gradients and its optimizer state (``LayerSizes.trained_bytes``; a streamed layer's
params train on the host, so none of it), its optimizer state of the params resident in every placement, and
the device update buffers (``StepProfile.update_bytes``). The builder counts each from the object that
allocates it (:mod:`..engine.training_costs`); gradients sent home in groups are in the probe's activation
peak, as the probe streams every layer. A resident byte of such a layer costs several on the device, so the
same budget keeps fewer layers resident than for a LoRA.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..errors import DGLSUserError
from ..memory.layout import GiB, LayerSizes, device_bytes, human_bytes, pool_bytes, resident_bytes, training_bytes
from ..streaming.schedule import Phase
from .disk_plan import profile_costs, simulate_reads
from .row_copies import RowModel, repeated_rows, simulate_rows
from .row_copies import index_ranges as _ranges

PREFETCH_CHOICES = (1, 2, 3, 4)
# Split layers when 2 slots exceed 1/4 of the budget, into units <= 1/24 of it: a Wan-14B block at 4 GiB into its
# 50-135 MiB Linears' modules, a Flux block at 3 GiB into <= 128 MB, where 4 slots (prefetch 3) of them trained
# within those budgets (benchmarks/results/wan_fit_9f_p3.md, flux_fit_u128.md).
UNIT_SLOTS_SHARE, UNIT_SHARE = 4, 24


@dataclass(frozen=True)
class UseTiming:
    """One use of a layer in the probe step: its phase and the compute time it took."""

    layer: int
    phase: Phase
    compute_ms: float


@dataclass(frozen=True)
class StepProfile:
    """What the probe measured."""

    uses: tuple[UseTiming, ...]  # one whole step, in order (the next step repeats it)
    activation_bytes: int  # peak allocated during the step less what was allocated at its start
    reserved_overhead: int  # peak reserved less peak allocated: allocator slack
    bytes_per_ms: float  # host-to-device copy bandwidth
    # Activation offload (0 without): checkpointed calls of a pass whose inputs went home, the inputs of the
    # largest of them, and the calls whose inputs stayed on the device (the last max(1, prefetch)).
    sent_segments: int = 0
    segment_bytes: int = 0
    probe_kept: int = 0
    update_bytes: int = 0  # full fine-tuning's device update buffers: reserved at start-up, the same in every plan
    # Micro-batches of the probe step run layer-major (:mod:`..engine.layer_major`; 1: one micro-batch a pass). Their
    # boundary tensors and the inputs their checkpointed calls keep are in ``activation_bytes``; with offload, the
    # last layer's calls for every micro-batch stay on the device (``probe_kept`` counts them), so no plan keeps
    # fewer.
    micro_batches: int = 1
    # With a host RAM budget: the layers on disk (bytes per read) and the disk's read bandwidth; a plan's step then
    # waits for their reads too (:func:`~.disk_plan.simulate_reads`), so layers on disk are the ones worth keeping
    # resident.
    disk_reads: Mapping[int, int] = field(default_factory=dict)
    read_bytes_per_ms: float = 0.0

    @property
    def compute_ms(self) -> float:
        return sum(u.compute_ms for u in self.uses)


@dataclass(frozen=True)
class Plan:
    """A placement with its predictions."""

    streamed: tuple[int, ...]
    prefetch: int
    predicted_ms: float
    predicted_peak: int
    budget: int
    pattern: str
    kept_activations: int = 0  # checkpointed calls of a pass whose inputs stay on the device (0: no offload)
    micro_batches: int = 1  # run layer-major in each step (the probe's): its activations were measured for them all
    # Layer-major with swap units: copies of units a micro-batch after the first fetches again (their layers do not
    # keep all their streamed units in the slots; :mod:`.row_copies`), a step
    refetched_bytes: int = 0
    refetched_layers: tuple[int, ...] = ()

    def runs_like(self, other: Plan) -> bool:
        """Same streamed layers, and a prefetch depth that makes no difference (deeper than the
        streamed layers, it changes nothing: there are no more slots to fill)."""
        depth = max(len(self.streamed) - 1, 0)
        return self.streamed == other.streamed and min(self.prefetch, depth) == min(other.prefetch, depth)

    def describe(self, sizes: Sequence[LayerSizes]) -> str:
        resident = [s.index for s in sizes if s.streamable_bytes and s.index not in set(self.streamed)]
        return (
            f"DGLS plan ({self.pattern}): {len(self.streamed)} layers streamed, "
            f"resident {_ranges(resident) or 'none'}, "
            f"prefetch {self.prefetch}{self._activations()}; predicted step {self.predicted_ms:.0f} ms, "
            f"peak {self.predicted_peak / GiB:.2f} GiB of the {self.budget / GiB:.2f} GiB budget"
        )

    def _activations(self) -> str:
        kept = f", inputs of the last {self.kept_activations} checkpointed calls kept" if self.kept_activations else ""
        if self.micro_batches > 1:
            kept += f"; {self.micro_batches} micro-batches a step, layer-major, their activations measured together"
        if self.refetched_layers:
            kept += (
                f"; the swap units of layers {_ranges(self.refetched_layers)} outnumber the slots: "
                f"{human_bytes(self.refetched_bytes)} a step fetched again in micro-batches after the first"
            )
        return kept


# ---------------------------------------------------------------- memory
def planned_activation_bytes(profile: StepProfile, prefetch: int, kept: int | None = None) -> int:
    """The probe's activation peak, for a plan that keeps the inputs of ``kept`` checkpointed calls on the
    device (default and least: ``max(1, prefetch)``, as many as restores run ahead)."""
    if not profile.sent_segments:
        return profile.activation_bytes
    kept = max(max(1, prefetch) if kept is None else kept, profile.micro_batches)  # a layer-major step keeps N
    return max(0, profile.activation_bytes + (kept - profile.probe_kept) * profile.segment_bytes)


def predict_peak(
    sizes: Sequence[LayerSizes],
    profile: StepProfile,
    streamed: Iterable[int],
    prefetch: int,
    copy_streams: int = 1,
    kept: int | None = None,
) -> int:
    """Peak reserved bytes: resident weights and buffers, the pool, a full fine-tune's gradients, optimizer state
    and update buffers, activations, allocator slack."""
    streamed = list(streamed)
    placed = device_bytes(sizes, streamed, prefetch, copy_streams) + training_bytes(sizes, streamed)
    return placed + profile.update_bytes + planned_activation_bytes(profile, prefetch, kept) + profile.reserved_overhead


def minimum_bytes(
    sizes: Sequence[LayerSizes], profile: StepProfile | None, prefetch: int = 1, copy_streams: int = 1
) -> int:
    """The smallest footprint: every streamable layer streamed, ``prefetch + 1`` slots, and with activation
    offload the inputs of only the last ``prefetch`` checkpointed calls on the device (before the probe,
    ``profile`` None: without activations and update buffers)."""
    streamed = [s.index for s in sizes if s.streamable_bytes]
    extra = (
        (profile.update_bytes + planned_activation_bytes(profile, prefetch) + profile.reserved_overhead)
        if profile
        else 0
    )
    return device_bytes(sizes, streamed, prefetch, copy_streams) + training_bytes(sizes, streamed) + extra


def keep_activations(profile: StepProfile, plan: Plan) -> Plan:
    """``plan`` keeping on the device the inputs of as many more checkpointed calls as its budget has room for
    (up to all of them: then nothing goes home). Its placement is searched at the least kept (see the
    module doc), so this only spends what the weights left."""
    if not profile.sent_segments or not profile.segment_bytes:
        return plan
    least = max(1, plan.prefetch, profile.micro_batches)
    every = profile.probe_kept + profile.sent_segments
    extra = max(0, min(every - least, (plan.budget - plan.predicted_peak) // profile.segment_bytes))
    return replace(
        plan, kept_activations=least + extra, predicted_peak=plan.predicted_peak + extra * profile.segment_bytes
    )


def unit_bytes_for_budget(sizes: Sequence[LayerSizes], budget: int) -> int | None:
    """The swap-unit size for a VRAM budget (:mod:`..streaming.units`): None (whole layers) while two slots of the
    largest layer take at most a quarter of the budget, as for a Flux LoRA at 8 GiB; otherwise layers
    larger than a 24th of the budget are split into their child modules (a Wan-14B block at 4 GiB,
    a Flux block at 3 GiB), so the slots stop crowding out activations and the planner can afford a
    deeper prefetch of small units (which a layer's recompute and backward need twice)."""
    largest = max((s.slot_bytes for s in sizes if s.streamable_bytes), default=0)
    if 2 * largest <= budget // UNIT_SLOTS_SHARE:
        return None
    return budget // UNIT_SHARE


# ---------------------------------------------------------------- time
def simulate(
    sizes: Sequence[LayerSizes],
    profile: StepProfile,
    streamed: Iterable[int],
    prefetch: int,
    steps: int = 3,
    rows: RowModel | None = None,
) -> float:
    """Predicted milliseconds of one step in steady state (the last of ``steps`` replayed steps).

    The host runs ahead of the GPU, so a copy starts as soon as the copy stream is free and
    its slot is: the slot of the copy ``prefetch + 1`` copies earlier, free once that
    layer's last consecutive use has finished computing. A layer-major step whose swap units repeat per micro-batch
    is replayed with residency instead (:func:`.row_copies.simulate_rows`; ``rows``: its model, built once per
    search). Layers on disk (``profile.disk_reads``)
    are read first, one at a time: the replay is :func:`.disk_plan.simulate_reads` (with nothing on disk, the
    copies and compute alone).
    """
    if rows is None and repeated_rows(sizes, profile):
        rows = RowModel(sizes, profile)
    if rows is not None:  # layer-major with swap units: which units stay over micro-batches (:mod:`.row_copies`)
        return simulate_rows(sizes, profile, streamed, prefetch, steps, rows).step_ms
    costs = profile_costs(sizes, profile, prefetch)
    return simulate_reads(costs, streamed, profile.disk_reads, steps).step_ms


def prefetch_depths(sizes: Sequence[LayerSizes], profile: StepProfile) -> tuple[int, ...]:
    """The prefetch depths the search tries: :data:`PREFETCH_CHOICES`, and with layer-major swap units each depth
    whose slots hold all the units one of those layers streams (:mod:`.row_copies`: fetched once a step instead of
    once a micro-batch)."""
    candidates = {s.index for s in sizes if s.streamable_bytes}
    units = {
        len({u.layer for u in profile.uses[r.start : r.start + r.period]} & candidates)
        for r in repeated_rows(sizes, profile)
    }
    return tuple(sorted(set(PREFETCH_CHOICES) | {k - 1 for k in units if k > 1}))


# ---------------------------------------------------------------- search
def resident_patterns(candidates: list[int], resident_count: int) -> dict[str, list[int]]:
    """Resident sets of a given size: at both ends, spread evenly, or all at the start."""
    k, m = resident_count, len(candidates)
    head = (k + 1) // 2
    spread = sorted({candidates[min(m - 1, int((i + 0.5) * m / k))] for i in range(k)}) if k else []
    return {
        "ends": candidates[:head] + candidates[m - (k - head) :] if k - head else candidates[:head],
        "spread": spread,
        "first": candidates[:k],
    }


def disk_first(candidates: list[int], on_disk: Iterable[int], resident_count: int) -> list[int]:
    """A resident set of a given size that holds the layers on disk first (a read saved is worth many copies),
    spread among them, then the other layers spread."""
    on_disk = set(on_disk)
    disk = [c for c in candidates if c in on_disk]
    if resident_count <= len(disk):
        return resident_patterns(disk, resident_count)["spread"]
    rest = [c for c in candidates if c not in on_disk]
    return sorted(disk + resident_patterns(rest, resident_count - len(disk))["spread"])


def _check_minimum(sizes, profile, budget, prefetch_choices: Sequence[int], copy_streams) -> None:
    prefetch = min(prefetch_choices)
    need = minimum_bytes(sizes, profile, prefetch, copy_streams)
    if need > budget:
        streamed = [s.index for s in sizes if s.streamable_bytes]
        parts = {
            "resident weights and buffers": resident_bytes(sizes, streamed),
            "layer slots": pool_bytes(sizes, streamed, prefetch, copy_streams),
            "activations": planned_activation_bytes(profile, prefetch) + profile.reserved_overhead,
        }
        if training := training_bytes(sizes, streamed) + profile.update_bytes:  # full fine-tuning
            parts["optimizer state and update buffers"] = training
        largest = max(parts, key=parts.get)
        offloading = (
            "--checkpoint_units, --offload_recompute"  # inputs of checkpointed calls were offloaded already
            if profile.sent_segments
            else "--offload_activations with activation_checkpointing, --checkpoint_units, --offload_recompute"
        )
        remedy = {
            "activations": f"lower the activations ({offloading}, a smaller batch or resolution; "
            "--keep_piece_outputs wins back the time --checkpoint_units costs, for host RAM)",
            "layer slots": "stream smaller pieces (--swap_unit_mb, the MB of the largest swap unit: the slots hold "
            "two of the largest)",
            "resident weights and buffers": "train fewer params on the device, or store frozen weights smaller "
            "(--cast_target)",
            "optimizer state and update buffers": "update streamed layers on the host (--host_adam torch_fused: no "
            "device update buffers)",
        }[largest]
        described = " + ".join(f"{human_bytes(n)} of {name}" for name, n in parts.items())
        raise DGLSUserError(
            f"VRAM budget {human_bytes(budget)} is below the minimum {human_bytes(need)} ({described}; {largest} "
            f"dominate): raise --vram_budget, or {remedy}"
        )


def shortlist(
    sizes: Sequence[LayerSizes],
    profile: StepProfile,
    budget: int,
    count: int = 3,
    prefetch_choices: Sequence[int] | None = None,
    copy_streams: int = 1,
    within: float = 0.15,
) -> list[Plan]:
    """The best fitting plan of each (pattern, prefetch) family, fastest first: the planner's
    choice (improved greedily) and up to ``count - 1`` runners-up predicted within ``within``
    of it, distinct in pattern or prefetch, for the swapper to measure (the model ranks
    near-equal plans less reliably than one real step does). ``prefetch_choices``: default
    :func:`prefetch_depths`."""
    if prefetch_choices is None:
        prefetch_choices = prefetch_depths(sizes, profile)
    _check_minimum(sizes, profile, budget, prefetch_choices, copy_streams)
    candidates = [s.index for s in sizes if s.streamable_bytes]
    families: dict[tuple[str, int], Plan] = {}
    rows = RowModel(sizes, profile) if repeated_rows(sizes, profile) else None  # built once for the search
    for prefetch in prefetch_choices:
        for k in range(len(candidates) + 1):
            patterns = resident_patterns(candidates, k)
            if profile.disk_reads:  # with a host RAM budget, the layers on disk first
                patterns["disk first"] = disk_first(candidates, profile.disk_reads, k)
            for name, resident in patterns.items():
                streamed = set(candidates) - set(resident)
                peak = predict_peak(sizes, profile, streamed, prefetch, copy_streams)
                if peak > budget:
                    continue
                ms = simulate(sizes, profile, streamed, prefetch, rows=rows)
                plan = Plan(tuple(sorted(streamed)), prefetch, ms, peak, budget, name)
                best = families.get((name, prefetch))
                if best is None or _better(plan, best, sizes):
                    families[(name, prefetch)] = plan
    assert families  # the minimum fits, so "everything streamed" was considered
    ranked = sorted(families.values(), key=lambda p: (p.predicted_ms, sum(sizes[i].copy_bytes for i in p.streamed)))
    first = _improve(sizes, profile, ranked[0], copy_streams, rows)
    picks = [first]
    for plan in ranked[1:]:
        if len(picks) == count or plan.predicted_ms > first.predicted_ms * (1 + within):
            break
        if not any(plan.runs_like(p) for p in picks):
            picks.append(plan)
    return [
        with_refetches(sizes, profile, replace(keep_activations(profile, p), micro_batches=profile.micro_batches), rows)
        for p in picks
    ]


def with_refetches(sizes: Sequence[LayerSizes], profile: StepProfile, plan: Plan, rows: RowModel | None = None) -> Plan:
    """``plan`` with what its micro-batches after the first fetch again (layer-major swap units, :mod:`.row_copies`;
    ``rows``: the profile's model, if built)."""
    if rows is None and not repeated_rows(sizes, profile):
        return plan
    step = simulate_rows(sizes, profile, plan.streamed, plan.prefetch, model=rows)
    return replace(plan, refetched_bytes=step.refetched_bytes, refetched_layers=step.refetched_layers)


def plan_for_budget(
    sizes: Sequence[LayerSizes],
    profile: StepProfile,
    budget: int,
    prefetch_choices: Sequence[int] | None = None,
    copy_streams: int = 1,
) -> Plan:
    """The fitting placement with the lowest predicted step time (ties: fewer bytes streamed).

    Tries resident sets of every size in three patterns (four with layers on disk) and each prefetch depth, then
    improves the best one greedily (see ``_improve``).
    """
    return shortlist(sizes, profile, budget, 1, prefetch_choices, copy_streams)[0]


def _improve(
    sizes: Sequence[LayerSizes], profile: StepProfile, best: Plan, copy_streams: int, rows: RowModel | None = None
) -> Plan:
    """While a streamed layer can become resident within the budget, make resident the one
    that lowers the predicted time most."""
    streamed = set(best.streamed)
    while True:
        options = []
        for i in sorted(streamed):
            trial = streamed - {i}
            if predict_peak(sizes, profile, trial, best.prefetch, copy_streams) <= best.budget:
                options.append((simulate(sizes, profile, trial, best.prefetch, rows=rows), -sizes[i].copy_bytes, i))
        if not options:
            return best
        ms, _, i = min(options)
        if ms > best.predicted_ms * 0.999:
            return best
        streamed.discard(i)
        peak = predict_peak(sizes, profile, streamed, best.prefetch, copy_streams)
        pattern = best.pattern if best.pattern.endswith("+greedy") else best.pattern + "+greedy"
        best = Plan(tuple(sorted(streamed)), best.prefetch, ms, peak, best.budget, pattern)


def _better(a: Plan, b: Plan, sizes: Sequence[LayerSizes]) -> bool:
    """Lower predicted time wins by more than 0.1%; otherwise fewer streamed bytes, then less memory."""
    if a.predicted_ms < b.predicted_ms * 0.999:
        return True
    if a.predicted_ms > b.predicted_ms * 1.001:
        return False
    bytes_a = sum(sizes[i].copy_bytes for i in a.streamed)
    bytes_b = sum(sizes[i].copy_bytes for i in b.streamed)
    return (bytes_a, a.predicted_peak) < (bytes_b, b.predicted_peak)
