"""Unit choice: the swap-unit size for a VRAM budget, knowing how many micro-batches a step runs layer-major.

Why
    :func:`.planner.unit_bytes_for_budget` sizes swap units for one micro-batch a pass: whole layers while two slots
    of the largest take at most a quarter of the budget, else units of a 24th of it, small so the slots leave room
    for activations and a deep prefetch. A layer-major step (:mod:`..engine.layer_major`) runs each layer over its N
    micro-batches, and a layer's units stay in the slots over them only when the slots hold them all
    (:func:`.row_copies.plan_row`); with more units than slots, the others are fetched again in each micro-batch
    after the first. Small units of uneven size are the worst case: a Flux-dev double block (diffusers' modules,
    bf16) at 3 GiB splits into 14 units of up to 113 MB (its modulation Linear cannot be split), and 14 slots of
    113 MB are twice the quarter, while units at its attention's and MLPs' size (5 of at most 151 MB) fit it. So the
    count of a layer's units matters as much as their size, and it is chosen here.

Why a rule and not the planner's step model
    The layers are split when the engine is built, before the probe step measures compute times, the copy
    bandwidth and the activations (:mod:`.autoplan`), so :func:`.row_copies.simulate_rows` has no profile to replay
    yet. The rule uses what is known: the candidate splits' sizes, the slots the planner can choose (its prefetch
    depths, :func:`.planner.prefetch_depths`) and the same quarter of the budget the whole-layer rule gives the
    slots. Within that quarter, the pool differs between candidates by less than a quarter of the budget, while a
    unit fetched again costs its bytes in each micro-batch after the first, in every streamed layer and in both
    directions: under a budget that splits layers (most layers stream), the bytes fetched again dominate.

The rule (:func:`choose_unit_bytes`)
    - One micro-batch (N = 1), or whole layers by the rule for one: that choice, unchanged.
    - Otherwise each candidate split (the one-micro-batch choice, and a unit size at each module size of the layers,
      :func:`..streaming.units.split_points`, where it splits a layer: the split's own answer, as its sizes count
      params in their storage dtype and the slots in their compute dtype) gets the slots its pool can have within a
      quarter of the budget: the fewest that hold every layer's streamed units, else the most the planner's prefetch
      depths give. Its cost is what :func:`.row_copies.plan_row` fetches again per micro-batch after the first at
      those slots (each layer's units in their order, once: the forward's row).
    - The one-micro-batch choice stays unless another candidate fetches fewer bytes again; then the candidate that
      fetches fewest wins (ties: the smaller pool, then fewer units). A split whose units all stay fetches none.
      One-micro-batch units of which not even two slots fit the quarter (a module that cannot split) lose to any
      split whose slots do, and the line says why.
    - ``--swap_unit_mb`` always wins (the builder asks only without it).

What it costs
    - Larger units raise the smallest footprint the planner can fall back to (two slots of the largest unit): from
      at most a 12th of the budget (two units of a 24th) to at most a quarter (two slots hold a layer's two units).
      A run whose activations leave less than that is refused after the probe with the planner's one line, which
      names ``--swap_unit_mb``; the start-up line gives the one-micro-batch size to pass there.

Invariants
    - Pure: sizes in, a size and its start-up line out; the same inputs give the same answer.
    - N = 1 gives :func:`.planner.unit_bytes_for_budget`'s answer and its line, word for word.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..memory.layout import LayerSizes, human_bytes, pool_bytes, slot_count
from .planner import PREFETCH_CHOICES, UNIT_SLOTS_SHARE, unit_bytes_for_budget
from .row_copies import plan_row

Split = Callable[[int | None], Sequence[LayerSizes]]  # unit bytes (None: whole) -> the entries' sizes then


@dataclass(frozen=True)
class SplitCost:
    """One candidate split within the slots' share of the budget."""

    unit_bytes: int
    slots: int  # the slots it gets (see the module doc)
    pool: int  # their bytes
    units: int  # the most streamed units of one layer
    largest: int  # the largest streamed entry's slot bytes
    entries: int  # streamed entries in all
    refetched: int  # bytes fetched again per micro-batch after the first, at ``slots``

    @property
    def keeps_all(self) -> bool:
        return self.refetched == 0


@dataclass(frozen=True)
class UnitChoice:
    """The largest swap unit in bytes (None: whole layers) and the start-up line that says why ('': none)."""

    unit_bytes: int | None
    line: str


