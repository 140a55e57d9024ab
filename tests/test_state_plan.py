"""The state plan (utils/dgls/planning/state_plan.py): which full fine-tuned layers keep their fp32 masters and
optimizer state on disk, chosen by a replay of the step, and the time their reads and write-backs add.

- Without clipping the updates run during the backward, the last layer's first: the last layers' state I/O hides
  behind the rest of the backward and the next forward, the first layers' does not; the plan spills the last layers.
- With clipping every update runs after the backward in layer order: a layer's state I/O hides behind the next
  forward's compute up to it; the plan spills the last layers, spaced so one read hides behind the updates before.
- The disk thread is one: two spilled layers whose windows overlap cost more than one; a read waits for the write-back
  before it.
- The choice frees at least the bytes needed (the two slots of the largest spilled extent counted) whenever spilling
  every state does, else returns every candidate: the caller then spills weights too, or refuses in one line.
- With no trained layer the replay is the weights' disk plan's.
- In the builder: the start-up line names the layers whose state is on disk and the predicted time; the run trains
  bitwise as the all-in-RAM run (with and without clipping); clip_mode previous_norm plans as without clipping (its
  updates start as their gradients land from step 2), exact clipping's after the backward.
"""

import dataclasses
import random
import re
import types

import pytest
import torch
from full_ft import SPEC, assert_same, full_layers, train_dgls

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.engine import disk_planning
from utils.dgls.planning.disk_plan import DiskCosts, simulate_reads
from utils.dgls.planning.planner import UseTiming
from utils.dgls.planning.row_copies import index_ranges
from utils.dgls.planning.state_plan import (
    SLOTS,
    StateCosts,
    choose_state_spilled,
    forecast_state,
    simulate_state,
    state_windows,
    update_order,
)
from utils.dgls.streaming.schedule import Phase
from utils.dgls.training import disk_state

MB = 1_000_000
F, B = Phase.FORWARD, Phase.BACKWARD
CPU = torch.device("cpu")


def step_costs(n=8, forward_ms=5.0, update_ms=1.0, state_mb=10, after_backward=False, sizes=None, prefetch=1):
    """Layers 0..n-1 forward then backward (twice the forward's compute), each 1 MB to copy at 100 MB/ms, its state
    ``state_mb`` (or ``sizes[i]`` bytes) read and written back at 1 MB/ms, its host update ``update_ms``."""
    sizes = sizes or [state_mb * MB] * n
    return StateCosts(
        uses=tuple(UseTiming(i, F, forward_ms) for i in range(n))
        + tuple(UseTiming(i, B, 2 * forward_ms) for i in reversed(range(n))),
        copy_bytes={i: MB for i in range(n)},
        state_bytes={i: sizes[i] for i in range(n)},
        update_ms={i: update_ms for i in range(n)},
        copy_bytes_per_ms=100 * MB,
        read_bytes_per_ms=MB,
        write_bytes_per_ms=MB,
        prefetch=prefetch,
        after_backward=after_backward,
    )


def over_by(costs, need, slots=True):
    """Bytes over the budget when ``need`` bytes of state must leave RAM (the slots of the largest counted)."""

    def over(chosen):
        buffers = SLOTS * max((costs.state_bytes[i] for i in chosen), default=0) if slots else 0
        return need - sum(costs.state_bytes[i] for i in chosen) + buffers

    return over


def test_updates_during_the_backward_spill_the_last_layers_whose_io_hides():
    costs = step_costs()
    streamed = list(range(8))
    assert update_order(costs, streamed) == [7, 6, 5, 4, 3, 2, 1, 0]
    windows = state_windows(costs, streamed)
    assert sorted(windows, key=windows.get, reverse=True) == [7, 6, 5, 4, 3, 2, 1, 0]
    assert windows[0] < 0 < windows[7]  # the first layer's update is needed as soon as it ends
    base = simulate_state(costs, streamed, ()).step_ms
    assert simulate_state(costs, streamed, [7]).step_ms == pytest.approx(base)  # its read and write hide
    assert simulate_state(costs, streamed, [0]).step_ms > base + 9  # its read delays the next step's start
    chosen = choose_state_spilled(costs, streamed, streamed, over_by(costs, 10 * MB, slots=False))
    assert chosen == [7]
    chosen = choose_state_spilled(costs, streamed, streamed, over_by(costs, 20 * MB))  # 20 MB + 20 MB of slots
    assert sorted(chosen) == [4, 5, 6, 7]
    told = forecast_state(costs, streamed, chosen)
    assert told.hides and told.floor_ms == pytest.approx(80.0) and told.with_disk.updates == 4
    assert "(layers 4-7)" in told.line() and "hide behind the step" in told.line()


