"""The VRAM-budget planner: its choices on synthetic layers and timings, live re-placement, errors."""

import random

import pytest
import torch
from helpers import assert_bitwise_equal, make_layers, train

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.placement import LayerSizes, plan_placement
from utils.dgls.planner import (
    GiB,
    StepProfile,
    UseTiming,
    minimum_bytes,
    plan_for_budget,
    predict_peak,
    simulate,
)

CPU = torch.device("cpu")
MiB = 2**20


def flux_like(double_ms=5.0, single_ms=2.5):
    """Embedding, 19 double blocks of 680 MiB, 38 single blocks of 340 MiB, output; backward = 3x forward."""
    sizes = [LayerSizes(0, "Embed", 0, 100 * MiB)]
    forward = [1.0]
    for i in range(1, 58):
        sizes.append(LayerSizes(i, "Block", (680 if i <= 19 else 340) * MiB, 0))
        forward.append(double_ms if i <= 19 else single_ms)
    sizes.append(LayerSizes(58, "Final", 0, 10 * MiB))
    forward.append(1.0)
    uses = [UseTiming(i, "F", forward[i]) for i in range(59)] + [
        UseTiming(i, "B", 3 * forward[i]) for i in range(58, -1, -1)
    ]
    return sizes, StepProfile(tuple(uses), activation_bytes=3 * GiB, reserved_overhead=GiB // 2, bytes_per_ms=55e6)


def test_everything_resident_costs_only_compute():
    sizes, profile = flux_like()
    assert simulate(sizes, profile, [], 2) == pytest.approx(profile.compute_ms)


def test_streaming_more_is_never_predicted_faster_at_the_ends():
    sizes, profile = flux_like()
    times = [simulate(sizes, profile, range(29 - n // 2, 29 + (n - n // 2)), 2) for n in range(0, 57, 8)]
    assert times == sorted(times)
    assert times[-1] > profile.compute_ms * 1.1  # streaming 56 blocks is copy bound somewhere


def test_copy_bound_step_is_at_least_the_copy_time():
    sizes, profile = flux_like(double_ms=0.1, single_ms=0.1)
    streamed = range(1, 58)
    copy_ms = sum(sizes[i].streamable_bytes for i in streamed) / profile.bytes_per_ms
    assert simulate(sizes, profile, streamed, 2) >= 2 * copy_ms * 0.99  # forward and backward both copy


@pytest.mark.parametrize("budget_gib", [8, 12, 16, 24])
def test_plans_fit_the_budget_and_beat_the_end_placement(budget_gib):
    sizes, profile = flux_like()
    budget = budget_gib * GiB
    plan = plan_for_budget(sizes, profile, budget)
    assert plan.predicted_peak <= budget
    assert predict_peak(sizes, profile, plan.streamed, plan.prefetch) == plan.predicted_peak
    # the best "resident at both ends" placement (blocks_to_swap style) that fits, any prefetch
    blocks = list(range(1, 58))
    best_ends = min(
        simulate(sizes, profile, blocks[(k + 1) // 2 : 57 - k // 2], p)
        for p in (1, 2, 3, 4)
        for k in range(58)
        if predict_peak(sizes, profile, blocks[(k + 1) // 2 : 57 - k // 2], p) <= budget
    )
    assert plan.predicted_ms <= best_ends + 1e-6


def test_spread_resident_layers_hide_copies():
    """With half the blocks resident, interleaving them hides forward copies that the ends can't."""
    sizes, profile = flux_like()
    blocks = list(range(1, 58))
    ends = blocks[14:43]
    spread = blocks[::2]
    assert simulate(sizes, profile, spread, 2) < simulate(sizes, profile, ends, 2)


def test_budget_below_the_minimum_names_the_minimum():
    sizes, profile = flux_like()
    need = minimum_bytes(sizes, profile, 1)
    with pytest.raises(DGLSUserError, match=f"below the minimum {need / GiB:.2f} GiB"):
        plan_for_budget(sizes, profile, need - 1)
    plan = plan_for_budget(sizes, profile, need)
    assert len(plan.streamed) == 57 and plan.prefetch == 1


def test_apply_placement_between_steps_keeps_training_exact():
    layers, trainable = make_layers()
    reference = train(layers, trainable, CPU, "nonreentrant", steps=5)
    layers, trainable = make_layers()
    rng = random.Random(0)
    with LayerSwapper(layers, SwapConfig(prefetch=1), device=CPU, log=None) as swapper:

        def shuffle(step):
            chosen = [i for i in range(len(layers)) if rng.random() < 0.6]
            swapper.apply_placement(chosen, prefetch=rng.choice([0, 1, 2]))
            assert set(swapper.streamed_layers) <= set(chosen)

        got = train(layers, trainable, CPU, "nonreentrant", steps=5, on_step=shuffle)
    assert_bitwise_equal(reference, got)


def test_auto_plan_on_cpu_probes_plans_and_stays_exact():
    layers, trainable = make_layers()
    reference = train(layers, trainable, CPU, "nonreentrant", steps=6)
    layers, trainable = make_layers()
    sizes = plan_placement(layers, SwapConfig(gpu_layers=[])).sizes
    middle = (minimum_bytes(sizes, None) + sum(s.streamable_bytes + s.fixed_bytes for s in sizes)) / 2
    lines = []
    config = SwapConfig(vram_budget_gb=middle / GiB)
    with LayerSwapper(layers, config, device=CPU, log=lines.append) as swapper:
        assert len(swapper.streamed_layers) == sum(1 for s in sizes if s.streamable_bytes)  # probe: all stream
        got = train(layers, trainable, CPU, "nonreentrant", steps=6, on_step=lambda step: swapper.step_stats())
        plan = swapper.autoplanner.plan
        assert swapper.autoplanner.done
    assert_bitwise_equal(reference, got)
    assert plan is not None and plan.predicted_peak <= middle
    assert 0 < len(plan.streamed) < len(sizes)
    assert any(line.startswith("DGLS plan") for line in lines)


def test_explicit_placement_wins_over_the_budget():
    layers, _ = make_layers()
    lines = []
    with LayerSwapper(layers, SwapConfig(vram_budget_gb=1.0, blocks_to_swap=2), device=CPU, log=lines.append) as s:
        assert s.autoplanner is None and len(s.streamed_layers) == 2
    assert any("explicit placement wins" in line for line in lines)


def test_budget_below_the_static_minimum_stops_before_step_one():
    layers, _ = make_layers()
    with pytest.raises(DGLSUserError, match="below the minimum"):
        LayerSwapper(layers, SwapConfig(vram_budget_gb=1e-6), device=CPU, log=None)


@pytest.mark.parametrize("value", [0, -1, "lots", True])
def test_bad_budget_values(value):
    with pytest.raises(DGLSUserError, match="vram_budget"):
        SwapConfig(vram_budget_gb=value)
