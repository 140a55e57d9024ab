"""The disk plan (utils/dgls/planning/disk_plan.py): which streamed layers spill to disk, and the step's disk floor.

- The choice spills the layers whose reads hide behind the longest compute first, never a resident layer, nothing
  when the budget holds everything, and counts the staging ring (two buffers of the largest spilled layer).
- With nothing spilled the model predicts the planner's step exactly; the floor is the bytes read a step over the
  disk's bandwidth, and the forecast says whether the reads hide.
- The builder probes the disk only when something must spill.
- With a VRAM budget the planner's predictions count the reads of the layers on disk (it keeps more of them
  resident), and a LoRA planned that way trains bitwise as the all-in-RAM run.
"""

import dataclasses

import pytest
import torch
from full_ft import SPEC, full_layers
from helpers import assert_bitwise_equal, make_layers, train
from test_planner import flux_like

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.engine import disk_planning
from utils.dgls.memory.layout import LayerSizes
from utils.dgls.planning.disk_plan import (
    DiskCosts,
    choose_spilled,
    forecast,
    hiding_windows,
    simulate_reads,
    spread_choice,
)
from utils.dgls.planning.planner import GiB, StepProfile, UseTiming, plan_for_budget, simulate
from utils.dgls.streaming.schedule import Phase

MB = 1_000_000
F, B = Phase.FORWARD, Phase.BACKWARD


def forward_costs(compute, read_mb=10, copy_mb=1, prefetch=1, ring=2):
    """Layers 0..n-1 run forward once each (compute in ms); every layer ``read_mb`` on disk and ``copy_mb`` to copy;
    the disk reads 1 MB/ms, the copies 10 MB/ms."""
    n = len(compute)
    return DiskCosts(
        uses=tuple(UseTiming(i, F, ms) for i, ms in enumerate(compute)),
        copy_bytes={i: copy_mb * MB for i in range(n)},
        read_bytes={i: read_mb * MB for i in range(n)},
        copy_bytes_per_ms=10 * MB,
        read_bytes_per_ms=1 * MB,
        prefetch=prefetch,
        ring=ring,
    )


def over_by(costs, need):
    """Bytes over the budget when ``need`` bytes must leave RAM (no ring counted)."""
    return lambda spilled: need - sum(costs.read_bytes[i] for i in spilled)


# layer 2 computes 50 ms and layer 5 30 ms, the others 1 ms: with prefetch 1 the fetches of 3 and 6 hide behind them
LONG = [1, 1, 50, 1, 1, 30, 1, 1]


def test_the_layers_whose_reads_hide_behind_the_longest_compute_spill_first():
    costs = forward_costs(LONG)
    streamed = list(range(8))
    windows = hiding_windows(costs, streamed)
    assert max(windows, key=windows.get) == 3 and sorted(windows, key=windows.get)[-2] == 6
    assert choose_spilled(costs, streamed, over_by(costs, 10 * MB)) == [3]
    assert choose_spilled(costs, streamed, over_by(costs, 20 * MB)) == [3, 6]
    two = forecast(costs, streamed, [3, 6])
    assert two.hides and "the reads hide behind compute" in two.line()
    # a third read has 1 ms of compute between its fetch and its use, but it is read ahead, as soon as the reader
    # and a ring buffer are free: it hides too
    three = forecast(costs, streamed, choose_spilled(costs, streamed, over_by(costs, 30 * MB)))
    assert three.hides
    # more to read than the step computes (5 x 20 ms against 86 ms): the reads add to the step, and the line says
    slow = forward_costs(LONG, read_mb=20)
    five = forecast(slow, streamed, choose_spilled(slow, streamed, over_by(slow, 100 * MB)))
    assert not five.hides and five.added_ms >= 14 - 1e-6 and "the reads add" in five.line()
    assert "--prefetch" not in five.line()  # the reads run ahead on their own: a deeper prefetch would not help
    # full fine-tuning's fetches read (no read-ahead): later, so the same reads add more, and --prefetch helps there
    fetched = forecast(dataclasses.replace(slow, read_ahead=False), streamed, five.spilled)
    assert fetched.added_ms > five.added_ms and "a deeper --prefetch starts each read earlier" in fetched.line()


