"""Data parallel: the processes holding the same layers plan one placement together (utils/dgls/planning/agreement.py).

In process: two scripted drivers (tests/test_planner.py's ScriptedPlanner: step times and peaks from functions of the
plan in force) run in two threads whose agreement is a MAX over the threads (:class:`ThreadGroup`, the gloo group's
stand-in). Each "rank" has its own probe (rank 0's double blocks and copies slower, rank 1's single blocks and
activations larger) and its own step times (each favours other prefetch depths, as a rank's waits at the gradients'
all-reduce would), so alone they settle on different placements; agreed they apply the same placements in the same
order, and end where one planner ends given the agreed (largest) profile, step times and peaks. The real collectives
over gloo with two processes are in tests/test_plan_agreement_processes.py.
"""

from __future__ import annotations

import dataclasses
import threading

from test_planner import FakeSwapper, ScriptedPlanner, drive, flux_like

from utils.dgls import DGLSUserError
from utils.dgls.planning.agreement import RULES, PlanAgreement
from utils.dgls.planning.autoplan import PEAK_MARGIN, PEAK_MARGIN_SHARE, SHORTLIST, SHORTLIST_WITHIN
from utils.dgls.planning.planner import GiB, StepProfile, UseTiming, shortlist, simulate
from utils.dgls.streaming.schedule import Phase

BUDGET = 12 * GiB


class ThreadGroup:
    """``size`` threads' elementwise MAX, as a gloo all-reduce gives it: every member must call it the same number
    of times with as many values (a mismatch, or a member that never comes, fails the barrier)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.values: list = [None] * size
        self.calls = [0] * size

    def member(self, rank: int) -> PlanAgreement:
        def max_of(values):
            self.values[rank] = [float(v) for v in values]
            self.calls[rank] += 1
            self.barrier.wait()
            assert len({len(v) for v in self.values}) == 1, "the members agreed on different things"
            result = [max(column) for column in zip(*self.values)]
            self.barrier.wait()
            return result

        return PlanAgreement(self.size, max_of)


def in_threads(work, size: int = 2) -> list:
    """``work(rank)`` in ``size`` threads; their results (an exception raised in one is raised here)."""
    results: list = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def rank_inputs(rank: int):
    """Each rank's probe, step times and peaks (see the module doc)."""
    sizes, _ = flux_like()
    if rank == 0:
        _, profile = flux_like(double_ms=6.0, single_ms=2.5)
        profile = dataclasses.replace(profile, bytes_per_ms=50e6)
    else:
        _, profile = flux_like(double_ms=5.0, single_ms=3.5)
        profile = dataclasses.replace(profile, activation_bytes=int(3.4 * GiB))

    def wall(plan):  # its own model's time, plus a wait that depends on the prefetch depth, each rank another
        favoured = plan.prefetch % 2 == rank
        return simulate(sizes, profile, plan.streamed, plan.prefetch) + (0.0 if favoured else 40.0)

    def peak(plan):
        return plan.predicted_peak + rank * GiB // 10

    return sizes, profile, wall, peak


def agreed_inputs():
    """What one planner gets from the agreement: the largest profile, step time and peak of the two ranks."""
    (sizes, p0, w0, k0), (_, p1, w1, k1) = rank_inputs(0), rank_inputs(1)
    uses = tuple(UseTiming(a.layer, a.phase, max(a.compute_ms, b.compute_ms)) for a, b in zip(p0.uses, p1.uses))
    profile = dataclasses.replace(
        p0,
        uses=uses,
        activation_bytes=max(p0.activation_bytes, p1.activation_bytes),
        bytes_per_ms=min(p0.bytes_per_ms, p1.bytes_per_ms),
    )
    return sizes, profile, (lambda p: max(w0(p), w1(p))), (lambda p: max(k0(p), k1(p)))


def run_rank(rank: int, group: ThreadGroup | None):
    sizes, profile, wall, peak = rank_inputs(rank)
    planner = ScriptedPlanner(BUDGET, profile, wall=wall, peak=peak)
    planner.agreement = group.member(rank) if group is not None else None
    swapper = FakeSwapper(sizes)
    drive(planner, swapper)
    return planner, swapper


def test_alone_the_two_ranks_settle_on_different_placements():
    """The control: the inputs differ enough that planners deciding apart disagree (what the agreement fixes)."""
    (p0, s0), (p1, s1) = in_threads(lambda rank: run_rank(rank, None))
    assert p0.profile != p1.profile
    assert s0.applied[-1] != s1.applied[-1], "the scripted ranks must disagree alone, or the test below proves nothing"


