"""--vram_budget for a full fine-tune: the planner counts what the trainer keeps on the device for resident layers'
params (from the objects that allocate it), and its plan is fixed once, before the first update, so the run is the
run of the same placement given explicitly (utils/dgls/planning/autoplan.py, utils/dgls/engine/training_costs.py)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from full_ft import MAX_NORM, SPEC, SPLIT, _batches, _forward_backward, _weights, full_layers, params_of
from helpers import run_layers
from torch.utils.checkpoint import checkpoint

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.engine.training_costs import with_training_costs
from utils.dgls.memory.layout import LayerSizes, device_bytes, measure, training_bytes
from utils.dgls.planning.autoplan import explicit_settings
from utils.dgls.planning.planner import GiB, StepProfile, UseTiming, minimum_bytes, plan_for_budget, predict_peak
from utils.dgls.streaming.schedule import Phase

CPU = torch.device("cpu")
MiB = 2**20


# ---------------------------------------------------------------- the planner's memory model
def blocks(trained_share: int = 0, count: int = 20, block_mib: int = 200):
    """An embedding (fixed) and ``count`` blocks; ``trained_share``: each block's trained bytes in units of its
    weights (a full fine-tune with bf16 AdamW on the device: gradients 1, two moments 2)."""
    sizes = [LayerSizes(0, "Embed", 0, 100 * MiB)]
    for i in range(1, count + 1):
        sizes.append(LayerSizes(i, "Block", block_mib * MiB, 0, trained_bytes=trained_share * block_mib * MiB))
    uses = [UseTiming(i, Phase.FORWARD, 2.0) for i in range(count + 1)]
    uses += [UseTiming(i, Phase.BACKWARD, 6.0) for i in range(count, -1, -1)]
    return sizes, StepProfile(tuple(uses), activation_bytes=GiB, reserved_overhead=GiB // 4, bytes_per_ms=50e6)


def test_a_budget_that_fits_a_lora_all_resident_keeps_fewer_layers_resident_for_a_full_fine_tune():
    """The same layers and the same budget: a LoRA keeps every block resident; a full fine-tune counts each resident
    block's gradients and optimizer state (3x its weights) and the update buffers, so it streams some, and its
    predicted peak is the sum of those parts."""
    lora, profile = blocks()
    full, _ = blocks(trained_share=3)
    full_profile = dataclasses.replace(profile, update_bytes=384 * MiB)
    budget = predict_peak(lora, profile, [], 1)
    assert plan_for_budget(lora, profile, budget).streamed == ()
    plan = plan_for_budget(full, full_profile, budget)
    assert 0 < len(plan.streamed) < 20 and plan.predicted_peak <= budget
    parts = (
        device_bytes(full, plan.streamed, plan.prefetch)
        + training_bytes(full, plan.streamed)  # the resident blocks' gradients and moments: 3x their weights
        + 384 * MiB
        + profile.activation_bytes
        + profile.reserved_overhead
    )
    assert plan.predicted_peak == parts
    resident = 20 - len(plan.streamed)
    assert training_bytes(full, plan.streamed) == resident * 3 * 200 * MiB
    assert minimum_bytes(full, full_profile) == minimum_bytes(lora, profile) + 384 * MiB, "streamed: nothing more"


def test_a_budget_below_a_full_fine_tunes_minimum_names_the_update_buffers():
    sizes, profile = blocks(trained_share=3)
    profile = dataclasses.replace(profile, activation_bytes=0, reserved_overhead=0, update_bytes=4 * GiB)
    with pytest.raises(
        DGLSUserError, match=r"4\.00 GiB of optimizer state and update buffers.*--host_adam torch_fused"
    ):
        plan_for_budget(sizes, profile, 3 * GiB)


# ---------------------------------------------------------------- the figures, from the objects that allocate them
def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


@pytest.mark.parametrize(
    "spec",
    [SPEC, dataclasses.replace(SPEC, type="sgd", momentum=0.0, betas=(0.9, 0.99))],
    ids=["adamw", "sgd"],
)
def test_a_resident_layers_cost_is_its_gradients_and_what_the_trainers_optimizer_allocates(spec):
    """Each layer's ``trained_bytes``: its params' gradients plus the state the trainer's optimizer (the type's class)
    keeps after a step over exactly those params (AdamW: two fp32 moments; SGD without momentum: none)."""
    layers = full_layers()
    costed = with_training_costs(layers, measure(layers, host_trained=True), spec, "auto")
    for layer, layout in zip(layers, costed):
        params = [torch.nn.Parameter(p.detach().clone()) for p in layer.parameters()]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        trainer = spec.trainer_optimizer(params)
        trainer.step()
        grads = sum(p.numel() * p.element_size() for p in params)
        assert layout.sizes.trained_bytes == grads + state_bytes(trainer), layout.sizes.label
        assert layout.sizes.fixed_state_bytes == 0  # nothing trainable is resident whatever the placement
    moments = sum(2 * 4 * p.numel() for p in params_of(layers))
    assert sum(s.sizes.trained_bytes for s in costed) == sum(4 * p.numel() for p in params_of(layers)) + (
        moments if spec.type == "adamw" else 0
    )


def test_the_update_buffers_counted_are_the_ones_the_host_training_reserves():
    config = SwapConfig.of(host_optimizer=dataclasses.replace(SPEC, implementation="device"), vram_budget=1.0)
    with LayerSwapper(full_layers(), config, device=CPU, log=None) as swapper:
        assert swapper.placement.update_bytes == swapper.training.device_bytes > 0
        assert swapper.driver.fixed and len(swapper.streamed_layers) == len(swapper.layers), "the probe: all stream"


def test_a_budget_below_the_update_buffers_and_two_slots_stops_before_step_one():
    config = SwapConfig.of(host_optimizer=dataclasses.replace(SPEC, implementation="device"), vram_budget=1e-5)
    with pytest.raises(DGLSUserError, match=r"below the minimum .* 2 x the largest layer \+ the device update buffers"):
        LayerSwapper(full_layers(), config, device=CPU, log=None)


# ---------------------------------------------------------------- one plan, fixed before the first update
def middle_budget(layers, spec=SPEC) -> float:
    """GiB halfway between every layer streamed and every layer resident, for these layers fully trained."""
    sizes = [lay.sizes for lay in with_training_costs(layers, measure(layers, host_trained=True), spec, "auto")]
    least = minimum_bytes(sizes, None)
    most = device_bytes(sizes, [], 1) + training_bytes(sizes, [])
    return (least + most) / 2 / GiB


def train_full(layers, swapper, steps=3, clip=True, tell=True, dtype=torch.float32):
    """A full fine-tune's loop as diffusion-pipe's engine runs it: the trainer's optimizer over every trainable param
    (those the host trains have no gradient at its step), clipping through the host training (which lets the planner
    fix its plan first) or, without clipping, ``before_step`` (``tell``) before the trainer's step."""
    training = swapper.training
    params = params_of(layers)
    trainer = SPEC.trainer_optimizer(params)
    batches = _batches(CPU, dtype)
    losses = []
    for _ in range(steps):
        inputs, target = next(batches)
        losses.append(_forward_backward(layers, inputs, target, "nonreentrant"))
        if clip:
            training.clip_grad_norm_(params, MAX_NORM)
        elif tell:
            training.before_step()
        trainer.step()
        trainer.zero_grad()
        training.step()
    return losses, _weights(layers)