def wan_like_costs(units=160, forward_ms=40.0):
    """Equal swap units, forward then backward (each backward use twice its forward), every read 75 ms: about two
    forward uses' compute (Wan2.1-14B's 160 units at 81 frames, 8 GiB of device memory, on the lent H200)."""
    uses = tuple(UseTiming(i, F, forward_ms) for i in range(units))
    uses += tuple(UseTiming(i, B, 2 * forward_ms) for i in reversed(range(units)))
    return DiskCosts(
        uses=uses,
        copy_bytes={i: 3 * MB for i in range(units)},
        read_bytes={i: 75 * MB for i in range(units)},
        copy_bytes_per_ms=50 * MB,
        read_bytes_per_ms=1 * MB,
        prefetch=1,
    )


def test_half_of_equal_units_spill_every_other_one_and_their_reads_hide():
    """The greedy alone took runs of neighbours here (its batches: 19.2 s a step becomes 20.6 s in the model), whose
    reads queue behind each other with a forward use's compute to hide each: the evenly spread choice, every other
    unit, gives each read two uses' compute, and the model keeps it."""
    costs = wan_like_costs()
    streamed = list(range(160))
    chosen = sorted(choose_spilled(costs, streamed, over_by(costs, 80 * 75 * MB)))
    assert len(chosen) == 80 and all(b - a == 2 for a, b in zip(chosen, chosen[1:]))
    assert forecast(costs, streamed, chosen).hides
    neighbours = forecast(costs, streamed, list(range(80)))
    assert not neighbours.hides and neighbours.added_ms > 1000


def test_the_spread_choice_is_the_fewest_evenly_spaced_that_fit():
    position = {i: i for i in range(12)}
    sizes = {i: 10 if i % 3 else 30 for i in range(12)}  # 0, 3, 6, 9 are larger

    def over_need(need):
        return lambda chosen: need - sum(sizes[i] for i in chosen)

    assert spread_choice(list(range(1, 12, 3)), position, over_need(20)) == [4, 10]  # 2 of 4: each half's middle
    assert spread_choice(list(range(12)), position, over_need(40)) == [3, 9]  # two of the larger fit
    assert spread_choice(list(range(12)), position, over_need(0)) == [6]  # one is the fewest k the bisection tries
    assert spread_choice([9, 2, 5], position, over_need(20)) == [2, 9]  # run order, whatever the candidates' order
    assert spread_choice(list(range(12)), position, over_need(1000)) == list(range(12))  # none fits: all of them
    assert spread_choice([], position, over_need(10)) == []


def test_a_budget_that_holds_everything_spills_nothing():
    costs = forward_costs(LONG)
    assert choose_spilled(costs, list(range(8)), over_by(costs, 0)) == []
    assert choose_spilled(costs, list(range(8)), over_by(costs, -1)) == []


def test_a_resident_layer_is_never_spilled():
    """Layer 3 would hide best, and stays resident: the candidates are the streamed layers only."""
    costs = forward_costs(LONG)
    streamed = [0, 1, 2, 4, 5, 6, 7]
    chosen = choose_spilled(costs, streamed, over_by(costs, 20 * MB))
    assert chosen == [4, 6]  # 4's fetch now starts before 2 computes (3 takes no slot)
    assert choose_spilled(costs, streamed, over_by(costs, 1000 * MB)) == streamed  # all it can: the caller refuses


def test_the_staging_ring_counts_a_large_layer_that_frees_less_than_its_buffers_stays():
    """One layer of 100 MB and five of 10 MB; 30 MB must go: three small ones (ring 20 MB) fit, the large one
    (ring 200 MB) never does."""
    costs = forward_costs([5] * 6)
    costs = DiskCosts(**{**costs.__dict__, "read_bytes": {0: 100 * MB, **{i: 10 * MB for i in range(1, 6)}}})

    def over(spilled):
        ring = 2 * max((costs.read_bytes[i] for i in spilled), default=0)
        return 30 * MB - sum(costs.read_bytes[i] for i in spilled) + ring

    chosen = choose_spilled(costs, list(range(6)), over)
    assert 0 not in chosen and over(chosen) <= 0 and len(chosen) == 5


