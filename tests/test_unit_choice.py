"""The swap-unit size for a VRAM budget knowing the step's layer-major micro-batches (planning/unit_choice.py), on a
scaled-down Flux double block's module tree (flux_like.py: units of a 24th of the budget split it into 14 units of
up to 6 d^2; at its attention's size, 5 units of at most 8 d^2 fit the slots a quarter of the budget holds).

- N = 1: the one-micro-batch rule's size and line, word for word; several micro-batches where that size keeps every
  layer's units in the slots: the same size.
- N > 1 where it does not: the split whose units stay, which the planner's own step model (row_copies.simulate_rows)
  predicts copies less and runs faster; the engine copies fewer bytes a step with it, bitwise the same numbers.
- Synthetic splits: a tie with the one-micro-batch size keeps it; among other sizes the smaller pool wins; the slots
  are the fewest that hold every layer's units (3 of the 5 the quarter holds; 7, beyond the prefetch choices); a size
  above the layers' slot bytes that splits them is tried (stored wider than computed); the line says when the
  one-micro-batch units fit no two slots.
- Mutation: a builder that ignores N copies as much as before.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from flux_like import flux_like, micro_batches

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.engine import build
from utils.dgls.engine.layer_major import layer_major_step
from utils.dgls.memory.layout import MB, GiB, LayerSizes, measure
from utils.dgls.memory.transport import Direction
from utils.dgls.planning.planner import UNIT_SLOTS_SHARE, StepProfile, UseTiming, unit_bytes_for_budget
from utils.dgls.planning.row_copies import simulate_rows
from utils.dgls.planning.unit_choice import choose_unit_bytes, split_cost
from utils.dgls.program.validate import deepspeed_too_old_for_layer_major, prepare
from utils.dgls.streaming.schedule import Phase
from utils.dgls.streaming.units import split_layers, split_points
from utils.dgls.watching.listener import Listener

CPU = torch.device("cpu")
D = 64
D2 = D * D * 4  # bytes of a d x d fp32 weight
BLOCKS = 4
TIGHT = 176 * D2  # a Flux-dev block's 679 MB against 3 GiB, scaled: the one-micro-batch units (7.3 d^2) split it in 14
ROOMY = 200 * D2  # units of 8.3 d^2: 5 a block, 5 slots within the quarter


def model():
    return flux_like(BLOCKS, D)


def sizes_of(layers):
    def sizes(unit: int | None) -> list[LayerSizes]:
        entries = split_layers(layers, unit)
        laid = measure([e.value for e in entries])
        return [layout.of_entry(e.layer, e.part, e.holder).sizes for layout, e in zip(laid, entries)]

    return sizes


def choose(budget: int, n: int):
    layers, _ = model()
    sizes = sizes_of(layers)
    return choose_unit_bytes(sizes(None), budget, n, sizes, split_points(layers)), sizes


# ---------------------------------------------------------------- the rule
@pytest.mark.parametrize("budget", [100 * D2, TIGHT, ROOMY, 400 * D2])
def test_one_micro_batch_is_the_one_micro_batch_rule_word_for_word(budget):
    choice, sizes = choose(budget, 1)
    assert choice.unit_bytes == unit_bytes_for_budget(sizes(None), budget)
    if choice.unit_bytes is None:
        assert choice.line == ""
    else:
        assert choice.line.startswith("DGLS: two slots of the largest layer would take over a quarter of the budget:")
        assert choice.line.endswith("stream as swap units (--swap_unit_mb to choose, 0 for whole layers)")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_where_the_one_micro_batch_units_stay_over_the_micro_batches_they_are_kept(n):
    """Units of a 24th of a roomier budget already fit the slots of a quarter: the same size, said why."""
    choice, sizes = choose(ROOMY, n)
    single = unit_bytes_for_budget(sizes(None), ROOMY)
    assert choice.unit_bytes == single
    assert split_cost(sizes(single), single, ROOMY // UNIT_SLOTS_SHARE).keeps_all
    assert "so each layer's units (at most 5) fit 5 slots" in choice.line
    assert f"stay over its {n} micro-batches" in choice.line


def test_whole_layers_stay_whole_whatever_the_micro_batches():
    choice, _ = choose(400 * D2, 4)
    assert choice.unit_bytes is None and choice.line == ""


@pytest.mark.parametrize("n", [2, 4, 8])
def test_with_micro_batches_the_units_that_stay_in_the_slots_are_chosen(n):
    """At the tight budget the one-micro-batch units (14 a block) fetch most of a block again per micro-batch at
    the 5 slots a quarter holds; units at the attention's size (5 a block) all stay, within the same quarter."""
    choice, sizes = choose(TIGHT, n)
    single = unit_bytes_for_budget(sizes(None), TIGHT)
    share = TIGHT // UNIT_SLOTS_SHARE
    before, after = (
        split_cost(sizes(single), single, share),
        split_cost(sizes(choice.unit_bytes), choice.unit_bytes, share),
    )
    assert before.units == 14 and before.refetched > 0
    assert choice.unit_bytes > single and after.units == after.slots == 5 and after.keeps_all and after.pool <= share
    line = choice.line
    assert f"a step runs {n} micro-batches layer-major" in line, line
    assert "so each layer's units (at most 5) fit 5 slots" in line, line
    assert f"stay over its {n} micro-batches" in line and "the one-micro-batch size" in line, line
    assert line.endswith("(--swap_unit_mb to choose, 0 for whole layers)")