def resident_layers(swapper) -> list[int]:
    return sorted({s.owner for s in swapper.placement.sizes if s.streamable_bytes} - set(swapper.streamed_layers))


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "unclipped"])
def test_the_plan_is_fixed_before_the_first_update_and_trains_as_that_placement_given_explicitly(clip):
    """Step 1 probes with every layer streamed; before its optimizer step the plan is applied once (the layers it
    keeps resident take their step-1 gradients to the trainer's optimizer), then never again; the weights are
    bitwise those of the run given the same placement from the start. Without clipping no host update starts in
    step 1's backward (the planner may still hand its layer over)."""
    layers = full_layers()
    config = SwapConfig.of(host_optimizer=SPEC, clip_grads=clip, vram_budget=middle_budget(layers), prefetch=1)
    lines: list[str] = []
    with LayerSwapper(layers, config.replace(prefetch=2), device=CPU, log=lines.append) as swapper:
        applied = []
        original = swapper.apply_placement

        def apply_placement(*args, **kwargs):
            applied.append(len(swapper.training.layers))
            original(*args, **kwargs)

        swapper.apply_placement = apply_placement  # the driver calls this attribute
        losses, weights = train_full(layers, swapper, clip=clip)
        resident, prefetch = resident_layers(swapper), swapper.placement.prefetch
        assert applied == [len(swapper.layers)], "applied once, while the host still trained every layer"
        assert swapper.driver.done and 0 < len(resident) < len(swapper.layers)
        assert not any(swapper.training.owns(p) for i in resident for p in swapper.layers[i].parameters())
        training = swapper.training  # a released layer's spare is gone from the layout too
        assert set(training.speculation.spares) == training.layout.spares <= set(training.layout.layers)
        assert bool(training.layout.spares) == clip and training.layout.parts()
        with pytest.raises(DGLSUserError, match="full fine-tuning places layers once"):
            original(list(swapper.streamed_layers), prefetch)
    assert any("fixed for the run from step 1's optimizer step" in line for line in lines)
    assert any(f"--gpu_layers {','.join(map(str, resident))} --prefetch {prefetch}" in line for line in lines)
    explicit = SwapConfig.of(host_optimizer=SPEC, clip_grads=clip, gpu_layers=resident, prefetch=prefetch)
    layers = full_layers()
    with LayerSwapper(layers, explicit, device=CPU, log=None) as swapper:
        want_losses, want = train_full(layers, swapper, clip=clip)
    assert torch.equal(torch.stack(losses), torch.stack(want_losses))
    assert want.keys() == weights.keys() and all(torch.equal(weights[k], want[k]) for k in want)