def test_nothing_spilled_predicts_the_planners_step_and_the_floor_counts_every_read():
    uses = tuple(UseTiming(i, F, 2.0 + i) for i in range(4)) + tuple(UseTiming(i, B, 4.0) for i in reversed(range(4)))
    sizes = [LayerSizes(i, "Block", 8 * MB, 0) for i in range(4)]
    profile = StepProfile(uses, 0, 0, bytes_per_ms=2 * MB)
    costs = DiskCosts(uses, {i: 8 * MB for i in range(4)}, {i: 8 * MB for i in range(4)}, 2 * MB, 0.5 * MB, 2)
    for streamed in ([0, 1, 2, 3], [1, 3]):
        assert simulate_reads(costs, streamed, ()).step_ms == pytest.approx(simulate(sizes, profile, streamed, 2))
    times = simulate_reads(costs, [0, 1, 2, 3], [1, 2])
    assert times.reads == 4 and times.read_bytes == 32 * MB  # forward and backward each read both
    assert forecast(costs, [0, 1, 2, 3], [1, 2]).floor_ms == pytest.approx(32 * MB / (0.5 * MB))


def test_reads_wait_for_the_reader_and_for_the_ring():
    """One reader: two spilled layers back to back cost two reads; a staging buffer is read into only after the copy
    out of it before, so one buffer serializes each read with its copy."""
    costs = forward_costs([1] * 6, read_mb=5)
    assert simulate_reads(costs, range(6), [4, 5]).step_ms > simulate_reads(costs, range(6), [4]).step_ms + 3
    slow_copies = forward_costs([0.1] * 6, read_mb=5, copy_mb=50, prefetch=3)
    two = simulate_reads(slow_copies, range(6), range(6)).step_ms
    one = simulate_reads(DiskCosts(**{**slow_copies.__dict__, "ring": 1}), range(6), range(6)).step_ms
    assert one > two + 20


# ---------------------------------------------------------------- in the builder
def test_the_builder_probes_the_disk_only_when_something_spills(tmp_path, monkeypatch):
    calls = []
    probe = disk_planning.probe_read_gbps

    def counted(*args, **kw):
        calls.append(args)
        return probe(*args, **kw)

    monkeypatch.setattr(disk_planning, "probe_read_gbps", counted)
    layers, _ = make_layers()
    config = SwapConfig.of(host_ram_budget="auto", disk_dir=str(tmp_path), prefetch=1)
    with LayerSwapper(layers, config, device=torch.device("cpu"), log=None) as swapper:
        assert swapper.store.disk is None
    assert calls == [] and list(tmp_path.iterdir()) == []
    lines = []
    config = SwapConfig.of(host_ram_budget=0.0006, disk_dir=str(tmp_path), prefetch=1)
    layers, _ = make_layers()
    with LayerSwapper(layers, config, device=torch.device("cpu"), log=lines.append) as swapper:
        assert swapper.store.disk_layers
        measured = swapper.store.disk.read_gbps
    assert len(calls) == 1 and measured > 0
    assert any(f"measured {measured:.2f} GB/s here" in line for line in lines)  # the probe's figure, said once


def test_the_builder_tells_the_disk_plan_how_many_micro_batches_a_layer_major_step_computes(tmp_path):
    """layer_major_micro_batches = 4: each fetch (and read) of a layer-major step serves 4 micro-batches, so the disk
    plan costs 4 times the compute behind the reads (the state plan's rule, disk_planning.step_uses); before, it
    counted one micro-batch's."""
    from test_state_plan import compute_a_step

    def disk_plan_compute(n: int) -> float:
        lines: list[str] = []
        (tmp_path / str(n)).mkdir()
        config = SwapConfig.of(host_ram_budget=0.0006, disk_dir=str(tmp_path / str(n)), prefetch=1,
                               layer_major_micro_batches=n)  # fmt: skip
        with LayerSwapper(make_layers()[0], config, device=torch.device("cpu"), log=lines.append) as swapper:
            assert swapper.store.disk_layers
        (line,) = [line for line in lines if line.startswith("DGLS disk plan:")]
        return compute_a_step(line)

    one, four = disk_plan_compute(1), disk_plan_compute(4)
    assert one > 0 and four == pytest.approx(4 * one, rel=0.02)


