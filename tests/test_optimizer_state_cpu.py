"""Host RAM of an own class's optimizer state (issue 35, "Host RAM"): measured on the class, not guessed per type.

The training layout's optimizer figure (the RAM check's and the start-up line's) must be what the optimizers built
on the host masters hold after a step (the sum of their state tensors' bytes), for every installed type that steps
its own class, to the measuring rule of :mod:`utils.dgls.training.optimizer_state`: exact for small shapes and for
elementwise and factored state, at most ``ROUNDING`` bytes a param high for blockwise-quantized (8-bit) state.
Types whose library is missing are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from full_ft import SMALL, full_layers, train_dgls

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.memory.layout import TrainingLayout, measure
from utils.dgls.training import optimizer_types
from utils.dgls.training.host_optimizer import HostOptimizerSpec
from utils.dgls.training.optimizer_state import ROUNDING, held_bytes, measure_rate, measure_shape

CPU = torch.device("cpu")
OWN = [name for name, entry in optimizer_types.TYPES.items() if entry.runs in ("per_layer", "whole_step")]
# shapes past the exact region: a 2-D one, a ragged 1-D one (not a whole number of 8-bit blocks), a 3-D one
LARGE = [(300, 700), (70001,), (5, 40, 400)]


def spec_of(name: str) -> HostOptimizerSpec:
    """``name``'s spec with an lr (some classes have no default), or a skip naming what is missing."""
    entry = optimizer_types.TYPES[name]
    if entry.from_checkout:
        pytest.skip(f"{name} is diffusion-pipe's own class (its checkout's optimizers/ folder)")
    for module, package in entry.packages:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{package} is not installed")
    spec = HostOptimizerSpec.from_table({"type": name, "lr": 1e-3})
    spec.probe()
    return spec


@pytest.mark.parametrize("name", OWN)
def test_the_rate_of_large_shapes_is_what_the_class_keeps_for_them(name):
    """The fitted forms (1-D, 2-D, more dims) against the class stepped on each shape."""
    spec = spec_of(name)
    rate = spec.state_rate(torch.float32)
    for shape in LARGE:
        counted, held = rate.bytes(shape), measure_shape(spec.build, shape, torch.float32)
        assert 0 <= counted - held <= ROUNDING, (shape, counted, held)


@pytest.mark.parametrize("name", OWN)
def test_the_ram_figure_is_what_the_host_optimizers_hold_after_a_step(name):
    """The training layout's optimizer bytes against the optimizers :class:`HostTraining` built on the masters
    (one per layer, or one over every param), after they stepped."""
    spec = spec_of(name)
    layers = full_layers(cfg=SMALL)
    config = SwapConfig.of(host_optimizer=spec, accumulation_steps=1, prefetch=1)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        training = swapper.training
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=1)
        counted = training.layout.parts()["optimizer"]
        if training.whole is not None:
            held = held_bytes(training.whole.optimizer)
        else:
            held = sum(held_bytes(layer.optimizer) for layer in training.layers.values())
        params = sum(len(layer.params) for layer in training.layers.values())
    assert held > 0 or name == "sgd"
    assert 0 <= counted - held <= ROUNDING * params, (counted, held)


def test_8bit_moments_are_counted_at_about_2_bytes_a_param():
    """bitsandbytes' AdamW8bit: two uint8 moments and an fp32 scale per 256 elements each (2.03 bytes a param),
    fp32 moments below its 4096-element threshold."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    spec = spec_of("adamw8bit")
    rate = spec.state_rate(torch.float32)
    assert rate.bytes((3072, 3072)) / (3072 * 3072) == pytest.approx(2.03125, abs=1e-3)
    assert rate.bytes((64, 32)) == 8 * 64 * 32


def test_factored_state_is_counted_by_rows_and_columns():
    """A class that keeps a row and a column vector (CAME's factored second moment): not a rate per element."""

    class RowsAndColumns(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if p.dim() >= 2:
                        state.setdefault("row", torch.zeros(p.shape[:-1]))
                        state.setdefault("col", torch.zeros(p.shape[:-2] + p.shape[-1:]))
                    else:
                        state.setdefault("sq", torch.zeros_like(p))

    rate = measure_rate(lambda params: RowsAndColumns(params), torch.float32)
    assert rate.factored and rate.matrix[1] == 0
    for shape in [(1000, 3000), (70001,), (4, 300, 200)]:  # the last is measured on itself (factored, 3-D)
        assert rate.bytes(shape) == measure_shape(RowsAndColumns, shape, torch.float32), shape


def test_a_class_the_forms_do_not_fit_is_measured_on_each_shape():
    """State that grows with the square root of a param's size fits neither form: each shape is measured."""

    class Root(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                self.state[p].setdefault("root", torch.zeros(math.isqrt(p.numel())))

    rate = measure_rate(lambda params: Root(params), torch.float32)
    assert rate.matrix is None and rate.vector is None
    assert rate.bytes((500, 500)) == 4 * 500 and rate.bytes((90000,)) == 4 * 300


def test_the_layout_counts_state_by_its_rate_where_given_else_by_its_keys():
    """An own class's spec places no fp32 state tensors (its class makes its own) and counts its measured rate."""
    layouts = dict(enumerate(measure(full_layers(), host_trained=True)))
    keys = TrainingLayout(layouts, state_keys=("a", "b"), sums=False, device_updates=False)
    numel = sum(layer.numel for layer in keys.layers.values())
    assert keys.parts()["optimizer"] == 8 * numel
    rate = measure_rate(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), torch.float32)
    measured = TrainingLayout(layouts, state_keys=(), sums=False, device_updates=False, state_bytes=rate.bytes)
    assert measured.parts()["optimizer"] == 4 * numel
    assert spec_of("Lion").state_keys == ()
