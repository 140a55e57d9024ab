"""The rule for swap units kept over a layer-major step's micro-batches, and the planner's model of what the rest
costs (utils/dgls/planning/row_copies.py): pure, on synthetic steps."""

from __future__ import annotations

import pytest

from utils.dgls.memory.layout import MB, LayerSizes
from utils.dgls.planning.planner import (
    PREFETCH_CHOICES,
    StepProfile,
    UseTiming,
    plan_for_budget,
    prefetch_depths,
    simulate,
)
from utils.dgls.planning.row_copies import plan_row, repeat_misses, simulate_rows, step_rows
from utils.dgls.streaming.schedule import Phase

F, B = Phase.FORWARD, Phase.BACKWARD
UNIT = 10 * MB
UNITS = 6  # per split layer


def split_model() -> list[LayerSizes]:
    """Layer 0 whole (small), layers 1 and 2 as a holder and 6 units of 10 MB each, layer 3 whole (small)."""
    sizes = [LayerSizes(0, "Embed", MB, 0)]
    for layer in (1, 2):
        sizes.append(LayerSizes(len(sizes), "Block", 0, 0, layer=layer, holder=True))
        for k in range(UNITS):
            sizes.append(LayerSizes(len(sizes), "Linear", UNIT, 0, layer=layer, part=f"u{k}"))
    sizes.append(LayerSizes(len(sizes), "Out", MB, 0, layer=3))
    return sizes


def layer_major_uses(sizes: list[LayerSizes], micro_batches: int, compute_ms: float = 1.0) -> tuple[UseTiming, ...]:
    """One layer-major step: each layer's uses repeated per micro-batch; a split layer's forward runs holder, units;
    its backward recomputes them (holder, units) then runs their backward (holder, units last first)."""
    uses: list[UseTiming] = []

    def add(entries, phase):
        uses.extend(UseTiming(e, phase, compute_ms) for e in entries)

    layers = sorted({s.owner for s in sizes})
    entries = {layer: [s.index for s in sizes if s.owner == layer] for layer in layers}
    for layer in layers:
        for _ in range(micro_batches if len(entries[layer]) > 1 else 1):
            add(entries[layer], F)
    for layer in reversed(layers):
        if len(entries[layer]) == 1:
            add(entries[layer], B)
            continue
        holder, units = entries[layer][0], entries[layer][1:]
        for _ in range(micro_batches):
            add([holder, *units, holder, *reversed(units[:-1])], B)
    return tuple(uses)


def profile(micro_batches: int, bytes_per_ms: float = UNIT / 3) -> StepProfile:
    """Copy-bound: a unit's copy takes 3 ms, a use computes 1 ms."""
    sizes = split_model()
    return StepProfile(layer_major_uses(sizes, micro_batches), 0, 0, bytes_per_ms, micro_batches=micro_batches)


STREAMED = tuple(s.index for s in split_model() if s.streamable_bytes)


# ---------------------------------------------------------------- the rule
def test_a_row_whose_units_fit_the_slots_keeps_them_all():
    plan = plan_row([1, 2, 3, 4, 5, 6], 6)
    assert plan.kept == {1, 2, 3, 4, 5, 6} and plan.refetched == () and plan.within is None


def test_a_row_with_more_units_than_slots_keeps_all_but_two_slots_worth_and_fetches_the_rest_again():
    """6 units, 4 slots: 2 kept, 4 fetched again per micro-batch after the first (keeping none: all 6), and the
    prefetch stays within the row meanwhile."""
    uses = [1, 2, 3, 4, 5, 6]
    plan = plan_row(uses, 4)
    assert len(plan.kept) == 2 and len(plan.refetched) == 4 and not plan.kept & set(plan.refetched)
    assert plan.within == set(uses)
    assert len(repeat_misses(uses, [], 4)) == 6  # what a row that kept nothing fetched again


def test_the_kept_units_are_chosen_for_the_fewest_fetches_of_a_backward_row():
    """A backward row uses units again within a micro-batch (recompute, then backward last first): the rule keeps
    the units whose keeping leaves fewest fetches, no more than keeping the first used."""
    uses = [1, 2, 3, 4, 5, 6, 5, 4, 3]
    plan = plan_row(uses, 4)
    assert len(plan.refetched) <= len(repeat_misses(uses, [1, 2], 4))
    assert len(plan.refetched) <= len(repeat_misses(uses, [], 4))


def test_two_slots_keep_nothing():
    plan = plan_row([1, 2, 3], 2)
    assert plan.kept == frozenset() and plan.within is None and len(plan.refetched) == 3


