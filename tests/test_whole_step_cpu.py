"""Optimizers whose step sums over every param (issue 35): one instance over all of a stage's trained params, stepped
once after the backward (utils/dgls/training/whole_step.py).

Prodigy and D-Adaptation estimate their step size from sums over every param of the instance; train.py builds one
instance per pipeline stage. DGLS builds one too: streamed layers' fp32 masters and host copies of the resident
params the trainer hands over, stepped when every gradient is home and clipped. The reference is the same class
over the same params, in the same order, in one process without DGLS (:func:`full_ft.train_reference` with
``whole_step``): equal bitwise, with clipping or without, one micro-batch a step or two, bf16 compute, and across a
save and resume. pytorch_optimizer is optional: its tests skip without it.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from full_ft import (
    MAX_NORM,
    _batches,
    _forward_backward,
    _weights,
    assert_same,
    full_layers,
    host_trained_names,
    params_of,
    train_dgls,
    train_reference,
)
from test_planner_full import middle_budget, resident_layers

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.program import dp_config
from utils.dgls.training import optimizer_types
from utils.dgls.training.host_optimizer import HostOptimizerSpec
from utils.dgls.training.whole_step import WholeStep

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_optimizer") is None, reason="pytorch_optimizer is not installed"
)


def prodigy(**table) -> HostOptimizerSpec:
    return HostOptimizerSpec.from_table({"type": "Prodigy", "lr": 1.0, "weight_decay": 0.01, **table})


def whole_run(spec, accumulate=2, dtype=torch.float32, clip=True, steps=3, threading=False):
    """DGLS with the trainer handing its params over (as DGLS's engine hooks do), and the reference."""
    layers = full_layers(dtype)
    cfg = SwapConfig.of(
        host_optimizer=spec, accumulation_steps=accumulate, prefetch=1, clip_grads=clip, threading=threading
    )
    max_norm = {} if clip else {"max_norm": None}
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        names = host_trained_names(layers, swapper)
        assert names and len(names) < len(params_of(layers)), "some layers stream, some stay resident"
        assert isinstance(swapper.training.updates, WholeStep)
        record = train_dgls(
            layers, swapper, CPU, "nonreentrant", accumulate=accumulate, dtype=dtype, steps=steps, adopt=True,
            **max_norm,
        )  # fmt: skip
        assert swapper.training.whole.resident == len(params_of(layers)) - len(names)
    want = train_reference(
        full_layers(dtype), names, CPU, "nonreentrant", accumulate=accumulate, dtype=dtype, steps=steps,
        host_spec=spec, whole_step=True, **max_norm,
    )  # fmt: skip
    return record, want


@pytest.mark.parametrize(
    "accumulate, dtype, clip, threading",
    [
        (2, torch.float32, True, False),
        (1, torch.float32, True, True),
        (1, torch.bfloat16, True, False),
        (2, torch.float32, False, False),
        (1, torch.float32, False, True),
    ],
    ids=["two-micro-batches", "one-micro-batch-threads", "bf16", "no-clipping", "no-clipping-one-threads"],
)
def test_whole_step_prodigy_equals_one_prodigy_over_the_same_params(accumulate, dtype, clip, threading):
    """Without clipping each layer's update is collected as its last gradient lands; the step still waits for
    all of them. With worker threads the job runs on the job worker, as on CUDA."""
    record, want = whole_run(prodigy(), accumulate, dtype, clip, threading=threading)
    assert_same(record, want)
    if dtype == torch.float32:  # every weight moved: the instance stepped masters and resident copies alike
        first = {f"{i}.{k}": v for i, layer in enumerate(full_layers()) for k, v in layer.state_dict().items()}
        assert not any(torch.equal(record.weights[k], v) for k, v in first.items())


def test_prodigy_in_two_instances_steps_otherwise_than_in_one():
    """Why it is a whole step: Prodigy over two halves of the params (one instance per layer would be many) estimates
    a step size in each, and trains to other weights than one instance over all of them, as train.py builds."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(8, 8, generator=generator), 100 * torch.randn(8, 8, generator=generator)]

    def train(instances: int) -> list[torch.Tensor]:
        """Five steps towards zero (each gradient the param itself), the halves far apart in scale."""
        params = [t.clone() for t in start]
        optimizers = [prodigy().build(params)] if instances == 1 else [prodigy().build([p]) for p in params]
        for _ in range(5):
            for p in params:
                p.grad = p.detach().clone()
            for optimizer in optimizers:
                optimizer.step()
        return params

    one, two = train(1), train(2)
    assert not any(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("name", [n for n in optimizer_types.WHOLE_STEP if n != "Prodigy"])
def test_every_d_adaptation_type_steps_as_one_instance_over_the_same_params(name):
    spec = HostOptimizerSpec.from_table({"type": name, "lr": 1.0})
    record, want = whole_run(spec, steps=2)
    assert_same(record, want)


@pytest.mark.parametrize("name", optimizer_types.WHOLE_STEP)
def test_the_trainers_own_instance_without_gradients_steps_and_changes_nothing(name):
    """train.py builds its own instance of the class over every param of the stage; the whole step takes the
    resident params' gradients before it steps, and streamed params never have one there."""
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    before = [p.detach().clone() for p in params]
    optimizer = HostOptimizerSpec.from_table({"type": name, "lr": 1.0}).build(params)
    optimizer.step()
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_save_and_resume_equal_an_uninterrupted_run():
    """Two steps, a checkpoint (the true weights and the instance's state: step size d, moments, p0), a new model and
    swapper handed the params again, then the third step: the weights of three in a row."""
    spec = prodigy()
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=1, prefetch=1)
    kw = {"accumulate": 1, "adopt": True}
    layers = full_layers()
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        whole = train_dgls(layers, swapper, CPU, "nonreentrant", steps=3, **kw)
    saved = {}
    layers = full_layers()
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:

        def save(step, trainer):
            saved["model"] = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
            saved["host"] = swapper.training.state_dict()

        part1 = train_dgls(layers, swapper, CPU, "nonreentrant", steps=2, on_step=save, **kw)
    assert set(saved["host"]) == {"whole_step", "layers", "resident"}
    layers = full_layers()
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        for layer, state in zip(layers, saved["model"]):
            layer.load_state_dict(state)
        swapper.training.adopt(params_of(layers))
        assert swapper.training.state_problem(saved["host"]) is None
        swapper.training.load_state_dict(saved["host"])
        part2 = train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, start_step=2, **kw)
    assert torch.equal(torch.stack(part1.losses + part2.losses), torch.stack(whole.losses))
    for k, v in whole.weights.items():
        assert torch.equal(part2.weights[k], v), k