def test_where_no_split_keeps_all_the_one_micro_batch_size_stays_if_none_fetches_less():
    """A budget whose quarter holds no split's units, and none fetching less again than the one-micro-batch size:
    that size, and the line says what still comes again."""
    choice, sizes = choose(150 * D2, 4)
    share = 150 * D2 // UNIT_SLOTS_SHARE
    single = unit_bytes_for_budget(sizes(None), 150 * D2)
    costs = [split_cost(sizes(t), t, share) for t in {single, *split_points(model()[0])}]
    assert choice.unit_bytes == single
    assert split_cost(sizes(single), single, share).refetched == min(c.refetched for c in costs if c is not None) > 0
    assert "no unit size lets every layer's units fit the slots within that quarter: at 5 slots" in choice.line


def synthetic(units: dict[int | None, list[int] | None], layers: int = 2):
    """``layers`` layers, each split at unit size t into entries of ``units[t]`` bytes (t None, or ``units[t]``
    None: whole)."""

    def split(t: int | None) -> list[LayerSizes]:
        sizes: list[LayerSizes] = []
        for layer in range(layers):
            if t is None or units[t] is None:
                sizes.append(LayerSizes(len(sizes), "Block", sum(units[None]), 0, layer=layer))
                continue
            sizes.append(LayerSizes(len(sizes), "Block", 0, 0, layer=layer, holder=True))
            for k, nbytes in enumerate(units[t]):
                sizes.append(LayerSizes(len(sizes), "Linear", nbytes, 0, layer=layer, part=f"u{k}"))
        return sizes

    return split


def test_where_no_split_keeps_all_the_split_fetching_least_again_wins():
    """Budget 2000 (slots' quarter 500), layers of 400 bytes. The one-micro-batch units (83 bytes) give 120 + 7 x 40
    (the 120 cannot be split): 4 slots within the quarter keep 2, 240 bytes a layer come again; units of 200 give
    165 + 135 + 50 + 50: 3 slots keep the 165, 235 come again. The fewer bytes win, and the line says so."""
    split = synthetic({None: [400], 83: [120] + [40] * 7, 200: [165, 135, 50, 50]})
    assert split_cost(split(83), 83, 500).refetched == 2 * 240
    assert split_cost(split(200), 200, 500).refetched == 2 * 235
    choice = choose_unit_bytes(split(None), 2000, 4, split, [200])
    assert choice.unit_bytes == 200 and "the size that fetches least again" in choice.line, choice.line
    assert choose_unit_bytes(split(None), 2000, 1, split, [200]).unit_bytes == 83


def test_a_tie_with_the_one_micro_batch_size_keeps_it():
    """Units of 200 fetch as many bytes again as the one-micro-batch units (83) from a smaller pool (4 slots of 80
    against 5 of 100): nothing fetches less, so the one-micro-batch size stays."""
    split = synthetic({None: [400], 83: [100, 80, 60, 40, 40, 20, 20, 40], 200: [80, 80, 80, 80, 40, 20, 20]})
    base, other = split_cost(split(83), 83, 500), split_cost(split(200), 200, 500)
    assert base.refetched == other.refetched > 0 and other.pool < base.pool
    choice = choose_unit_bytes(split(None), 2000, 4, split, [200])
    assert choice.unit_bytes == 83 and "no unit size lets every layer's units fit the slots" in choice.line