def test_with_clipping_the_updates_follow_the_backward_and_the_last_layers_spill():
    """Every update after the backward, in layer order: layer k's I/O has the next forward up to k to hide in."""
    costs = step_costs(after_backward=True, forward_ms=10.0)
    streamed = list(range(8))
    assert update_order(costs, streamed) == list(range(8))
    windows = state_windows(costs, streamed)
    assert sorted(windows, key=windows.get) == list(range(8))  # the later in the forward, the longer
    base = simulate_state(costs, streamed, ()).step_ms
    chosen = choose_state_spilled(costs, streamed, streamed, over_by(costs, 10 * MB, slots=False))
    assert chosen == [7]
    assert simulate_state(costs, streamed, [7]).step_ms == pytest.approx(base)
    assert simulate_state(costs, streamed, [0]).step_ms > base + 9
    told = forecast_state(costs, streamed, [0])
    assert not told.hides and "they add" in told.line() and "after the backward (clipping)" in told.line()


def test_a_read_issued_by_the_spilled_update_before_hides_behind_it():
    """Clipping: the updates are queued at once, so the first update to start issues the first spilled layer's read
    and a spilled layer's update the next one's, once its own landed: with long updates those reads cost nothing,
    without them they do."""
    slow = step_costs(after_backward=True, forward_ms=0.1, update_ms=30.0)
    streamed = list(range(8))
    one = simulate_state(slow, streamed, [2]).step_ms
    assert one == pytest.approx(simulate_state(slow, streamed, ()).step_ms)  # issued as update 0 starts (ahead)
    assert simulate_state(slow, streamed, [2, 4]).step_ms == pytest.approx(one)  # read of 4 behind updates 2 and 3
    assert simulate_state(slow, streamed, [0]).step_ms > one + 9  # the first update has nothing before it
    fast = step_costs(after_backward=True, forward_ms=0.1, update_ms=0.1)
    assert simulate_state(fast, streamed, [2, 4]).step_ms > simulate_state(fast, streamed, [2]).step_ms + 9


def test_one_disk_thread_serializes_reads_and_write_backs():
    """Two spilled layers back to back in the backward: the second read waits for the first read and write-back."""
    costs = step_costs(forward_ms=1.0, update_ms=0.1)
    streamed = list(range(8))
    times = simulate_state(costs, streamed, [7, 6])
    assert times.disk_ms == pytest.approx(40.0) and times.disk_bytes == 40 * MB and times.updates == 2
    assert times.step_ms > simulate_state(costs, streamed, [7]).step_ms + 5
    fast_disk = StateCosts(**{**costs.__dict__, "read_bytes_per_ms": 1000 * MB, "write_bytes_per_ms": 1000 * MB})
    assert simulate_state(fast_disk, streamed, [7, 6]).step_ms == pytest.approx(
        simulate_state(fast_disk, streamed, ()).step_ms, abs=0.1
    )


def test_with_no_trained_layer_the_replay_is_the_weights_disk_plan():
    costs = step_costs()
    no_training = StateCosts(**{**costs.__dict__, "update_ms": {}})
    weights = DiskCosts(costs.uses, costs.copy_bytes, {}, costs.copy_bytes_per_ms, MB, 1)
    for streamed in (range(8), [1, 3, 5]):
        assert simulate_state(no_training, streamed, ()).step_ms == pytest.approx(
            simulate_reads(weights, streamed, ()).step_ms
        )