def test_resuming_another_kind_of_state_is_one_line():
    per_layer = HostOptimizerSpec.from_table({"type": "Lion", "lr": 1e-4})
    saved = {}
    for name, spec in (("per_layer", per_layer), ("whole", prodigy())):
        layers = full_layers()
        with LayerSwapper(layers, SwapConfig.of(host_optimizer=spec), device=CPU, log=None) as swapper:
            swapper.training.adopt(params_of(layers))
            saved[name] = swapper.training.state_dict()
    layers = full_layers()
    with LayerSwapper(layers, SwapConfig.of(host_optimizer=prodigy()), device=CPU, log=None) as swapper:
        swapper.training.adopt(params_of(layers))
        assert "holds per-layer optimizer states" in swapper.training.state_problem(saved["per_layer"])
        moved = {**saved["whole"], "resident": 0}
        assert "resume with the placement it was saved with" in swapper.training.state_problem(moved)
    layers = full_layers()
    with LayerSwapper(layers, SwapConfig.of(host_optimizer=per_layer), device=CPU, log=None) as swapper:
        assert "one optimizer's state over every param" in swapper.training.state_problem(saved["whole"])


def test_start_up_says_it_steps_once_after_the_backward_and_gradient_release_is_refused():
    """train.py's gradient_release builds one Prodigy per param, each with its own step size: not what one instance
    over every param gives, so refused in one line naming the config."""
    config = {"output_dir": "o", "model": {"type": "flux"}, "optimizer": {"type": "Prodigy", "gradient_release": True}}
    with pytest.raises(DGLSUserError, match="^x.toml: \\[optimizer\\] gradient_release builds one Prodigy per param"):
        dp_config.host_optimizer_spec(config, "x.toml")
    spec = prodigy()
    assert spec.whole_step and not spec.per_layer and spec.implementation == "torch"
    assert "pytorch_optimizer.Prodigy on the CPU, one over every trained param" in spec.kernel
    assert "each update waits for the backward's end" in spec.kernel
    with pytest.raises(DGLSUserError, match="gradient_release builds one Prodigy per param in train.py"):
        dataclasses.replace(spec, gradient_release=True)
    with pytest.raises(DGLSUserError, match="steps its own class on the CPU, one over every param"):
        dataclasses.replace(spec, implementation="split")