def test_agreed_ranks_apply_the_same_placements_and_end_where_one_planner_given_the_agreed_figures_ends():
    group = ThreadGroup(2)
    results = in_threads(lambda rank: run_rank(rank, group))
    for result in results:
        if isinstance(result, BaseException):
            raise result
    (p0, s0), (p1, s1) = results
    sizes, profile, wall, peak = agreed_inputs()
    assert p0.profile == p1.profile == profile, "the probe agreed: each use's longest compute, the slowest copies"
    assert p0.own_profile == rank_inputs(0)[1] and p1.own_profile == rank_inputs(1)[1]
    assert s0.applied == s1.applied and s0.kept == s1.kept
    assert p0.plan == p1.plan and [t.samples_ms for t in p0.trials] == [t.samples_ms for t in p1.trials]
    # the first round is the agreed profile's shortlist, as one planner makes it
    aim = BUDGET - max(PEAK_MARGIN, int(PEAK_MARGIN_SHARE * BUDGET))
    expected = shortlist(sizes, profile, aim, count=SHORTLIST, within=SHORTLIST_WITHIN)
    assert [t.plan for t in p0.trials[: len(expected)]] == expected
    # and the whole run is one planner's, given the largest step time and peak of the two
    alone = ScriptedPlanner(BUDGET, profile, wall=wall, peak=peak)
    single = FakeSwapper(sizes)
    drive(alone, single)
    assert single.applied == s0.applied and alone.plan == p0.plan
    assert group.calls[0] == group.calls[1] > 0


def settled_ranks(group: ThreadGroup, extra: dict[int, int], lockstep: bool = False) -> list:
    """Two ranks' drivers (and fake swappers) that planned together until their plan settled; ``extra[rank]``: bytes
    added to that rank's measured peaks from then on (a test raises it after settling)."""

    def settle(rank: int):
        sizes, profile, wall, peak = rank_inputs(rank)
        planner = ScriptedPlanner(BUDGET, profile, wall=wall, peak=lambda p: peak(p) + extra[rank])
        planner.agreement = group.member(rank)
        planner.lockstep = lockstep
        swapper = FakeSwapper(sizes)
        drive(planner, swapper)
        return planner, swapper

    results = in_threads(settle)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_the_agreement_ends_when_the_plan_settles_and_a_rank_over_its_budget_re_plans_alone():
    """Settled, each rank watches its own peaks with no collective (a forward on one rank only, a sample, cannot
    wait for the others; no micro-batch is a rendezvous): rank 1 going over re-plans alone, rank 0 keeps its plan.
    (Not with shared fetches, whose gathers make every fetch a rendezvous: the next test.)"""
    group = ThreadGroup(2)
    extra = {0: 0, 1: 0}
    (p0, s0), (p1, s1) = settled_ranks(group, extra)
    assert p0.plan == p1.plan and p0.agreement is None and p1.agreement is None
    calls = list(group.calls)
    settled = p1.plan
    p0._watch(s0)
    p1._watch(s1)
    assert p0.plan == settled and not p0.replanned and not p1.replanned
    extra[1] = BUDGET - settled.predicted_peak + GiB // 4
    p0._watch(s0)  # rank 0 within its budget: nothing happens (and nothing waits for rank 1)
    p1._watch(s1)  # rank 1 over: it re-plans, alone (a collective here would hang: rank 0 is not in one)
    drive(p1, s1)
    assert p1.replanned and not p0.replanned and group.calls == calls, "no collective after settling"


def test_with_shared_fetches_a_settled_rank_over_its_budget_says_so_and_keeps_the_plan():
    """Shared fetches (``lockstep``): every fetch gathers from every rank, so a rank re-planning alone would change its
    fetches and leave the others' gathers waiting: over its budget it says so once, keeps the plan, and nothing
    runs a collective."""
    group = ThreadGroup(2)
    extra = {0: 0, 1: 0}
    lines: list[str] = []
    _, (p1, s1) = settled_ranks(group, extra, lockstep=True)
    calls, settled = list(group.calls), p1.plan
    p1.log = lines.append
    extra[1] = BUDGET - settled.predicted_peak + GiB // 4
    for _ in range(2):
        p1._watch(s1)
        drive(p1, s1)
    assert p1.plan == settled and not p1.replanned and group.calls == calls
    assert len(lines) == 1 and "with shared fetches (--share_fetch) the placement stays as it settled" in lines[0]