@pytest.mark.parametrize("after_backward", [False, True])
def test_many_layers_whose_updates_bound_the_step_spill_spaced_so_every_read_hides(after_backward):
    """160 layers, the host updates longer than the compute (the windows say little), each state's read and write-back
    1.8 updates long: one layer in four can spill for free. A round that tried only the top of the ranking would take
    neighbours once those stop hiding; tries spread over the ranking find the spaced ones (the step is unchanged)."""
    n = 160
    costs = StateCosts(
        uses=tuple(UseTiming(i, F, 0.1) for i in range(n)) + tuple(UseTiming(i, B, 0.2) for i in reversed(range(n))),
        copy_bytes={i: 10 for i in range(n)},
        state_bytes={i: 1000 for i in range(n)},
        update_ms={i: 1.0 for i in range(n)},
        copy_bytes_per_ms=1000,
        read_bytes_per_ms=550,
        write_bytes_per_ms=550,
        prefetch=1,
        after_backward=after_backward,
    )
    chosen = choose_state_spilled(costs, range(n), range(n), lambda ch: n * 100 - 1000 * len(ch) + 2000 * bool(ch))
    told = forecast_state(costs, list(range(n)), chosen)
    assert len(chosen) == 18 and told.hides and told.added_ms < 0.5


def test_a_layer_major_step_computes_its_micro_batches_at_each_fetch_and_sequential_ones_repeat_the_pass():
    """The state plan's step: N micro-batches one after another are N passes (each fetching again); N layer-major
    ones are one pass whose every use computes N micro-batches. Counting a layer-major step's compute once would
    overstate the time a spill adds (less compute to hide its reads behind)."""
    uses = (UseTiming(0, Phase.FORWARD, 2.0), UseTiming(0, Phase.BACKWARD, 4.0))
    disk = types.SimpleNamespace(estimated_uses=lambda: uses)
    trained = types.SimpleNamespace(layers={})

    def step(**kw):
        return disk_planning.StateChoice(disk, trained, SPEC, clipping=False, **kw).step_uses()

    assert step() == uses
    assert step(passes=3) == uses * 3
    assert [u.compute_ms for u in step(layer_major_micro_batches=4)] == [8.0, 16.0]
    assert [(u.layer, u.phase) for u in step(layer_major_micro_batches=4)] == [(0, Phase.FORWARD), (0, Phase.BACKWARD)]


def test_a_budget_that_holds_everything_spills_nothing():
    costs = step_costs()
    assert choose_state_spilled(costs, range(8), range(8), over_by(costs, 0)) == []


def test_the_slots_count_a_large_state_that_frees_less_than_its_slots_stays():
    """One layer of 100 MB (its slots 200 MB) and seven of 10 MB; 30 MB must go: small ones only."""
    costs = step_costs(sizes=[10 * MB] * 7 + [100 * MB])
    chosen = choose_state_spilled(costs, range(8), range(8), over_by(costs, 30 * MB))
    assert 7 not in chosen and over_by(costs, 30 * MB)(chosen) <= 0


@pytest.mark.parametrize("after_backward", [False, True])
def test_the_choice_frees_the_bytes_needed_whenever_spilling_every_state_does(after_backward):
    rng = random.Random(7)
    for _ in range(25):
        n = rng.randint(2, 12)
        sizes = [rng.choice([1, 2, 3, 8]) * MB for _ in range(n)]
        costs = step_costs(n, rng.uniform(0.5, 20), rng.uniform(0.1, 10), sizes=sizes, after_backward=after_backward)
        streamed = list(range(n))
        candidates = sorted(rng.sample(streamed, rng.randint(1, n)))
        over = over_by(costs, rng.randint(1, sum(sizes[i] for i in candidates) + 4 * MB))
        chosen = choose_state_spilled(costs, streamed, candidates, over)
        assert set(chosen) <= set(candidates)
        if over(candidates) <= 0:
            assert over(chosen) <= 0
        elif over(chosen) > 0:
            assert sorted(chosen) == candidates  # nothing fits: every candidate (the caller goes on or refuses)


def test_ranges_collapse_runs():
    assert index_ranges([9, 0, 1, 2, 3, 7, 10, 3]) == "0-3,7,9-10" and index_ranges([]) == ""