def test_a_trainer_that_steps_before_dgls_hears_of_the_step_keeps_the_probes_placement():
    layers = full_layers()
    config = SwapConfig.of(host_optimizer=SPEC, clip_grads=False, vram_budget=middle_budget(layers))
    lines: list[str] = []
    with LayerSwapper(layers, config, device=CPU, log=lines.append) as swapper:
        everything = swapper.streamed_layers
        train_full(layers, swapper, clip=False, tell=False)
        assert swapper.driver.done and swapper.streamed_layers == everything
    assert any("not applied: the trainer stepped before DGLS heard of the step" in line for line in lines)


def test_the_explicit_flags_name_whole_layers_in_the_whole_list():
    sizes = [LayerSizes(0, "A", 10, 0), LayerSizes(1, "B", 10, 0), LayerSizes(2, "C", 10, 0)]
    plan = plan_for_budget(sizes, StepProfile((UseTiming(0, Phase.FORWARD, 1.0),), 0, 0, 1.0), 10**6)
    assert explicit_settings(sizes, plan, first_layer=5) == "--gpu_layers 5,6,7 --prefetch 1"
    units = [
        LayerSizes(0, "A", 0, 0, holder=True),
        *(LayerSizes(i, "Linear", 10, 0, layer=0, part=str(i)) for i in (1, 2)),
    ]
    split = dataclasses.replace(plan, streamed=(1,))
    assert explicit_settings(units, split) == "", "some units of a layer resident: no --gpu_layers names that"
    assert explicit_settings(units, dataclasses.replace(plan, streamed=(1, 2)), unit_bytes=2 * MiB) == (
        "--blocks_to_swap 1 --prefetch 1 --swap_unit_mb 2.0"
    )


# ---------------------------------------------------------------- the budget holds on a GPU
@pytest.mark.gpu
def test_on_cuda_a_full_fine_tune_under_a_budget_stays_under_it_in_peak_reserved_memory():
    """A Flux-shaped model of 218M params in bf16, fully trained (AdamW: bf16 state for resident layers, split
    updates for streamed ones), blocks checkpointed through the swapper (activation offload as the budget needs):
    every layer resident (8 bytes a param, and the update buffers) is over the budget, every layer streamed well
    under it, so the plan keeps some layers resident and streams the others; no step's peak reserved memory (read
    after every step, since before the swapper was built) passes the budget."""
    from utils.dgls.demo.data import SyntheticLatents
    from utils.dgls.demo.model import DemoModelConfig, build_layers

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = DemoModelConfig(hidden=1024, heads=8, double_blocks=4, single_blocks=4, text_dim=64, latent_channels=16)
    layers = build_layers(cfg, seed=0, dtype=torch.bfloat16)
    for layer in layers:
        layer.requires_grad_(True)
    budget = 1.5
    spec = dataclasses.replace(SPEC, implementation="split")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    config = SwapConfig.of(host_optimizer=spec, vram_budget=budget, prefetch=1)
    data = SyntheticLatents(cfg, samples=8, image_tokens=256, text_tokens=32, seed=3).batches(2, torch.bfloat16, dev)
    peaks = []
    with LayerSwapper(layers, config.replace(prefetch=2), device=dev, log=print) as swapper:
        training = swapper.training
        params = params_of(layers)
        trainer = spec.trainer_optimizer(params)
        checkpoint_fn = swapper.checkpoint_function(functools.partial(checkpoint, use_reentrant=False))
        for _ in range(6):
            inputs, target = next(data)
            out = run_layers(layers, inputs, "nonreentrant", checkpoint_fn)
            loss = torch.nn.functional.mse_loss(out.float(), target.float())
            loss.backward()
            training.clip_grad_norm_(params, 1.0)
            trainer.step()
            trainer.zero_grad()
            training.step()
            torch.cuda.synchronize(dev)
            peaks.append(torch.cuda.max_memory_reserved(dev))
        resident = resident_layers(swapper)
        assert swapper.driver.done and 0 < len(resident) < len(layers), resident
    assert max(peaks) <= budget * GiB, [round(p / GiB, 3) for p in peaks]