def test_step_rows_finds_each_layers_run_repeated_per_micro_batch():
    sizes, prof = split_model(), profile(4)
    rows = step_rows(prof.uses, {s.index: s.owner for s in sizes}, 4)
    assert [(r.owner, r.count) for r in rows] == [(0, 1), (1, 4), (2, 4), (3, 1), (3, 1), (2, 4), (1, 4), (0, 1)]
    assert [r.period for r in rows if r.owner in (1, 2)] == [7, 7, 13, 13]


# ---------------------------------------------------------------- the model: copies per step
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_units_that_fit_the_slots_are_copied_once_a_direction_a_step(micro_batches):
    """K = 6 units, 6 slots (prefetch 5): a step copies what one micro-batch's step copies."""
    one = simulate_rows(split_model(), profile(1), STREAMED, prefetch=5)
    got = simulate_rows(split_model(), profile(micro_batches), STREAMED, prefetch=5)
    assert got.copied_bytes == one.copied_bytes and got.refetched_bytes == 0 and got.refetched_layers == ()


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_units_that_outnumber_the_slots_are_counted_per_micro_batch(micro_batches):
    """K = 6 units, S = 4 slots, N micro-batches: each micro-batch after the first fetches units again, on top of
    one micro-batch's copies; no more than plan_row's count (forward and backward rows of both
    split layers; the replay's prefetch protects the next units, so it may fetch fewer), far fewer than every unit
    of both layers in both directions (what keeping none fetched)."""
    forward, backward = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 5, 4, 3, 2, 1]
    rule = 2 * (len(plan_row(forward, 4).refetched) + len(plan_row(backward, 4).refetched)) * UNIT
    one = simulate_rows(split_model(), profile(1), STREAMED, prefetch=3)
    two = simulate_rows(split_model(), profile(2), STREAMED, prefetch=3)
    got = simulate_rows(split_model(), profile(micro_batches), STREAMED, prefetch=3)
    assert 0 < two.refetched_bytes <= got.refetched_bytes <= (micro_batches - 1) * rule
    assert rule < 2 * 2 * UNITS * UNIT
    assert got.refetched_layers == (1, 2)
    # the first micro-batch's copies: one micro-batch's, but for at most one unit a repeated row (4 here) where the
    # row's first and last micro-batches meet its neighbours
    assert abs(got.copied_bytes - got.refetched_bytes - one.copied_bytes) <= 4 * UNIT
    assert got.step_ms > one.step_ms  # copy-bound: the refetches cost time


def test_the_planner_tries_the_prefetch_depth_whose_slots_hold_a_layers_units():
    assert prefetch_depths(split_model(), profile(1)) == PREFETCH_CHOICES
    assert prefetch_depths(split_model(), profile(4)) == (*PREFETCH_CHOICES, UNITS - 1)


def test_the_planner_prefers_slots_that_keep_the_units_over_micro_batches_within_the_budget():
    """A budget with room for 6 slots of units: the plan keeps each layer's units over the 4 micro-batches (no
    refetch) and is predicted faster than the best plan of the depths tried before (1-4), which fetch units again."""
    sizes, prof = split_model(), profile(4)
    budget = 2 * MB + 6 * UNIT + MB // 2
    plan = plan_for_budget(sizes, prof, budget)
    assert plan.refetched_bytes == 0 and plan.refetched_layers == ()
    old = plan_for_budget(sizes, prof, budget, prefetch_choices=PREFETCH_CHOICES)
    assert old.refetched_bytes > 0 and old.refetched_layers
    assert plan.predicted_ms < old.predicted_ms
    assert simulate(sizes, prof, plan.streamed, plan.prefetch) == plan.predicted_ms


def test_a_plan_that_still_fetches_units_per_micro_batch_says_so():
    """A budget with room for 3 slots only: the plan says which layers' units come again and the bytes a step."""
    sizes, prof = split_model(), profile(4)
    plan = plan_for_budget(sizes, prof, 2 * MB + 3 * UNIT + MB // 2)
    assert plan.prefetch == 2 and plan.refetched_layers == (1, 2)
    step = simulate_rows(sizes, prof, plan.streamed, plan.prefetch)
    assert plan.refetched_bytes == step.refetched_bytes > 0
    line = plan.describe(sizes)
    assert "the swap units of layers 1-2 outnumber the slots" in line, line
    assert "fetched again in micro-batches after the first" in line


def test_a_step_without_repeated_rows_is_replayed_as_before():
    """One micro-batch (or whole layers): planner.simulate's replay is the one it was (disk_plan.simulate_reads)."""
    from utils.dgls.planning.disk_plan import profile_costs, simulate_reads

    sizes, prof = split_model(), profile(1)
    costs = profile_costs(sizes, prof, 3)
    assert simulate(sizes, prof, STREAMED, 3) == simulate_reads(costs, STREAMED, {}).step_ms