def test_among_sizes_that_fetch_as_little_again_the_smaller_pool_wins():
    """Units of 100 (4 a layer, 4 slots: 400 bytes) and of 225 (225 + 175, 2 slots: 450 bytes) both stay over the
    micro-batches; the smaller pool wins, though its units are more."""
    split = synthetic({None: [400], 83: [120] + [40] * 7, 100: [100] * 4, 225: [225, 175]})
    small, large = split_cost(split(100), 100, 500), split_cost(split(225), 225, 500)
    assert small.keeps_all and large.keeps_all and small.pool < large.pool and small.entries > large.entries
    assert choose_unit_bytes(split(None), 2000, 4, split, [225, 100]).unit_bytes == 100


def test_the_slots_are_the_fewest_that_hold_every_layers_units_at_any_count():
    """3 units a layer get 3 slots (300 bytes), not the 5 the quarter would hold; 7 units a layer get 7 slots (490
    bytes within the 500), a depth beyond the planner's prefetch choices, and all stay."""
    split = synthetic({None: [400], 83: [120] + [40] * 7, 100: [100] * 3, 70: [70] * 7})
    three, seven = split_cost(split(100), 100, 500), split_cost(split(70), 70, 500)
    assert (three.slots, three.pool, three.keeps_all) == (3, 300, True)
    assert (seven.slots, seven.pool, seven.keeps_all) == (7, 490, True)
    assert "so each layer's units (at most 7) fit 7 slots" in choose_unit_bytes(split(None), 2000, 4, split, [70]).line
    assert "so each layer's units (at most 3) fit 3 slots" in choose_unit_bytes(split(None), 2000, 4, split, [100]).line


def test_a_candidate_is_tried_where_it_splits_whatever_the_layers_slot_bytes():
    """Split points count params in their storage dtype, slots in their compute dtype: stored wider than they
    compute, a layer of 400 slot bytes splits at a unit size of 500 (its modules' stored bytes). Tried, those
    units stay; a size that splits nothing (1000) is no candidate."""
    split = synthetic({None: [400], 83: [120] + [40] * 7, 500: [100] * 4, 1000: None})
    assert len(split(1000)) == len(split(None))
    choice = choose_unit_bytes(split(None), 2000, 4, split, [500, 1000])
    assert choice.unit_bytes == 500 and split_cost(split(500), 500, 500).keeps_all


def test_where_the_one_micro_batch_units_fit_no_two_slots_the_line_says_so():
    split = synthetic({None: [400], 83: [300, 100], 100: [100] * 4})
    assert split_cost(split(83), 83, 500) is None  # two slots of 300 are over the quarter's 500
    choice = choose_unit_bytes(split(None), 2000, 4, split, [100])
    assert choice.unit_bytes == 100
    assert "the one-micro-batch size, 0.0 MiB, does not fit two slots within that quarter" in choice.line, choice.line


# ---------------------------------------------------------------- the planner's step model
def layer_major_profile(sizes: list[LayerSizes], n: int, bytes_per_ms: float) -> StepProfile:
    """One layer-major step of ``n`` micro-batches (no checkpointing): each layer's entries in order, ``n`` times,
    then in reverse order (its backward), ``n`` times; 1 ms a use."""
    uses: list[UseTiming] = []
    layers = sorted({s.owner for s in sizes})
    entries = {layer: [s.index for s in sizes if s.owner == layer] for layer in layers}
    for layer in layers:
        uses += [UseTiming(e, Phase.FORWARD, 1.0) for _ in range(n) for e in entries[layer]]
    for layer in reversed(layers):
        uses += [UseTiming(e, Phase.BACKWARD, 1.0) for _ in range(n) for e in reversed(entries[layer])]
    return StepProfile(tuple(uses), 0, 0, bytes_per_ms, micro_batches=n)


@pytest.mark.parametrize("n", [2, 4])
def test_the_planners_step_model_predicts_the_chosen_units_copy_less_and_run_faster(n):
    """simulate_rows (the planner's replay of a layer-major step) at each split's slots within the quarter, every
    layer streamed, copy-bound: the chosen units fetch nothing again and the step is shorter."""
    choice, sizes = choose(TIGHT, n)
    single = unit_bytes_for_budget(sizes(None), TIGHT)
    share = TIGHT // UNIT_SLOTS_SHARE
    steps = {}
    for unit in (single, choice.unit_bytes):
        split = sizes(unit)
        cost = split_cost(split, unit, share)
        streamed = [s.index for s in split if s.streamable_bytes]
        steps[unit] = simulate_rows(split, layer_major_profile(split, n, D2 / 4), streamed, cost.slots - 1)
    chosen, before = steps[choice.unit_bytes], steps[single]
    assert chosen.refetched_bytes == 0 and before.refetched_bytes > 0
    assert chosen.copied_bytes < before.copied_bytes and chosen.step_ms < before.step_ms


