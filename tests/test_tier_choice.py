"""The chooser's contract with :func:`~utils.dgls.streaming.tiers.plan_tiers` (which streamed layers spill to disk).

- A chooser returns a choice that fits the host RAM budget whenever spilling every streamed layer does, else every
  layer (then the budget is too small: one clear line).
- The disk plan (:func:`~utils.dgls.planning.disk_plan.choose_spilled`, the builder's chooser) keeps it over random
  layer sizes, compute times and budgets, the staging ring counted: a budget the user gives is planned or refused in
  one line, never silently served by every layer on disk.
- A chooser that broke it would be a DGLS bug: an assertion that says so, not a silent spill of every layer.
"""

import random
from types import SimpleNamespace

import pytest

from utils.dgls import DGLSUserError
from utils.dgls.memory.pinned import PAGE, whole_pages
from utils.dgls.planning.disk_plan import DiskCosts, choose_spilled
from utils.dgls.planning.planner import UseTiming
from utils.dgls.streaming.schedule import Phase
from utils.dgls.streaming.tiers import RING_BUFFERS, plan_tiers


def layouts_of(sizes):
    """Stand-ins for the layouts: plan_tiers reads only each layer's ``host_bytes``."""
    return [SimpleNamespace(host_bytes=n) for n in sizes]


def disk_plan(sizes, compute, prefetch):
    """The builder's chooser (:class:`~utils.dgls.engine.disk_planning.DiskChoice`) without the disk probe."""
    n = len(sizes)
    costs = DiskCosts(
        uses=tuple(UseTiming(i, Phase.FORWARD, compute[i]) for i in range(n))
        + tuple(UseTiming(i, Phase.BACKWARD, 2 * compute[i]) for i in reversed(range(n))),
        copy_bytes={i: sizes[i] for i in range(n)},
        read_bytes={i: whole_pages(sizes[i]) for i in range(n)},
        copy_bytes_per_ms=10 * PAGE,
        read_bytes_per_ms=PAGE,
        prefetch=prefetch,
        ring=RING_BUFFERS,
    )
    return lambda candidates, over: choose_spilled(costs, list(candidates), over)


def test_a_chooser_whose_choice_does_not_fit_is_a_bug_not_every_layer_on_disk():
    """Spilling every layer fits; a chooser that returns a choice that does not must not turn into all of them."""
    sizes = [PAGE] * 6
    streamed = list(range(6))
    need = sum(sizes)  # everything in RAM: a page over a budget of ``need - PAGE``
    tiers = plan_tiers(layouts_of(sizes), streamed, streamed, need - PAGE, 1, choose=lambda c, over: [c[0], c[1]])
    assert sorted(tiers.spilled) == [0, 1]  # a choice that fits is taken as it is
    with pytest.raises(AssertionError, match="the disk plan chose 0 of 6 streamed layers to spill, .* fits it"):
        plan_tiers(layouts_of(sizes), streamed, streamed, need - PAGE, 1, choose=lambda c, over: [])
    # one layer frees a page and its staging buffer takes one: still over
    with pytest.raises(AssertionError, match="the disk plan chose 1 of 6"):
        plan_tiers(layouts_of(sizes), streamed, streamed, need - PAGE, 1, choose=lambda c, over: [c[0]])


def test_a_budget_too_small_with_every_layer_on_disk_is_one_line_whatever_the_chooser():
    sizes = [PAGE] * 4
    streamed = list(range(4))
    for choose in (lambda c, over: [], lambda c, over: list(c), disk_plan(sizes, [1.0] * 4, 1)):
        with pytest.raises(DGLSUserError, match="host_ram_budget .* is too small: with every streamed layer on disk"):
            plan_tiers(layouts_of(sizes), streamed, streamed, RING_BUFFERS * PAGE - 1, RING_BUFFERS, choose=choose)


def test_the_disk_plan_always_fits_a_budget_that_every_layer_on_disk_fits():
    """Random sizes (the ring, two buffers of the largest spilled layer, makes the bytes over the budget non-monotone
    in the choice), compute and budgets from nothing spilled to below the floor: the disk plan's choice fits, or the
    budget is too small even with every layer on disk (one line); the assertion is never reached."""
    rng = random.Random(7)
    planned = refused = 0
    for _ in range(300):
        n = rng.randint(1, 9)
        sizes = [rng.choice([1, 2, 3, 5, 8]) * PAGE - rng.randint(0, PAGE - 1) for _ in range(n)]
        streamed = sorted(rng.sample(range(n), rng.randint(1, n)))
        hosted = sorted(set(streamed) | {i for i in range(n) if rng.random() < 0.2})  # a resident fp8 master or two
        compute = [rng.choice([0.1, 1.0, 10.0, 50.0]) for _ in range(n)]
        ram = sum(whole_pages(sizes[i]) for i in hosted)  # RAM with nothing spilled
        largest = max(whole_pages(sizes[i]) for i in streamed)
        floor = ram - sum(whole_pages(sizes[i]) for i in streamed) + RING_BUFFERS * largest  # every layer on disk
        budget = rng.randint(max(floor - 2 * PAGE, 0), max(ram, floor) + PAGE)
        choose = disk_plan(sizes, compute, rng.randint(0, 2))
        try:
            tiers = plan_tiers(layouts_of(sizes), hosted, streamed, budget, RING_BUFFERS, choose=choose)
        except DGLSUserError:
            refused += 1
            assert budget < floor
            continue
        planned += 1
        assert tiers.ram_bytes + tiers.ring_bytes <= budget and set(tiers.spilled) <= set(streamed)
    assert planned > 100 and refused > 20  # both sides were tried