def test_a_layer_major_step_costs_each_use_at_its_micro_batches_and_sequential_passes_repeat():
    """The one rule both disk choosers use (disk_planning.step_uses)."""
    uses = (UseTiming(0, F, 2.0), UseTiming(1, F, 1.0), UseTiming(1, B, 2.0))
    assert disk_planning.step_uses(uses) == uses
    assert [u.compute_ms for u in disk_planning.step_uses(uses, 3)] == [6.0, 3.0, 6.0]
    assert disk_planning.step_uses(uses, 1, passes=2) == uses * 2
    assert [(u.layer, u.phase) for u in disk_planning.step_uses(uses, 3, 2)] == [(u.layer, u.phase) for u in uses] * 2


# ---------------------------------------------------------------- with the VRAM planner
def test_the_vram_planner_counts_the_reads_of_layers_on_disk_and_keeps_more_of_them_resident():
    """Flux-like blocks (the planner's tests), the 18 last single blocks on disk at 2 GB/s: the plan made knowing it
    keeps them all resident (the "disk first" pattern), the plan made blind to the disk few, and is predicted faster
    with the reads."""
    sizes, profile = flux_like()
    on_disk = {i: sizes[i].streamable_bytes for i in range(40, 58)}
    with_disk = dataclasses.replace(profile, disk_reads=on_disk, read_bytes_per_ms=2 * MB)
    blind, aware = plan_for_budget(sizes, profile, 16 * GiB), plan_for_budget(sizes, with_disk, 16 * GiB)
    assert len(set(on_disk) - set(aware.streamed)) > len(set(on_disk) - set(blind.streamed))
    assert aware.pattern.startswith("disk first") and not set(on_disk) & set(aware.streamed)  # no read left
    assert aware.predicted_ms < simulate(sizes, with_disk, blind.streamed, blind.prefetch)
    assert simulate(sizes, with_disk, aware.streamed, aware.prefetch) == pytest.approx(aware.predicted_ms)


def test_a_vram_budget_with_a_host_ram_budget_plans_knowing_the_disk_and_trains_the_same(tmp_path):
    """LoRA: the disk plan chooses among the probe's streamed layers at build; the planner's probe profile carries
    their reads; once it settles it says what the plan reads from disk (on the CPU it keeps everything resident)."""
    lines = []
    layers, trainable = make_layers()
    config = SwapConfig.of(vram_budget=0.002, host_ram_budget=0.0006, disk_dir=str(tmp_path))
    with LayerSwapper(layers, config, device=torch.device("cpu"), log=lines.append) as swapper:
        on_disk = list(swapper.store.disk_layers)
        got = train(layers, trainable, torch.device("cpu"), "nonreentrant", steps=4)
        assert swapper.driver.done and sorted(swapper.driver.profile.disk_reads) == on_disk
        assert swapper.driver.profile.read_bytes_per_ms > 0
    settled = f"DGLS disk plan: the plan keeps the {len(on_disk)} layers on disk resident: no step reads from disk"
    assert on_disk and lines[-1] == settled
    table = lines[-2].splitlines()  # the plan's placement table just before: every layer resident on the CPU
    assert table[0].startswith(" idx") and all(row.endswith("resident") for row in table[1:9])
    assert "streamed from disk" in lines[1] and "streamed from RAM" in lines[1]  # the probe's placement, three tiers
    assert_bitwise_equal(train(*make_layers(), torch.device("cpu"), "nonreentrant", steps=4), got)


def test_a_full_fine_tune_the_planner_cannot_serve_is_refused_before_the_disk_is_probed(tmp_path, monkeypatch):
    """Masters, optimizer state and weights all spill, with a VRAM budget (refused: its planner may make layers
    resident after the probe): the line comes before the disk plan writes its probe file."""
    monkeypatch.setattr(disk_planning, "probe_read_gbps", lambda *a, **k: pytest.fail("the disk was probed"))
    config = SwapConfig.of(
        host_optimizer=SPEC, accumulation_steps=2, host_ram_budget=0.002, disk_dir=str(tmp_path), vram_budget=1.0
    )
    with pytest.raises(DGLSUserError, match="give the placement instead"):
        LayerSwapper(full_layers(torch.bfloat16), config, device=torch.device("cpu"), log=None)