# ---------------------------------------------------------------- the engine
class WeightBytes(Listener):
    """Weight bytes copied per pass (one layer-major step's backward ends its pass)."""

    def __init__(self) -> None:
        self.passes: list[int] = []
        self.nbytes = 0

    def copied(self, copy) -> None:
        if copy.direction is Direction.WEIGHTS_IN:
            self.nbytes += copy.nbytes

    def pass_ended(self) -> None:
        self.passes.append(self.nbytes)
        self.nbytes = 0


def _loss(micro, out, m):
    return torch.nn.functional.mse_loss(out[0], micro[m][1])


def train(n: int, swap: SwapConfig | None, steps: int = 3, log=None, device=CPU, hook=None):
    """LoRA-like steps (each block's gain trains) of ``n`` micro-batches, layer-major; the bytes copied per step, the
    trained gains (on the CPU), and the swapper's unit size and slot count. ``hook(swapper)`` sees the swapper
    first; without ``swap`` the layers are resident on ``device``."""
    layers, trainable = model()
    counter = WeightBytes()
    if swap is None:
        for layer in layers:
            layer.to(device)
    swapper = LayerSwapper(layers, swap, device=device, log=log) if swap is not None else None
    seen = {}
    try:
        if swapper is not None:
            swapper.add_listener(counter)
            seen = {"unit": swapper.unit_bytes, "slots": len(swapper.pool.slots)}
            if hook is not None:
                hook(swapper)
        opt = torch.optim.SGD(trainable, lr=0.1)
        for s in range(steps):
            micro = [(tuple(t.to(device) for t in x), y.to(device)) for x, y in micro_batches(n, D, seed=s)]
            layer_major_step(layers, [x for x, _ in micro], partial(_loss, micro), swapper)
            opt.step()
            opt.zero_grad()
        return counter.passes, [p.detach().cpu().clone() for p in trainable], seen
    finally:
        if swapper is not None:
            swapper.remove()


def chosen_units(n: int) -> int:
    """The unit size the builder chooses under the tight budget for ``n`` layer-major micro-batches."""
    layers, _ = model()
    config = SwapConfig.of(vram_budget=TIGHT / GiB, layer_major_micro_batches=n)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        return swapper.unit_bytes