def engine_hooks_loop(layers, swapper, spec, steps=3):
    """A step as DGLS's engine hooks run it (utils/dgls/trainers/engine_hooks.py): ``adopt`` as ``train_batch``
    begins, then after the backward ``before_step`` (the VRAM planner's plan), ``adopt`` again, clipping,
    ``take_resident_grads``, the trainer's own instance of the class over every param (train.py's), the host step.
    Returns the weights, and per step how many params the trainer's instance still found a gradient on."""
    training, params = swapper.training, params_of(layers)
    trainer = spec.trainer_optimizer(params)
    batches = _batches(CPU, torch.float32)
    left = []
    for _ in range(steps):
        training.adopt(params)
        inputs, target = next(batches)
        _forward_backward(layers, inputs, target, "nonreentrant")
        training.before_step()
        training.adopt(params)
        training.clip_grad_norm_(params, MAX_NORM)
        training.take_resident_grads()
        left.append(sum(p.grad is not None for p in params))
        trainer.step()
        trainer.zero_grad()
        training.step()
    return _weights(layers), left


def test_under_a_vram_budget_the_instance_steps_the_layers_the_plan_made_resident():
    """The engine hooks hand the params over as step 1 begins, before the plan is fixed (every layer streams in the
    probe). The plan then makes some layers resident: the one instance steps their params through host copies, as
    with the same placement given explicitly (it was built over their masters, and train.py's own instance stepped
    them with a step size of its own); the checkpoint counts them, so the printed flags resume it."""
    spec = prodigy()
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=spec, vram_budget=middle_budget(layers), prefetch=1, accumulation_steps=1)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        weights, left = engine_hooks_loop(layers, swapper, spec)
        resident, prefetch = resident_layers(swapper), swapper.placement.prefetch
        copies = swapper.training.whole.resident
    assert 0 < len(resident) < len(layers)
    assert left == [0, 0, 0], "the trainer's instance finds no gradient: the whole step took every resident one"
    explicit = SwapConfig.of(host_optimizer=spec, gpu_layers=resident, prefetch=prefetch, accumulation_steps=1)
    layers = full_layers()
    with LayerSwapper(layers, explicit, device=CPU, log=None) as swapper:
        want, _ = engine_hooks_loop(layers, swapper, spec)
        assert copies == swapper.training.whole.resident
    assert want.keys() == weights.keys() and all(torch.equal(weights[k], want[k]) for k in want)


def test_a_stage_that_streams_no_layer_still_trains_every_param():
    """No layer streams (blocks_to_swap 0, a pipeline stage whose layers are all resident, or a plan that keeps every
    layer): the resident params' gradients must still reach an optimizer step (they were taken off the params, and
    no job ran without a streamed layer), as train.py's one instance over them."""
    spec = prodigy()
    layers = full_layers()
    before = _weights(layers)
    with LayerSwapper(layers, SwapConfig.of(host_optimizer=spec, blocks_to_swap=0), device=CPU, log=None) as swapper:
        assert not swapper.training.layers
        weights, _ = engine_hooks_loop(layers, swapper, spec, steps=2)
    assert not any(torch.equal(weights[k], before[k]) for k in weights if weights[k].numel() > 1)
    layers = full_layers()
    params = params_of(layers)
    trainer = spec.trainer_optimizer(params)
    batches = _batches(CPU, torch.float32)
    for _ in range(2):
        inputs, target = next(batches)
        _forward_backward(layers, inputs, target, "nonreentrant")
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        trainer.step()
        trainer.zero_grad()
    want = _weights(layers)
    assert max((weights[k] - want[k]).abs().max().item() for k in want) <= 1e-6