def test_a_budgets_ram_check_counts_the_optimizer_state_of_the_layers_its_plan_streams_once_it_is_fixed(monkeypatch):
    """Under a VRAM budget step 1 streams every layer, but the optimizer state is made at a layer's first update,
    after the plan: the start-up check counts what is allocated then (masters, landings), and the state of the layers
    the plan streams is counted once the plan is fixed, before any update. A host with room for the first but not for
    every layer's state starts (it was refused before), says so, and stops at the plan with one line when the
    streamed layers' state does not fit what is free then; also where the plan is not applied (the trainer stepped
    before DGLS heard of the step) and every layer stays streamed."""
    from utils.dgls.memory import host_store

    layers = full_layers()
    config = SwapConfig.of(host_optimizer=SPEC, clip_grads=False, vram_budget=middle_budget(layers))
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        layout = swapper.training.layout
        later = layout.deferred_state()
        now = sum(v for k, v in layout.parts().items() if k != "speculation") - later
    assert later == layout.parts()["optimizer"] > 0, "host AdamW makes every layer's state at its first update"
    with LayerSwapper(full_layers(), SwapConfig.of(host_optimizer=SPLIT), device=CPU, log=None) as swapper:
        assert swapper.training.layout.layers and swapper.training.layout.parts()["optimizer"] > 0
        assert swapper.training.layout.deferred_state() == 0, "split updates make every layer's state at start-up"
        assert all(layer.optimizer.state for layer in swapper.training.layers.values())

    class Host:
        total = 16 * 2**30  # reserve: 2 GiB
        available = 2 * 2**30 + now + later // 2  # room for what step 1 allocates, not for every layer's state

    monkeypatch.setattr(host_store.psutil, "virtual_memory", lambda: Host)
    lines: list[str] = []
    layers = full_layers()
    with LayerSwapper(layers, config, device=CPU, log=lines.append) as swapper:
        assert any("is made at their first update and counted once the plan is fixed" in line for line in lines)
        Host.available = 2 * 2**30 + 1024  # the state of the layers the plan streams does not fit now
        with pytest.raises(DGLSUserError, match=r"the VRAM budget's plan streams \d+ trained layers, whose optimizer"):
            train_full(layers, swapper, clip=False)
        streamed = len(swapper.training.layout.layers)
        assert 0 < streamed < len(swapper.layers), "refused after the plan released the resident layers"
        assert not any(
            layer.optimizer is not None and layer.optimizer.state for layer in swapper.training.layers.values()
        )
    Host.available = 2 * 2**30 + now + later // 2
    layers = full_layers()
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:  # a trainer that steps before DGLS hears
        everything = len(swapper.training.layers)
        Host.available = 2 * 2**30 + 1024
        with pytest.raises(DGLSUserError, match=rf"call before_step\(\) .* placement streams {everything} trained"):
            train_full(layers, swapper, clip=False, tell=False)  # the probe's placement kept: checked all the same
    Host.available = 2 * 2**30 + later - 1  # short of every layer's state, room for the streamed layers' only
    layers = full_layers()
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        train_full(layers, swapper, clip=False)
        assert 0 < swapper.training.layout.deferred_state() < later
    Host.available = 2 * 2**30 + now + later
    layers = full_layers()
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        train_full(layers, swapper, clip=False, tell=False)  # every layer stays streamed, as the probe's placement
        saved = swapper.training.state_dict()
    layers = full_layers()
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        swapper.training.load_state_dict(saved)  # a load makes the state now: nothing is left for the first update
        assert swapper.training.layout.deferred_state() == 0