def copies_at_the_quarters_slots(unit: int, n: int = 4, device=CPU, hook=None):
    """Every layer streamed as units of ``unit`` bytes, with the slots a quarter of the tight budget holds for them
    (planning/unit_choice.split_cost): the weight bytes of the third step, the trained gains."""
    layers, _ = model()
    cost = split_cost(sizes_of(layers)(unit), unit, TIGHT // UNIT_SLOTS_SHARE)
    swap = SwapConfig.of(swap_unit_mb=unit / MB, prefetch=cost.slots - 1, blocks_to_swap=BLOCKS)
    passes, gains, seen = train(n, swap, device=device, hook=hook)
    assert seen["slots"] == cost.slots
    return passes[-1], gains


def test_under_a_budget_the_engine_copies_fewer_bytes_a_step_with_units_chosen_for_the_micro_batches():
    """The builder's choice for 4 micro-batches against its choice for 1, each streamed with the slots a quarter of
    the budget holds: the weight bytes a step fall to what one micro-batch copies (each unit once a direction), from
    well over twice that; the trained numbers are bitwise those of the same steps without DGLS."""
    single, chosen = chosen_units(1), chosen_units(4)
    assert chosen != single
    before, gains_before = copies_at_the_quarters_slots(single)
    after, gains_after = copies_at_the_quarters_slots(chosen)
    once, _ = copies_at_the_quarters_slots(chosen, n=1)
    assert after == once and before > 2 * after
    _, reference, _ = train(4, None)
    for a, b, c in zip(reference, gains_before, gains_after):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.slow  # five builds and their steps: about 4 s on 2 cores, and the default run is near its limit
def test_mutation_a_builder_that_ignores_the_micro_batches_copies_as_much_as_before(monkeypatch):
    choose_as_before = build.choose_unit_bytes

    def ignoring_n(whole, budget, micro_batches, split, candidates):
        return choose_as_before(whole, budget, 1, split, candidates)

    monkeypatch.setattr(build, "choose_unit_bytes", ignoring_n)
    after, _ = copies_at_the_quarters_slots(chosen_units(4))
    once, _ = copies_at_the_quarters_slots(chosen_units(4), n=1)
    with pytest.raises(AssertionError):
        assert after == once  # the test above's check


@pytest.mark.slow  # two runs of layer-major steps under a budget: about 3 s on 2 cores (the default run's limit)
def test_a_step_of_other_micro_batches_than_the_units_were_sized_for_says_how_to_size_them():
    """A library loop that did not tell the builder its micro-batches: the line saying which units come again per
    micro-batch (the probe's slots) says how to size them for this count; told, it does not."""
    untold: list[str] = []
    train(4, SwapConfig.of(vram_budget=TIGHT / GiB), steps=2, log=untold.append)
    said = [line for line in untold if "fetched again in each micro-batch" in line]
    assert len(said) == 1 and "layer_major_micro_batches = 4 in the SwapConfig sizes them for 4" in said[0], untold
    told: list[str] = []
    train(4, SwapConfig.of(vram_budget=TIGHT / GiB, layer_major_micro_batches=4), steps=2, log=told.append)
    assert not any("layer_major_micro_batches" in line for line in told), told


@pytest.mark.parametrize("n", [1, 4])
def test_a_full_fine_tune_sizes_its_units_for_the_micro_batches_too(n):
    """Host-trained layers stream their trainable params in the units too (the builder counts them): the same
    choice as the frozen model's, for one micro-batch and for four."""
    from full_ft import SPEC

    layers, _ = model()
    for layer in layers:
        layer.requires_grad_(True)
    config = SwapConfig.of(vram_budget=TIGHT / GiB, host_optimizer=SPEC, layer_major_micro_batches=n)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        assert swapper.unit_bytes == chosen_units(n)


def test_swap_unit_mb_given_wins_over_the_choice_for_the_micro_batches():
    layers, _ = model()
    lines: list[str] = []
    config = SwapConfig.of(vram_budget=TIGHT / GiB, layer_major_micro_batches=4, swap_unit_mb=0.05)
    with LayerSwapper(layers, config, device=CPU, log=lines.append) as swapper:
        assert swapper.unit_bytes == round(0.05 * MB + 0.5)
    assert not any("micro-batches layer-major" in line for line in lines)


# ---------------------------------------------------------------- where N comes from
needs_layer_major = pytest.mark.skipif(
    deepspeed_too_old_for_layer_major() is not None, reason=str(deepspeed_too_old_for_layer_major())
)


@needs_layer_major
def test_the_start_up_checks_tell_the_builder_the_layer_major_micro_batches(tmp_path, monkeypatch):
    """The demo's and the drop-in's checks set PlacementPolicy.layer_major_micro_batches where layer-major applies
    (validate.layer_major_applies), and leave 1 where micro-batches run one after another."""
    from cli_helpers import FAKE, demo_toml, fake_config
    from conftest import ROOT

    def told(argv, here) -> int:
        return prepare(argv, here).swap.placement.layer_major_micro_batches

    demo = ["--config", str(demo_toml(tmp_path, gradient_accumulation_steps=4))]
    assert told(demo, tmp_path) == 4 and told([*demo, "--lazy_lora_steps", "2"], tmp_path) == 8
    assert told([*demo, "--no-layer_major"], tmp_path) == 1
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    config = fake_config(tmp_path / "dp", top="gradient_accumulation_steps = 4")
    drop_in = ["--config", str(config), "--diffusion_pipe", str(FAKE), "--vram_budget", "8"]
    assert told(drop_in, ROOT) == 4 and told([*drop_in, "--no-layer_major"], ROOT) == 1


@pytest.mark.slow  # two demo runs to their probe: about 12 s on 2 cores
@needs_layer_major
def test_the_demo_sizes_its_units_for_its_layer_major_micro_batches_and_says_so(tmp_path, capsys):
    """dgls_train.py's demo end to end (--plan: it stops after the probe): with gradient_accumulation_steps = 4 under
    a tight budget, the start-up line is the one for 4 layer-major micro-batches; with one micro-batch, the one
    before."""
    from cli_helpers import demo_toml, run_in_process

    def start_up(folder, **demo) -> str:
        config = demo_toml(folder, steps=3, **demo)
        code, out, err = run_in_process(["--config", str(config), "--vram_budget", "0.00105", "--plan"], capsys)
        assert code == 0, err
        (line,) = [line for line in out.splitlines() if "two slots of the largest layer" in line]
        return line

    assert "a step runs 4 micro-batches layer-major" in start_up(tmp_path / "4", gradient_accumulation_steps=4)
    assert "layer-major" not in start_up(tmp_path / "1", gradient_accumulation_steps=1)