def split_cost(sizes: Sequence[LayerSizes], unit_bytes: int, share: int) -> SplitCost | None:
    """``sizes`` (a split's entries) costed within ``share`` bytes of slots, every streamable entry streamed (the
    probe's placement, and most of a tight budget's); None when not even two slots fit."""
    streamed = [s.index for s in sizes if s.streamable_bytes]
    if not streamed:
        return None
    rows: dict[int, list[int]] = {}
    for i in streamed:
        rows.setdefault(sizes[i].owner, []).append(i)
    most = max(len(units) for units in rows.values())
    depths = set(PREFETCH_CHOICES) | {len(units) - 1 for units in rows.values() if len(units) > 1}
    fitting = sorted(p for p in depths if pool_bytes(sizes, streamed, p) <= share)
    if not fitting:
        return None
    holding = [p for p in fitting if slot_count(len(streamed), p) >= most]
    prefetch = holding[0] if holding else fitting[-1]
    slots = slot_count(len(streamed), prefetch)
    copy = {i: sizes[i].copy_bytes for i in streamed}
    refetched = sum(copy[e] for units in rows.values() for e in plan_row(units, slots, copy).refetched)
    largest = max(sizes[i].slot_bytes for i in streamed)
    return SplitCost(unit_bytes, slots, pool_bytes(sizes, streamed, prefetch), most, largest, len(streamed), refetched)


def choose_unit_bytes(
    whole: Sequence[LayerSizes], budget: int, micro_batches: int, split: Split, candidates: Iterable[int]
) -> UnitChoice:
    """The rule of the module doc. ``whole``: the layers' sizes unsplit; ``split(t)``: the entries' sizes with
    units of at most ``t`` bytes; ``candidates``: unit sizes to try beside the one-micro-batch choice."""
    single = unit_bytes_for_budget(whole, budget)
    if single is None:
        return UnitChoice(None, "")
    quarter = (
        "DGLS: two slots of the largest layer would take over a quarter of the budget: layers over "
        "{} stream as swap units (--swap_unit_mb to choose, 0 for whole layers)"
    )
    if micro_batches < 2:
        return UnitChoice(single, quarter.format(human_bytes(single)))
    share = budget // UNIT_SLOTS_SHARE
    base = split_cost(split(single), single, share)
    costs = [base] if base is not None else []
    if base is None or not base.keeps_all:
        for t in sorted(set(candidates) - {single}):
            entries = split(t) if t > 0 else whole
            if len(entries) > len(whole) and (cost := split_cost(entries, t, share)) is not None:  # t splits a layer
                costs.append(cost)
    best = min(costs, key=lambda c: (c.refetched, c.pool, c.entries), default=None)
    if best is None:  # not even two slots of the one-micro-batch units fit the share: nothing better is known
        return UnitChoice(single, quarter.format(human_bytes(single)))
    if base is not None and (base.keeps_all or best.refetched >= base.refetched):
        best = base
    return UnitChoice(best.unit_bytes, _line(best, base, single, micro_batches))


def _line(chosen: SplitCost, base: SplitCost | None, single: int, n: int) -> str:
    """The start-up line: what was chosen for ``n`` layer-major micro-batches, and why (bytes fetched again: per
    direction, in each micro-batch after the first, with every layer streamed)."""
    head = (
        f"DGLS: two slots of the largest layer would take over a quarter of the budget, and a step runs {n} "
        f"micro-batches layer-major: layers over {human_bytes(chosen.unit_bytes)} stream as swap units"
    )
    kept = (
        f"so each layer's units (at most {chosen.units}) fit {chosen.slots} slots ({human_bytes(chosen.pool)}) within "
        f"that quarter and stay over its {n} micro-batches (each copied once a direction a step)"
    )
    tail = " (--swap_unit_mb to choose, 0 for whole layers)"

    def again(cost: SplitCost) -> str:
        return f"about {human_bytes(cost.refetched)} a direction again in each micro-batch after the first"

    if chosen is base:
        if chosen.keeps_all:
            return f"{head}, {kept}{tail}"
        return (
            f"{head}; no unit size lets every layer's units fit the slots within that quarter: at {chosen.slots} "
            f"slots they fetch {again(chosen)} (the planner counts it){tail}"
        )
    before = f"the one-micro-batch size, {human_bytes(single)}, " + (
        f"would fetch {again(base)}" if base else "does not fit two slots within that quarter"
    )
    if chosen.keeps_all:
        return f"{head}, {kept}; {before}{tail}"
    least = f"the size that fetches least again at the slots within that quarter ({again(chosen)} at {chosen.slots})"
    return f"{head}, {least}; {before}{tail}"