def test_probes_of_different_uses_stop_every_rank_with_one_line():
    group = ThreadGroup(2)

    def probe(rank: int):
        _, profile = flux_like()
        if rank == 1:  # a layer use the other rank did not run
            profile = dataclasses.replace(profile, uses=profile.uses + (UseTiming(3, Phase.NO_GRAD, 1.0),))
        return group.member(rank).profile(profile, 59)

    for result in in_threads(probe):
        assert isinstance(result, DGLSUserError) and "ran different probe steps" in str(result)


def test_the_budget_is_the_smallest_and_the_line_says_when_they_differ():
    group = ThreadGroup(2)
    results = in_threads(lambda rank: group.member(rank).budget((8 + rank) * GiB))
    assert results == [(8 * GiB, 9 * GiB)] * 2
    member = group.member(0)
    assert "planned for the smallest" in member.budget_note(8 * GiB, 9 * GiB)
    same = "one placement for the 2 data-parallel processes holding these layers"
    assert member.budget_note(8 * GiB, 8 * GiB) == same
    assert member.budget_note(8 * GiB, 8 * GiB + 2**20) == same  # auto on like GPUs: a MiB apart is no difference


def test_disk_reads_and_bandwidths_agree_where_only_some_ranks_measured_them():
    group = ThreadGroup(2)

    def probe(rank: int):
        _, profile = flux_like()
        if rank == 1:
            profile = dataclasses.replace(profile, disk_reads={4: 100, 7: 200}, read_bytes_per_ms=2e6)
        return group.member(rank).profile(profile, 59)

    a, b = in_threads(probe)
    assert a == b and a.disk_reads == {4: 100, 7: 200} and a.read_bytes_per_ms == 2e6


def test_every_step_profile_field_has_an_agreement_rule():
    """A field added to StepProfile later must be agreed too, or each process would plan from its own."""
    assert {f.name for f in dataclasses.fields(StepProfile)} == set(RULES)


def test_one_process_agrees_with_nobody():
    """No torch.distributed group (or a job of one): no agreement, and the driver runs as it always did."""
    assert PlanAgreement.among([], "", 0) is None


def test_each_profile_field_is_agreed_by_its_rule():
    """Every scalar field differs between the ranks: the agreed profile has each "max" field's largest and each "min"
    field's smallest (a rule swapped for another fails here), and each use's longest compute."""
    _, base = flux_like()
    scalars = [name for name, rule in RULES.items() if rule in ("max", "min")]
    values = {name: (1 + i, 10 + i) for i, name in enumerate(scalars)}  # rank 0's smaller: max and min differ
    group = ThreadGroup(2)

    def probe(rank: int):
        fields = {name: type(getattr(base, name))(pair[rank]) for name, pair in values.items()}
        uses = tuple(
            UseTiming(u.layer, u.phase, u.compute_ms + (rank if i % 2 else -rank)) for i, u in enumerate(base.uses)
        )
        return group.member(rank).profile(dataclasses.replace(base, uses=uses, **fields), 59)

    a, b = in_threads(probe)
    assert a == b
    slowest = {"bytes_per_ms", "read_bytes_per_ms"}  # rates: the slowest; the rest: the largest (stated here, not
    # read from RULES, so a rule swapped there fails)
    for name in scalars:
        expected = min(values[name]) if name in slowest else max(values[name])
        assert getattr(a, name) == expected, name
    assert [u.compute_ms for u in a.uses] == [u.compute_ms + (1 if i % 2 else 0) for i, u in enumerate(base.uses)]


def test_a_failed_agreement_is_one_line_that_names_the_likely_cause(monkeypatch):
    """A member stopped, or a forward ran on some members only before the plan settled: gloo's error (a closed
    connection, a timeout) becomes one line."""
    import torch

    from utils.dgls.planning.agreement import gloo_max

    def closed(*args, **kwargs):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]")

    monkeypatch.setattr(torch.distributed, "all_reduce", closed)
    try:
        gloo_max(None, 2)([1.0])
    except DGLSUserError as exc:
        line = str(exc)
    else:
        raise AssertionError("no error")
    assert "\n" not in line and "Connection closed by peer" in line and "every forward" in line