# ---------------------------------------------------------------- plan_full_tiers with a state chooser
def full_tiers_inputs():
    layers = full_layers(torch.bfloat16)
    with LayerSwapper(layers, SwapConfig.of(host_optimizer=SPEC, prefetch=1), device=CPU, log=None) as swapper:
        layout, store = swapper.training.layout, swapper.store
        layouts = [h.layout for h in store.layers.values()]
    by_index = {lay.index: lay for lay in layouts}
    full = [by_index.get(i) for i in range(max(by_index) + 1)]
    hosted = sorted(by_index)
    packed = sum(disk_state.whole_pages(by_index[i].host_bytes) for i in hosted)
    return full, hosted, layout, packed + layout.parts()["gradients"]


def test_plan_full_tiers_takes_the_state_choice_and_refuses_what_cannot_fit():
    full, hosted, layout, fixed = full_tiers_inputs()
    states = {i: disk_state.state_ram_bytes(layout, i) for i in layout.layers}
    extent = {i: disk_state.whole_pages(disk_state.extent_pieces(layout, i)[1]) for i in layout.layers}
    largest = sorted(sorted(hosted, key=lambda i: -extent[i])[:3])  # three free more than two slots of one take
    budget = fixed + sum(states.values()) - 1  # a byte short with every state in RAM
    seen = []

    def choose_largest(candidates, over):
        seen.append(list(candidates))
        return largest if over(largest) <= 0 else list(candidates)

    tiers, spilled = disk_state.plan_full_tiers(full, hosted, hosted, budget, 2, layout, choose_states=choose_largest)
    assert seen == [hosted] and list(spilled) == largest and tiers.states == 3 and not tiers.spilled
    with pytest.raises(AssertionError, match="the state plan chose 0 of 6 layers"):
        disk_state.plan_full_tiers(full, hosted, hosted, budget, 2, layout, choose_states=lambda c, over: [])
    with pytest.raises(DGLSUserError, match="too small for this full fine-tune: .* raise host_ram_budget"):
        disk_state.plan_full_tiers(full, hosted, hosted, 4096, 2, layout, choose_states=choose_largest)


# ---------------------------------------------------------------- in the builder
def run(tmp_path, budget, clip, log=None):
    layers = full_layers(torch.bfloat16)
    extra = {"host_ram_budget": budget, "disk_dir": str(tmp_path)} if budget is not None else {}
    cfg = SwapConfig.of(host_optimizer=SPEC, accumulation_steps=1, prefetch=1, clip_grads=clip, **extra)
    with LayerSwapper(layers, cfg, device=CPU, log=log) as swapper:
        state = swapper.training.disk_state
        spilled = sorted(state.spilled) if state is not None else []
        record = train_dgls(layers, swapper, CPU, "nonreentrant", steps=3, accumulate=1, dtype=torch.bfloat16,
                            max_norm=0.05 if clip else None)  # fmt: skip
    return record, spilled


def compute_a_step(line: str) -> float:
    """The ms of compute a step a disk plan's start-up line counts."""
    return float(re.search(r"against ([0-9.e+-]+) ms of compute", line).group(1))


def test_the_builder_tells_the_state_plan_how_many_micro_batches_a_layer_major_step_computes(tmp_path):
    """layer_major_micro_batches = 4 in the SwapConfig (the step's micro-batches run layer-major): the state plan's
    step computes 4 times one micro-batch's at each fetch, so its line counts 4 times the compute of the build for
    one; a builder that does not pass it on counts one."""

    def state_plan_compute(n: int) -> float:
        lines: list[str] = []
        cfg = SwapConfig.of(host_optimizer=SPEC, prefetch=1, host_ram_budget=0.002, disk_dir=str(tmp_path / str(n)),
                            layer_major_micro_batches=n)  # fmt: skip
        (tmp_path / str(n)).mkdir()
        with LayerSwapper(full_layers(torch.bfloat16), cfg, device=CPU, log=lines.append) as swapper:
            assert swapper.training.disk_state is not None  # the budget spills state
        (line,) = [line for line in lines if line.startswith("DGLS disk state plan:")]
        return compute_a_step(line)

    one, four = state_plan_compute(1), state_plan_compute(4)
    assert one > 0 and four == pytest.approx(4 * one, rel=0.02)


