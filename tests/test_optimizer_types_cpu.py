"""diffusion-pipe's [optimizer] types with streamed layers (issue 35): each trains them or is refused by name.

A type that trains with its own class (:data:`utils.dgls.training.optimizer_types.PER_LAYER`) is built once per
streamed layer on the host masters; streaming must then give every param the update one optimizer of that class
over all params gives it, bitwise (the reference of :mod:`full_ft`: the same layers all resident). Libraries that
are not installed skip with the reason; a class injected by the test (diffusion-pipe's optimizers/ folder stood
in for by a temporary one) covers the per-layer path without any library.

``gradient_release = true`` means what it means in train.py: no clipping, each param its own optimizer (weight
decay on 1-D params too), updated as its gradient is ready; streamed layers are updated a layer at a time as its
last gradient lands, and train.py's per-param hooks on them find no gradient.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import FAKE, fake_config
from conftest import ROOT
from full_ft import SPEC, assert_same, full_layers, host_trained_names, params_of, train_dgls, train_reference
from helpers import SMALL, run_layers
from test_host_training_cpu import test_save_and_resume_equal_an_uninterrupted_run as resume_equals_uninterrupted

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.demo.data import SyntheticLatents
from utils.dgls.program import dp_config
from utils.dgls.program.validate import prepare
from utils.dgls.training import optimizer_types
from utils.dgls.training.device_update import Scratch
from utils.dgls.training.host_optimizer import HostOptimizerSpec
from utils.dgls.training.host_training import update_buffer_bytes
from utils.dgls.training.optimizer_types import OptimizerType

CPU = torch.device("cpu")
FULL = {"output_dir": "out", "model": {"type": "flux", "dtype": "bfloat16"}, "save_every_n_epochs": 1}

# Every type diffusion-pipe's get_optimizer handles by name, and pytorch_optimizer classes of each kind.
DIFFUSION_PIPE_TYPES = [
    "adamw",
    "AdamW8bit",
    "adamw_optimi",
    "stableadamw",
    "sgd",
    "AdamW8bitKahan",
    "offload",
    "automagic",
    "genericoptim",
    "Prodigy",
    "DAdaptAdam",
    "ScheduleFreeAdamW",
    "ScheduleFreeWrapper",
    "Lion",
    "Adan",
]


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("given", DIFFUSION_PIPE_TYPES)
def test_every_diffusion_pipe_type_trains_streamed_layers_or_is_refused_in_one_line(given):
    """A refusal names the type, and either the nearest type that trains (in quotes) with the reason, or the pip
    package its library needs."""
    try:
        spec = HostOptimizerSpec.from_table({"type": given, "lr": 1e-4})
    except DGLSUserError as exc:
        message = str(exc)
        assert "\n" not in message and repr(given) in message
        running = [f"'{t}'" for t in optimizer_types.RUNNING]
        assert "pip install " in message or any(t in message for t in running), message
        return
    assert spec.type in (*optimizer_types.RUNNING, "adamw", "sgd")
    assert optimizer_types.TYPES[spec.table_type or spec.type].runs != "refused"


def test_the_table_records_a_way_to_run_or_a_refusal_for_every_type():
    for name, entry in optimizer_types.TYPES.items():
        assert entry.runs in ("adamw", "sgd", "per_layer", "whole_step", "refused"), name
        if entry.runs == "refused":
            nearest = entry.refusal.split("'")[1]
            assert nearest in optimizer_types.RUNNING, (name, entry.refusal)
        if entry.runs in ("per_layer", "whole_step"):
            assert ":" in entry.source and entry.packages, name
    for own in ("adamw", "adamw8bit", "adamw_optimi", "stableadamw", "sgd", "adamw8bitkahan", "offload"):
        assert own in optimizer_types.TYPES
    assert {"automagic", "genericoptim"} <= set(optimizer_types.TYPES)


def test_refusals_name_the_nearest_type_and_say_why():
    cases = [
        ("ScheduleFreeWrapper", "use 'ScheduleFreeAdamW': ScheduleFreeWrapper takes the optimizer it wraps as its"),
        ("GenericOptim", "use 'adamw' \\(GenericOptim's default.*its Muon variants"),
        ("lion", "exact name: write type = 'Lion'"),
        ("Prodigyy", "DGLS has not read this optimizer's step.*\\(did you mean 'Prodigy'\\?\\)"),
        ("Adan", "DGLS has not read this optimizer's step"),
    ]
    for given, message in cases:
        with pytest.raises(DGLSUserError, match=message):
            HostOptimizerSpec.from_table({"type": given, "lr": 1e-4})


def test_a_missing_library_is_one_line_naming_its_pip_package(monkeypatch):
    monkeypatch.setattr(optimizer_types.importlib.util, "find_spec", lambda name: None)
    for given, package in (
        ("adamw8bit", "bitsandbytes"),
        ("stableadamw", "torch-optimi"),
        ("Lion", "pytorch-optimizer"),
    ):
        with pytest.raises(DGLSUserError, match=f"needs the .* package: pip install {package}$"):
            HostOptimizerSpec.from_table({"type": given, "lr": 1e-4})


# ----------------------------------------------------------------- the per-layer path, with a class of the test's own
FAKE_OPTIMIZER = '''
import torch


class FakeMomentum(torch.optim.Optimizer):
    """Per-param: a momentum buffer and decoupled weight decay (like diffusion-pipe's own classes, built from the
    table's keyword arguments); like Automagic, it skips params that do not require grad."""

    def __init__(self, params, lr=1e-3, beta=0.9, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not p.requires_grad:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(buf.sign() * buf.abs().sqrt(), alpha=-group["lr"])
'''


@pytest.fixture
def optimizers_folder():
    """Forget the ``optimizers`` package a test imported (a stand-in folder, or a checkout's on sys.path for the
    test only), so that no other test finds it."""
    yield
    for name in [m for m in sys.modules if m == "optimizers" or m.startswith("optimizers.")]:
        del sys.modules[name]


@pytest.fixture
def fake_type(tmp_path, monkeypatch, optimizers_folder):
    """'fakemomentum': a per-layer type whose class lives in an optimizers/ folder on sys.path, as diffusion-pipe's
    own do in a drop-in run."""
    (tmp_path / "optimizers").mkdir()
    (tmp_path / "optimizers" / "__init__.py").write_text("")
    (tmp_path / "optimizers" / "fake_momentum.py").write_text(textwrap.dedent(FAKE_OPTIMIZER))
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = OptimizerType("per_layer", "optimizers.fake_momentum:FakeMomentum", (("torch", "torch"),), "a test's")
    monkeypatch.setitem(optimizer_types.TYPES, "fakemomentum", entry)
    monkeypatch.setattr(optimizer_types, "PER_LAYER", (*optimizer_types.PER_LAYER, "fakemomentum"))
    monkeypatch.setattr(optimizer_types, "RUNNING", (*optimizer_types.RUNNING, "fakemomentum"))
    return HostOptimizerSpec.from_table({"type": "FakeMomentum", "lr": 1e-2, "beta": 0.8, "weight_decay": 0.1})


def streamed_equals_resident(spec: HostOptimizerSpec, accumulate: int = 2, dtype=torch.float32) -> None:
    layers = full_layers(dtype)
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=accumulate, prefetch=1)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        names = host_trained_names(layers, swapper)
        assert names, "no layer streams"
        record = train_dgls(layers, swapper, CPU, "nonreentrant", accumulate=accumulate, dtype=dtype)
    want = train_reference(
        full_layers(dtype), names, CPU, "nonreentrant", accumulate=accumulate, dtype=dtype, host_spec=spec
    )
    assert_same(record, want)
    first = {f"{i}.{k}": v.float() for i, layer in enumerate(full_layers(dtype)) for k, v in layer.state_dict().items()}
    assert not any(torch.equal(record.weights[n], first[n]) for n in names), "a streamed param was never updated"


def test_a_per_layer_class_from_the_checkout_trains_streamed_layers_as_one_optimizer_over_all_params(fake_type):
    assert fake_type.per_layer and fake_type.options == (("beta", 0.8), ("lr", 1e-2), ("weight_decay", 0.1))
    assert "optimizers.fake_momentum.FakeMomentum on the CPU, one per layer" in fake_type.kernel
    optimizer = fake_type.build([torch.zeros(4, 4), torch.zeros(4)])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]  # diffusion-pipe's 1-D split
    streamed_equals_resident(fake_type)
    streamed_equals_resident(fake_type, accumulate=1, dtype=torch.bfloat16)


def test_a_per_layer_type_on_the_device_or_split_is_one_line(fake_type):
    for implementation in ("device", "split", "torch_fused", "deepspeed"):
        with pytest.raises(DGLSUserError, match=f"--host_adam {implementation} picks DGLS's AdamW or SGD kernel"):
            dataclasses.replace(fake_type, implementation=implementation)


def test_a_per_layer_class_that_refuses_the_table_is_one_line(fake_type):
    spec = HostOptimizerSpec.from_table({"type": "fakemomentum", "lr": 1e-2, "momentum": 0.9})
    with pytest.raises(DGLSUserError, match="'fakemomentum': FakeMomentum refuses the table: .*momentum"):
        spec.build([torch.zeros(2)])


def test_a_class_that_fails_a_step_is_one_line_before_anything_is_built(fake_type, monkeypatch):
    klass = optimizer_types.load_class("fakemomentum", optimizer_types.TYPES["fakemomentum"])

    def step(self, closure=None):
        raise KeyError("percentile_clipping")

    monkeypatch.setattr(klass, "step", step)
    message = (
        "FakeMomentum fails a step on the CPU on a test tensor \\(KeyError\\('percentile_clipping'\\)\\): check the "
        "\\[optimizer\\] values it was given \\(beta = 0.8, lr = 0.01, weight_decay = 0.1\\), or install"
    )
    with pytest.raises(DGLSUserError, match=message):
        fake_type.probe()
    fake_type.probe.__func__(HostOptimizerSpec())  # DGLS's own kernels need no probe


def test_a_class_no_library_version_runs_on_the_cpu_says_why_and_the_nearest_type(fake_type, monkeypatch):
    """A type whose entry names why no version of its library steps it on the CPU (adamw8bitkahan: bitsandbytes
    0.50 dropped a setting its step reads, earlier versions have no CPU step) says so, not 'install a version'."""
    entry = dataclasses.replace(
        optimizer_types.TYPES["fakemomentum"], library_note="no version runs it", fallback="type = 'sgd'"
    )
    monkeypatch.setitem(optimizer_types.TYPES, "fakemomentum", entry)
    klass = optimizer_types.load_class("fakemomentum", entry)
    monkeypatch.setattr(klass, "step", lambda self, closure=None: 1 / 0)
    with pytest.raises(DGLSUserError) as caught:
        fake_type.probe()
    tail = "test tensor (ZeroDivisionError('division by zero')): no version runs it: use type = 'sgd'"
    assert str(caught.value).endswith(tail), "no values to check where no version runs the class"
    kahan = optimizer_types.TYPES["adamw8bitkahan"]
    assert "percentile_clipping" in kahan.library_note and kahan.fallback.startswith(
        "type = 'adamw8bit' with weight_decay = 0"
    )


def test_adamw8bitkahan_on_fp32_weights_steps_as_adamw8bit_without_weight_decay(monkeypatch, optimizers_folder):
    """The refusal's nearest type, checked on diffusion-pipe's class (its optimizers/adamw_8bit.py): its update runs
    on a zeroed buffer then added to the weight, so its weight decay decays that buffer. Run with the two settings
    bitsandbytes 0.50 dropped restored at their old defaults (no percentile clipping, blockwise), it equals
    AdamW8bit with weight_decay = 0 up to fp32 rounding, and not AdamW8bit with its weight decay."""
    checkout = os.environ.get(dp_config.ENV_CHECKOUT)
    if not checkout:
        pytest.skip(f"set {dp_config.ENV_CHECKOUT} to a diffusion-pipe checkout to run its AdamW8bitKahan")
    if not installed("bitsandbytes"):
        pytest.skip("bitsandbytes is not installed")
    import bitsandbytes

    monkeypatch.syspath_prepend(checkout)
    kahan = importlib.import_module("optimizers.adamw_8bit").AdamW8bitKahan

    class Restored(kahan):
        def get_config(self, gindex, pindex, group):
            return {"percentile_clipping": 100, "block_wise": True, **super().get_config(gindex, pindex, group)}

    start = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, klass, decay in (
        ("kahan", Restored, 0.01),
        ("8bit, no decay", bitsandbytes.optim.AdamW8bit, 0.0),
        ("8bit", bitsandbytes.optim.AdamW8bit, 0.01),
    ):
        p = torch.nn.Parameter(start.clone())
        optimizer = klass([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=decay)
        grads = torch.Generator().manual_seed(1)
        for _ in range(20):
            p.grad = torch.randn(p.shape, generator=grads)
            optimizer.step()
        runs[name] = p.detach()
    moved = (runs["kahan"] - start).abs().max().item()
    assert (runs["kahan"] - runs["8bit, no decay"]).abs().max().item() < 1e-4 * moved
    assert (runs["kahan"] - runs["8bit"]).abs().max().item() > 1e-2 * moved


def test_a_checkout_class_outside_a_drop_in_run_is_one_line(monkeypatch):
    monkeypatch.setattr(optimizer_types.importlib.util, "find_spec", lambda name: object())
    entry = optimizer_types.TYPES["adamw8bitkahan"]
    monkeypatch.setattr(optimizer_types.importlib, "import_module", _no_module("optimizers"))
    with pytest.raises(DGLSUserError, match="'adamw8bitkahan' is diffusion-pipe's own .*optimizers/adamw_8bit.py"):
        optimizer_types.load_class("adamw8bitkahan", entry)


def _no_module(name):
    def import_module(module):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    return import_module


def test_resuming_another_optimizers_state_is_one_line(fake_type):
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=fake_type, accumulation_steps=1)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=1)
        saved = swapper.training.state_dict()
    layers = full_layers()
    with LayerSwapper(
        layers, SwapConfig.of(host_optimizer=SPEC, accumulation_steps=1), device=CPU, log=None
    ) as swapper:
        assert swapper.training.state_problem(saved) is not None
    layers = full_layers()
    with LayerSwapper(
        layers, SwapConfig.of(host_optimizer=SPEC, accumulation_steps=1), device=CPU, log=None
    ) as swapper:
        adamw_state = swapper.training.state_dict()
    with LayerSwapper(full_layers(), cfg, device=CPU, log=None) as swapper:
        assert "another optimizer's state" in swapper.training.state_problem(adamw_state)
        assert swapper.training.state_problem(saved) is None


# ----------------------------------------------------------------- the real libraries, where installed
LIBRARY_TYPES = [
    ({"type": "AdamW8bit", "lr": 1e-2, "min_8bit_size": 256}, "bitsandbytes"),  # 8-bit blockwise on params >= 256
    ({"type": "stableadamw", "lr": 1e-2, "weight_decay": 0.01}, "optimi"),
    ({"type": "Lion", "lr": 1e-3, "weight_decay": 0.01}, "pytorch_optimizer"),
    ({"type": "ADOPT", "lr": 1e-2}, "pytorch_optimizer"),
    ({"type": "AdEMAMix", "lr": 1e-2}, "pytorch_optimizer"),
    ({"type": "CAME", "lr": 1e-2}, "pytorch_optimizer"),
]


@pytest.mark.parametrize("table, module", LIBRARY_TYPES, ids=[t["type"] for t, _ in LIBRARY_TYPES])
def test_a_library_type_trains_streamed_layers_bitwise_as_one_optimizer_over_all_params(table, module):
    if not installed(module):
        pytest.skip(f"{module} is not installed")
    spec = HostOptimizerSpec.from_table(table)
    try:
        spec.probe()
    except DGLSUserError as exc:  # bitsandbytes before 0.50 has no 8-bit optimizer on the CPU
        pytest.skip(f"the installed library does not run this class on the CPU: {exc}")
    streamed_equals_resident(spec)


def _bitsandbytes_8bit() -> None:
    """Skip unless bitsandbytes runs its 8-bit AdamW on the CPU (0.50 and later)."""
    if not installed("bitsandbytes"):
        pytest.skip("bitsandbytes is not installed")
    try:
        HostOptimizerSpec.from_table({"type": "AdamW8bit", "lr": 1e-2}).probe()
    except DGLSUserError as exc:
        pytest.skip(f"the installed bitsandbytes does not run AdamW8bit on the CPU: {exc}")


def device_by_default_bitwise_as_its_class(spec: HostOptimizerSpec, class_name: str, steps: int) -> list:
    """An own class stepped on the device by default: its start-up words, ``steps`` steps through the device updater
    on the CPU (each layer's optimizer returned, its state as the steps left it), then bitwise equal to one class
    over every param with fp32 sums (two micro-batches) and with bf16 landings (one), on the device and on the CPU."""
    assert spec.implementation == "device" and spec.on_device
    assert f"{class_name} on the training device" in spec.kernel
    layers = full_layers()
    with LayerSwapper(layers, SwapConfig.of(host_optimizer=spec, accumulation_steps=1), device=CPU, log=None) as sw:
        assert type(sw.training.updates).__name__ == "DeviceSide"
        train_dgls(layers, sw, CPU, "nonreentrant", steps=steps, accumulate=1)
        optimizers = [layer.optimizer for layer in sw.training.layers.values()]
    streamed_equals_resident(spec)
    streamed_equals_resident(spec, accumulate=1, dtype=torch.bfloat16)
    host = dataclasses.replace(spec, implementation="torch")
    assert f"{class_name} on the CPU" in host.kernel
    streamed_equals_resident(host, accumulate=1, dtype=torch.bfloat16)
    return optimizers


def test_adamw8bit_steps_on_the_device_by_default_with_bitsandbytes_own_kernel_bitwise_as_its_class():
    """``AdamW8bit``'s default is the device (its class's CPU step ran at 15 ns a param): the device updater moves
    each param's own state (uint8 codes and their scales, or fp32 moments below ``min_8bit_size``) through its
    scratch slots and makes the class's own calls. On the CPU those are the calls of a host step: bitwise equal to
    one class over every param, with fp32 sums (two micro-batches) and with bf16 landings in a flat layout (one)."""
    _bitsandbytes_8bit()
    spec = HostOptimizerSpec.from_table({"type": "AdamW8bit", "lr": 1e-2, "min_8bit_size": 256})
    optimizers = device_by_default_bitwise_as_its_class(spec, "bitsandbytes.optim.AdamW8bit", steps=1)
    kinds = {str(state["state1"].dtype) for o in optimizers for state in o.state.values()}
    assert kinds == {"torch.uint8", "torch.float32"}, "both of bitsandbytes' state layouts must be stepped"


def test_lion_steps_on_the_device_by_default_with_its_class_s_ops_bitwise_as_its_class():
    """``Lion``'s default is the device (its class's CPU step held the training thread 93% of a Flux step): the device
    updater moves each param's ``exp_avg`` through its scratch and runs the ops of the class's step with the param's
    group's settings (diffusion-pipe's 1-D params without weight decay). On the CPU those are the class's own numbers:
    bitwise equal to one class over every param with fp32 sums, bf16 landings, and from the CPU path; the group's
    step count advances as the class's does. Settings its ops leave out are one line."""
    if not installed("pytorch_optimizer"):
        pytest.skip("pytorch_optimizer is not installed")
    spec = HostOptimizerSpec.from_table({"type": "Lion", "lr": 1e-3, "weight_decay": 0.01})
    assert "(the ops of the class's step on its own state" in spec.kernel
    optimizers = device_by_default_bitwise_as_its_class(spec, "pytorch_optimizer.Lion", steps=3)
    assert all(set(o.state[p]) == {"exp_avg"} for o in optimizers for p in o.state)
    assert {g["step"] for o in optimizers for g in o.param_groups} == {3}
    assert {g["weight_decay"] for o in optimizers for g in o.param_groups} == {0.0, 0.01}  # the 1-D split
    from pytorch_optimizer import Lion

    from utils.dgls.training.optimizer_kernels import LionKernel

    class OldLion:  # pytorch_optimizer before 4: no batched step, one per-param step of other ops (mul_, add_)
        param_groups = [{"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.0}]

    assert hasattr(Lion, "_step_foreach")
    with pytest.raises(DGLSUserError, match=r"ops of pytorch_optimizer 4's Lion, .* pip install -U 'pytorch-optimizer"):
        LionKernel().check(OldLion())
    with pytest.raises(DGLSUserError, match="Lion's device step takes lr as a number, not a tensor"):
        LionKernel().check(Lion([torch.zeros(2)], lr=torch.tensor(1e-3)))
    for extra, named in (({"cautious": True}, "cautious"), ({"weight_decouple": False}, "weight_decouple = false")):
        refused = HostOptimizerSpec.from_table({"type": "Lion", "lr": 1e-3, "weight_decay": 0.01, **extra})
        line = f"^Lion's device step runs its plain update, not {named}: drop it from \\[optimizer\\], or step Lion"
        with pytest.raises(DGLSUserError, match=line):
            refused.probe()  # start-up
        with pytest.raises(DGLSUserError, match=line):  # a layer's first update (the library API)
            fresh = full_layers()
            with LayerSwapper(fresh, SwapConfig.of(host_optimizer=refused), device=CPU, log=None) as sw:
                train_dgls(fresh, sw, CPU, "nonreentrant", steps=1, accumulate=1)


def test_adamw8bit_state_is_made_at_each_streamed_layers_first_update_after_a_budgets_plan():
    """A flat layout (bf16, device updates) lays out masters and landings, but ``AdamW8bit``'s state is its class's
    own: nothing of it is made at start-up, so under a VRAM budget step 1 (the probe, every layer streamed) holds
    none, the start-up RAM check leaves it out and says so, and each layer the plan keeps streamed makes it at its
    first update, within what the check at the plan counted for those layers."""
    from test_planner_full import middle_budget, train_full

    _bitsandbytes_8bit()
    spec = HostOptimizerSpec.from_table({"type": "AdamW8bit", "lr": 1e-2, "min_8bit_size": 256})
    layers = full_layers(torch.bfloat16)
    with LayerSwapper(full_layers(torch.bfloat16), SwapConfig.of(host_optimizer=spec), device=CPU, log=None) as sw:
        buffers = update_buffer_bytes(sw.training.layout, spec)  # every layer streamed: the most they take
    budget = middle_budget(layers, spec) + buffers / 2**30  # the device update's buffers on top
    config = SwapConfig.of(host_optimizer=spec, clip_grads=False, vram_budget=budget)
    lines: list[str] = []
    with LayerSwapper(layers, config, device=CPU, log=lines.append) as swapper:
        training = swapper.training
        assert all(layer.flat is not None for layer in training.layers.values()), "bf16 device updates: flat"
        assert not any(layer.optimizer.state for layer in training.layers.values()), "no state before an update"
        assert training.layout.deferred_state() == training.layout.parts()["optimizer"] > 0
        assert any("is made at their first update and counted once the plan is fixed" in line for line in lines)
        everything = len(training.layers)
        train_full(layers, swapper, steps=1, clip=False, dtype=torch.bfloat16)
        assert 0 < len(training.layers) < everything, "the plan kept some layers resident"
        assert all(len(layer.optimizer.state) == len(layer.params) for layer in training.layers.values())
        held = sum(
            t.nbytes
            for layer in training.layers.values()
            for state in layer.optimizer.state.values()
            for key, t in state.items()
            if isinstance(t, torch.Tensor) and not key.startswith("qmap")  # the code maps: one pair, shared
        )
        assert 0 < held <= training.layout.deferred_state(), "what the check counted covers what was made"


def test_adamw8bit_on_the_device_saves_and_resumes_as_an_uninterrupted_run():
    _bitsandbytes_8bit()
    spec = HostOptimizerSpec.from_table({"type": "AdamW8bit", "lr": 1e-2, "min_8bit_size": 256})
    resume_equals_uninterrupted(spec, torch.bfloat16, 1)


def test_adamw8bit_settings_the_device_kernel_does_not_move_are_one_line():
    _bitsandbytes_8bit()
    spec = HostOptimizerSpec.from_table({"type": "AdamW8bit", "lr": 1e-2})
    optimizer = spec.build([torch.zeros(64, 64)])
    optimizer.is_paged = True  # paged state needs CUDA unified memory to build at all, so the CPU sets the flag alone
    with pytest.raises(DGLSUserError, match="with is_paged \\(or max_unorm\\) .* --host_adam torch"):
        spec.device_kernel().check(optimizer)
    for implementation in ("split", "torch_fused"):
        with pytest.raises(DGLSUserError, match="steps its own class on the CPU \\(torch\\) or the device"):
            dataclasses.replace(spec, implementation=implementation)
    tiny = HostOptimizerSpec.from_table({"type": "AdamW8bit", "lr": 1e-2, "min_8bit_size": 2})
    with pytest.raises(DGLSUserError, match="min_8bit_size must be 4 or more for the device update"):
        tiny.probe()
    dataclasses.replace(tiny, implementation="torch").probe()  # its class runs it on the CPU


def test_adamw8bit_state_a_host_ram_budget_would_put_on_disk_is_one_line_naming_adamw(tmp_path):
    """AdamW8bit steps on the device by default, and its state stays in RAM wherever it steps: where host_ram_budget
    would spill it, the line names the type whose state can go to disk, not a --host_adam that is refused for it."""
    _bitsandbytes_8bit()
    spec = HostOptimizerSpec.from_table({"type": "AdamW8bit", "lr": 1e-2, "min_8bit_size": 256})
    for each in (spec, dataclasses.replace(spec, implementation="torch")):
        cfg = SwapConfig.of(host_optimizer=each, host_ram_budget=0.001, disk_dir=str(tmp_path))
        with pytest.raises(DGLSUserError, match="type 'adamw8bit' keeps state DGLS does not lay out on disk .*'adamw'"):
            LayerSwapper(full_layers(torch.bfloat16), cfg, device=CPU, log=None)
    assert list(tmp_path.iterdir()) == []


def test_a_kernel_launch_is_checked_before_anything_is_built():
    """bitsandbytes' Triton kernels (kernel_launch 'triton', the library API's and bench_full's dgls-device+triton)
    are AdamW8bit's on the device alone (not Lion's, whose device kernel has one launch), and run on CUDA only: each
    mistake is one line before anything is built."""
    with pytest.raises(DGLSUserError, match="kernel_launch must be one of cuda, triton, got 'cudaa'"):
        HostOptimizerSpec(type="adamw8bit", kernel_launch="cudaa")
    with pytest.raises(DGLSUserError, match="picks the kernel of an own class stepped on the device .*'adamw' with"):
        HostOptimizerSpec(kernel_launch="triton")
    if installed("pytorch_optimizer"):
        lion = HostOptimizerSpec.from_table({"type": "Lion", "lr": 1e-3})
        assert lion.implementation == "device"
        with pytest.raises(DGLSUserError, match="not of 'Lion' with 'device'"):
            dataclasses.replace(lion, kernel_launch="triton")
    spec = HostOptimizerSpec(type="adamw8bit", kernel_launch="triton")
    with pytest.raises(DGLSUserError, match="not of 'adamw8bit' with 'torch'"):
        dataclasses.replace(spec, implementation="torch")
    kernel = spec.device_kernel()
    assert kernel.launch == "triton" and HostOptimizerSpec(type="adamw8bit").device_kernel().launch == "cuda"
    with pytest.raises(DGLSUserError, match="run on CUDA only: launch 'cuda'"):
        kernel.check_device(CPU)


def test_adamw8bit_triton_launch_on_the_cpu_is_one_line_when_the_updater_is_built(tmp_path):
    _bitsandbytes_8bit()
    spec = HostOptimizerSpec.from_table({"type": "AdamW8bit", "lr": 1e-2, "min_8bit_size": 256})
    cfg = SwapConfig.of(host_optimizer=dataclasses.replace(spec, kernel_launch="triton"))
    with pytest.raises(DGLSUserError, match="Triton kernels \\(launch 'triton'\\) run on CUDA only"):
        LayerSwapper(full_layers(torch.bfloat16), cfg, device=CPU, log=None)


def test_a_state_tensor_that_would_overrun_its_scratch_slot_is_an_assertion_not_a_write():
    """The device updater's slots hold what each kernel promises (bytes an element); a tensor past a slot's end is a
    DGLS bug, stopped before anything is written."""
    scratch = Scratch(10, CPU, (4, 1))
    assert [r.numel() for r in (scratch._region(0), scratch._region(1))] == [40, 12]
    assert scratch.slot(1, 8, torch.zeros(1)).dtype == torch.float32  # bytes 8..11 of 12
    with pytest.raises(AssertionError, match="overruns slot 1"):
        scratch.slot(1, 12, torch.zeros(1))
    with pytest.raises(AssertionError, match="overruns slot 0"):
        scratch.slot(0, 2, torch.zeros(1, dtype=torch.uint8))  # not 4-byte aligned


def test_a_per_layer_type_saves_and_resumes_as_an_uninterrupted_run(fake_type):
    resume_equals_uninterrupted(fake_type, torch.bfloat16, 1)


@pytest.mark.parametrize("table, module", LIBRARY_TYPES[:3], ids=[t["type"] for t, _ in LIBRARY_TYPES[:3]])
def test_a_library_type_saves_and_resumes_as_an_uninterrupted_run(table, module):
    """The per-layer state dicts (8-bit moments and their absmax included) load into new layers' optimizers."""
    if not installed(module):
        pytest.skip(f"{module} is not installed")
    spec = HostOptimizerSpec.from_table(table)
    try:
        spec.probe()
    except DGLSUserError as exc:
        pytest.skip(f"the installed library does not run this class on the CPU: {exc}")
    resume_equals_uninterrupted(spec, torch.float32, 2)


# ----------------------------------------------------------------- schedule-free, torchao's offload
SCHEDULE_FREE = [
    {"type": "ScheduleFreeAdamW", "lr": 1e-2, "weight_decay": 0.01, "warmup_steps": 2},
    {"type": "ScheduleFreeRAdam", "lr": 1e-2, "silent_sgd_phase": False},
    {"type": "ScheduleFreeSGD", "lr": 1e-2, "momentum": 0.9},
]


@pytest.mark.parametrize("table", SCHEDULE_FREE, ids=[t["type"] for t in SCHEDULE_FREE])
def test_schedule_free_trains_streamed_layers_per_layer_and_saves_what_train_py_saves(table):
    """Schedule-free steps are per param, and its group values (step, lr_max, weight_sum) follow from the step
    count and the lr, alike in every layer's optimizer. train.py never calls optimizer.eval() (nor does DeepSpeed),
    so it saves the training weights; DGLS's saved weights (the state dicts, which read the masters) are those of
    one optimizer over every param, without eval(), bitwise."""
    if not installed("pytorch_optimizer"):
        pytest.skip("pytorch_optimizer is not installed")
    spec = HostOptimizerSpec.from_table(table)
    assert spec.per_layer and "train.py never calls optimizer.eval()" in spec.kernel
    streamed_equals_resident(spec)
    streamed_equals_resident(spec, accumulate=1, dtype=torch.bfloat16)


def test_schedule_free_saves_and_resumes_as_an_uninterrupted_run():
    if not installed("pytorch_optimizer"):
        pytest.skip("pytorch_optimizer is not installed")
    resume_equals_uninterrupted(HostOptimizerSpec.from_table(SCHEDULE_FREE[0]), torch.float32, 2)


def test_offload_runs_torchaos_inner_adamw_on_the_host_and_says_so(monkeypatch):
    """train.py builds torchao's CPUOffloadOptimizer(groups, torch.optim.AdamW, fused=True, **table): an AdamW per
    param on the CPU. Streamed layers run DGLS's AdamW (the same arithmetic) with AdamW's defaults; torchao's own
    keys place train.py's work for the resident params and are checked; start-up says how clipping differs."""
    if not installed("torchao"):
        with pytest.raises(DGLSUserError, match="'offload' needs the torchao package: pip install torchao$"):
            HostOptimizerSpec.from_table({"type": "offload", "lr": 1e-4})
        found = importlib.util.find_spec
        monkeypatch.setattr(
            optimizer_types.importlib.util, "find_spec", lambda name: object() if name == "torchao" else found(name)
        )
    spec = HostOptimizerSpec.from_table({"type": "offload", "lr": 1e-4, "offload_gradients": True, "minimal_size": 64})
    assert (spec.type, spec.table_type, spec.betas, spec.weight_decay, spec.eps) == (
        "adamw", "offload", (0.9, 0.999), 1e-2, 1e-8,
    )  # fmt: skip
    assert "torchao's CPUOffloadOptimizer runs torch.optim.AdamW(fused=True) on the CPU, one per param" in spec.kernel
    assert "DGLS clips streamed layers' gradients as gradient_clipping says" in spec.kernel
    for key, value, message in (
        ("offload_gradients", "yes", "offload_gradients must be true or false, got 'yes'"),
        ("minimal_size", -1, "minimal_size must be a whole number >= 0, got -1"),
        ("amsgrad", True, "amsgrad cannot be passed to the host optimizer"),
    ):
        with pytest.raises(DGLSUserError, match=message):
            HostOptimizerSpec.from_table({"type": "offload", "lr": 1e-4, key: value})


# ----------------------------------------------------------------- gradient_release
def full(optimizer: dict, **top) -> dict:
    return {**FULL, "optimizer": optimizer, **top}


def test_gradient_release_is_accepted_and_said_at_start_up():
    config = full({"type": "adamw", "lr": 1e-5, "gradient_release": True}, gradient_clipping=1.0)
    dp_config.check_train_config(config, "x.toml", swapping=True)
    spec = dp_config.host_optimizer_spec(config, "x.toml")
    assert spec.gradient_release and spec.type == "adamw"
    assert dp_config.host_clipping(config, "x.toml", 1) == 0.0  # as train.py hands DeepSpeed
    assert dp_config.host_clipping(full({"type": "adamw"}, gradient_clipping=0.5), "x.toml", 4) == 0.5
    notes = [n for n in dp_config.startup_notes(config) if "gradient_release" in n]
    assert len(notes) == 1 and "\n" not in notes[0]
    assert "no clipping" in notes[0] and "a layer at a time as its last gradient lands" in notes[0]
    groups = spec.build([torch.zeros(3, 3), torch.zeros(3)]).param_groups
    assert len(groups) == 1 and groups[0]["weight_decay"] == spec.weight_decay  # 1-D params decay too


def test_gradient_release_refusals_are_one_line():
    config = full({"type": "adamw", "gradient_release": True}, gradient_accumulation_steps=4)
    with pytest.raises(DGLSUserError, match="gradient_release with 4 micro-batches a step .*set gradient_accumulation"):
        dp_config.host_clipping(config, "x.toml", 4)
    with pytest.raises(DGLSUserError, match="gradient_release must be true or false, got 'yes'"):
        dp_config.host_optimizer_spec(full({"type": "adamw", "gradient_release": "yes"}), "x.toml")


def checkout_with_models(tmp_path, train_reads_group_lr: bool = True):
    """A checkout whose train.py maps types to model modules as diffusion-pipe's does, its gradient release reading
    each group's lr or not: flux's module has models/base.py's groups, sdxl's its own (with [optimizer] lr),
    chroma's builds on flux's pipeline class, mine (and mine2) on the sdxl module, wan is a module of a package."""
    (tmp_path / "models" / "wan").mkdir(parents=True)
    branches = "".join(
        f"    elif model_type == '{kind}':\n        from models import {kind}\n" for kind in ("flux", "sdxl", "chroma")
    )
    branches += "    elif model_type == 'mine' or model_type == 'mine2':\n        from models import mine\n"
    branches += "    elif model_type == 'wan':\n        from models.wan import wan\n"
    read = "param_kwargs['lr'] = pg['lr']" if train_reads_group_lr else "pass"
    (tmp_path / "train.py").write_text(f"if False:\n    pass\n{branches}\nfor p in pg['params']:\n    {read}\n")
    groups = "def get_param_groups(self, parameters):\n    return [{'params': parameters, 'lr': self.lr}]\n"
    models = {
        "flux.py": "from models.base import BasePipeline, make_contiguous\n",
        "sdxl.py": groups,
        "chroma.py": "from models.flux import FluxPipeline\n",
        "mine.py": "from models import sdxl\n",
        "wan/wan.py": "from models.base import BasePipeline\n",
    }
    for name, text in models.items():
        (tmp_path / "models" / name).write_text(text)
    return tmp_path


def test_gradient_release_is_refused_in_one_line_where_train_py_would_find_no_group_lr(tmp_path):
    """train.py's gradient release reads each param group's lr (diffusion-pipe 8f83dbf); for a type whose groups
    are models/base.py's it fails with KeyError: 'lr' once the model has loaded, plain or through DGLS, and for one
    whose own groups take [optimizer] lr when it is not set: one line before anything starts. Types with their own
    groups (or built on such a module) and an lr, types train.py does not map, any type where train.py does not read
    the key, and runs without gradient_release pass."""
    from utils.dgls.program import dp_model

    checkout = checkout_with_models(tmp_path / "reads")

    def config(kind, release=True, lr=True):
        table = {"type": "adamw", "gradient_release": release, **({"lr": 1e-5} if lr else {})}
        return {"model": {"type": kind}, "optimizer": table}

    for kind, module in (("flux", "flux.py"), ("chroma", "chroma.py"), ("wan", "wan/wan.py")):
        with pytest.raises(
            DGLSUserError, match=rf"^x.toml: \[optimizer\] gradient_release = true fails .* '{kind}'"
        ) as err:
            dp_model.check_gradient_release(config(kind), "x.toml", checkout)
        message = str(err.value)
        assert "\n" not in message and f"models/{module}'s groups" in message and "KeyError: 'lr'" in message
        assert "drop gradient_release" in message
    for kind in ("sdxl", "mine", "mine2"):
        dp_model.check_gradient_release(config(kind), "x.toml", checkout)
        with pytest.raises(DGLSUserError, match=r"without \[optimizer\] lr: .* set lr$"):
            dp_model.check_gradient_release(config(kind, lr=False), "x.toml", checkout)
    dp_model.check_gradient_release(config("unmapped"), "x.toml", checkout)
    dp_model.check_gradient_release(config("flux", release=False), "x.toml", checkout)
    dp_model.check_gradient_release(config("flux"), "x.toml", checkout_with_models(tmp_path / "fixed", False))


def test_gradient_release_updates_streamed_layers_as_train_py_updates_every_param():
    """train.py's gradient release on all-resident fp32 layers: an optimizer per param (the table's values, weight
    decay on 1-D params too, foreach off), stepped in its post-accumulate-grad hook. With DGLS, streamed layers'
    params are updated on the host a layer at a time, and train.py's hooks, registered after DGLS's, find their
    gradient taken: the weights after each step are the same, bitwise."""
    spec = dataclasses.replace(SPEC, implementation="torch", gradient_release=True)

    def per_param_optimizers(params):
        kwargs = {"lr": spec.lr, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}
        optimizers = {p: torch.optim.AdamW([p], **kwargs, foreach=False) for p in params}
        stepped = []

        def hook(p):
            stepped.append(p.grad is not None)
            optimizers[p].step()
            optimizers[p].zero_grad()

        for p in params:
            p.register_post_accumulate_grad_hook(hook)
        return stepped

    def train(layers, after_step):
        data = SyntheticLatents(SMALL, samples=8, image_tokens=12, text_tokens=5, seed=3)
        batches = data.batches(2, torch.float32, CPU)
        for _ in range(3):
            inputs, target = next(batches)
            F.mse_loss(run_layers(layers, inputs, "nonreentrant"), target).backward()
            after_step()
        return {f"{i}.{k}": v.clone() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}

    resident = full_layers()
    stepped = per_param_optimizers(params_of(resident))
    want = train(resident, lambda: None)
    assert all(stepped)

    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=1, clip_grads=False, prefetch=1)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        stepped = per_param_optimizers(params_of(layers))  # train.py's hooks come after DGLS's
        owned = [swapper.training.owns(p) for p in params_of(layers)]
        got = train(layers, swapper.training.step)  # state dicts read the masters: the true weights
    assert any(owned) and not all(owned)
    assert stepped.count(True) == 3 * owned.count(False)  # only the resident params had a gradient in train.py's hook
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def drop_in_argv(tmp_path, monkeypatch, tables: str) -> list[str]:
    """dgls_train.py's arguments for the stand-in checkout with these training TOML tables, one layer streamed, in
    an environment without a launcher's variables."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    config = fake_config(tmp_path, tables=tables)
    return ["--config", str(config), "--diffusion_pipe", str(FAKE), "--blocks_to_swap", "1"]


def test_a_drop_in_full_fine_tune_with_gradient_release_starts_without_clipping_and_says_so(tmp_path, monkeypatch):
    """Through dgls_train.py's checks (the stand-in checkout): gradient_release is accepted, the host training is
    set up without clipping (train.py hands DeepSpeed gradient_clipping 0 with it), and one start-up line says what
    DGLS does with it; more micro-batches a step than one is one line."""
    tables = (
        '[model]\ntype = "flux"\ndtype = "float32"\n[optimizer]\ntype = "adamw"\nlr = 1e-4\ngradient_release = true\n'
    )
    argv = drop_in_argv(tmp_path, monkeypatch, tables)
    run = prepare(argv, ROOT)
    training = run.swap.training
    assert training.host_optimizer.gradient_release and not training.clip_grads
    assert sum("gradient_release" in note for note in run.notes) == 1
    with pytest.raises(DGLSUserError, match="gradient_release with 2 micro-batches a step"):
        prepare([*argv, "--lazy_lora_steps", "2"], ROOT)
    argv[1] = str(fake_config(tmp_path / "gas", top="gradient_accumulation_steps = 3", tables=tables))
    with pytest.raises(DGLSUserError, match="gradient_release with 3 micro-batches a step"):
        prepare(argv, ROOT)


def test_the_demo_refuses_diffusion_pipes_own_classes_and_train_py_keys_in_one_line(fake_type):
    """The fixture's class stands in for one of diffusion-pipe's optimizers/ (importable here, as in a drop-in
    run): the demo has no checkout, so it is refused there by name, before anything is built."""
    from utils.dgls.demo.settings import demo_settings

    assert optimizer_types.TYPES["fakemomentum"].from_checkout
    with pytest.raises(
        DGLSUserError, match="'fakemomentum' is diffusion-pipe's own .* the demo runs without a checkout"
    ):
        demo_settings({"optimizer": {"type": "fakemomentum", "lr": 1e-3}}, "d.toml")
    assert demo_settings({"optimizer": {"type": "sgd", "lr": 1e-3}}, "d.toml").optimizer.type == "sgd"
    with pytest.raises(DGLSUserError, match="beta2_half_life is train.py's"):
        HostOptimizerSpec.from_table({"type": "fakemomentum", "betas": [0.9, 0.9], "beta2_half_life": 10})


@pytest.mark.parametrize(
    "table, modules",
    [
        ({"type": "AdamW8bitKahan", "lr": 1e-2, "min_8bit_size": 256}, ("bitsandbytes",)),
        ({"type": "automagic", "lr": 1e-4, "weight_decay": 0.01}, ("optimum.quanto",)),
    ],
    ids=["adamw8bitkahan", "automagic"],
)
def test_diffusion_pipes_own_classes_train_streamed_layers_bitwise_as_one_optimizer_over_all_params(
    table, modules, monkeypatch, optimizers_folder
):
    """From the checkout $DGLS_DIFFUSION_PIPE names (its optimizers/ on sys.path, as in a drop-in run)."""
    checkout = os.environ.get(dp_config.ENV_CHECKOUT)
    if not checkout:
        pytest.skip(f"set {dp_config.ENV_CHECKOUT} to a diffusion-pipe checkout to run its optimizers")
    for module in modules:
        if not installed(module):
            pytest.skip(f"{module} is not installed")
        importlib.import_module(module)  # before the checkout's optimizers/ (a namespace package) is importable
    monkeypatch.syspath_prepend(checkout)
    spec = HostOptimizerSpec.from_table(table)
    try:
        spec.probe()
    except DGLSUserError as exc:  # e.g. AdamW8bitKahan reads a setting bitsandbytes 0.50 no longer has
        pytest.skip(f"this checkout's class does not run with the installed library: {exc}")
    streamed_equals_resident(spec)


def test_a_drop_in_whose_optimizer_class_fails_a_step_is_one_line_before_train_py_starts(
    fake_type, tmp_path, monkeypatch
):
    tables = '[model]\ntype = "flux"\ndtype = "float32"\n[optimizer]\ntype = "fakemomentum"\nlr = 1e-4\n'
    argv = drop_in_argv(tmp_path, monkeypatch, tables)
    assert prepare(argv, ROOT).swap.training.host_optimizer.type == "fakemomentum"
    klass = optimizer_types.load_class("fakemomentum", optimizer_types.TYPES["fakemomentum"])
    monkeypatch.setattr(klass, "step", lambda self, closure=None: 1 / 0)
    with pytest.raises(DGLSUserError, match="FakeMomentum fails a step on the CPU on a test tensor"):
        prepare(argv, ROOT)


def test_values_train_py_logs_of_its_own_instance_are_copied_there_for_the_streamed_params(fake_type, monkeypatch):
    """train.py logs Automagic's avg_lr from its own instance for every param (torch.stack over them), and that
    instance never steps the streamed params: DGLS copies each one's value there, the group's lr before the layer
    optimizer has one, its value after; a DeepSpeed wrapper (not an optimizer) is left alone."""
    entry = dataclasses.replace(optimizer_types.TYPES["fakemomentum"], logged_state=("avg_lr",))
    monkeypatch.setitem(optimizer_types.TYPES, "fakemomentum", entry)
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=fake_type, accumulation_steps=1, prefetch=1)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        training = swapper.training
        trainer = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.5)
        training.mirror_logged_state(trainer, CPU)
        streamed = [(tp, layer) for layer in training.layers.values() for tp, _ in layer.in_groups]
        start = torch.tensor(1e-2)  # the group's lr
        assert streamed and all(torch.equal(trainer.state[tp.param]["avg_lr"], start) for tp, _ in streamed)
        train_dgls(layers, swapper, CPU, "nonreentrant", accumulate=1)
        for k, (tp, layer) in enumerate(streamed):  # as Automagic keeps it: a 0-dim tensor per param
            layer.optimizer.state[tp.master]["avg_lr"] = torch.tensor(k / 1000)
        training.mirror_logged_state(trainer, CPU)
        assert [trainer.state[tp.param]["avg_lr"].item() for tp, _ in streamed] == [
            torch.tensor(k / 1000).item() for k in range(len(streamed))
        ]
        training.mirror_logged_state(object(), CPU)  # a wrapper: no state to write into, no error