@pytest.mark.parametrize("clip_mode, after", [("exact", True), ("previous_norm", False)])
def test_the_builder_tells_the_state_plan_the_clip_mode(tmp_path, clip_mode, after):
    """Clipping with clip_mode previous_norm: from step 2 each update starts as its gradients land (at the previous
    step's coefficient), so the state plan replays the step as without clipping; exact clipping's updates wait for
    the norm, after the backward. A builder that does not pass the mode on plans previous_norm as exact."""
    lines: list[str] = []
    cfg = SwapConfig.of(host_optimizer=SPEC, accumulation_steps=1, prefetch=1, clip_grads=True, clip_mode=clip_mode,
                        host_ram_budget=0.002, disk_dir=str(tmp_path))  # fmt: skip
    with LayerSwapper(full_layers(torch.bfloat16), cfg, device=CPU, log=lines.append) as swapper:
        assert swapper.training.disk_state is not None  # the budget spills state
    (line,) = [line for line in lines if line.startswith("DGLS disk state plan:")]
    assert ("the updates run after the backward (clipping" in line) == after, line
    assert ("the updates run during the backward" in line) == (not after), line


@pytest.mark.parametrize("clip", [False, True])
def test_the_chosen_spill_trains_as_all_in_ram_and_the_line_names_it(tmp_path, clip):
    lines = []
    got, spilled = run(tmp_path, 0.002, clip, lines.append)
    plan = [line for line in lines if line.startswith("DGLS disk state plan:")]
    assert spilled and len(plan) == 1
    assert f"of {len(spilled)} of 6 trained layers on disk (layers {index_ranges(spilled)})" in plan[0]
    assert "predicted step" in plan[0] and ("after the backward" in plan[0]) == clip
    assert_same(run(None, None, clip)[0], got)


@pytest.mark.parametrize("clip", [False, True])
def test_every_spilled_read_is_issued_before_its_update_brings_it_in(tmp_path, monkeypatch, clip):
    """An update job that starts issues the read of the first queued spilled layer (DiskState.ahead), so even the first
    spilled layer of a step has its read in flight before its own update reaches it (what the state plan models)."""
    events = []
    bring_in, issue = disk_state.DiskState.bring_in, disk_state.DiskState._issue
    monkeypatch.setattr(
        disk_state.DiskState, "bring_in", lambda s, layer: events.append(("in", layer.index)) or bring_in(s, layer)
    )
    monkeypatch.setattr(disk_state.DiskState, "_issue", lambda s, idx: events.append(("read", idx)) or issue(s, idx))
    _, spilled = run(tmp_path, 0.002, clip)
    reads = [idx for kind, idx in events if kind == "read"]
    assert spilled and sorted(reads) == sorted(spilled * 3)  # one read per spilled layer and step
    pending = []
    for kind, idx in events:
        if kind == "read":
            pending.append(idx)
        else:
            assert idx in pending, f"layer {idx}'s read was issued by its own update, not before it: {events}"
            pending.remove(idx)


def test_the_host_update_rate_is_timed_on_the_runs_optimizer_except_deepspeeds():
    rate, timed = disk_planning.host_update_params_per_ms(SPEC)
    assert timed and rate > 0
    deepspeed = dataclasses.replace(SPEC, implementation="deepspeed")  # a C++ op built on its first update
    assert disk_planning.host_update_params_per_ms(deepspeed) == (disk_planning.HOST_UPDATE_PARAMS_PER_MS, False)


def test_the_forecast_counts_the_speculation_a_state_on_disk_turns_off():
    """Clipping: in RAM the updates would start during the backward on speculation; with any state on disk no layer
    speculates, so the baseline the line compares with is the speculating step, and the line says why."""
    clipped = step_costs(after_backward=True, forward_ms=1.0, update_ms=3.0)
    speculating = StateCosts(**{**clipped.__dict__, "speculates_in_ram": True})
    streamed = list(range(8))
    told = forecast_state(speculating, streamed, [7])
    during = simulate_state(step_costs(forward_ms=1.0, update_ms=3.0), streamed, ()).step_ms
    assert told.in_ram.step_ms == pytest.approx(during) and during < simulate_state(clipped, streamed, ()).step_ms
    assert "no layer speculates with states on disk" in told.line() and "in RAM (speculating)" in told.line()
    assert forecast_state(clipped, streamed, [7]).in_ram.step_ms > during
