"""Layer-major accumulation on CUDA at Flux block width, with delays on every copy stream and the compute stream.

As tests/test_ordering_gpu.py: blocks of Flux-dev's width in bf16, deterministic kernels and math attention, a
``torch.cuda._sleep`` before every copy of every direction and at the start of every layer use. A step's micro-batches
run layer-major (each streamed layer fetched once a direction a step) must give the losses, gradients, LoRA weights and
eval outputs of the same micro-batches run one after another with every layer resident, bitwise; with activation
offload too (the last layer's N checkpointed calls stay, the others go home and come back in mirror order).
"""

import pytest
from helpers import assert_bitwise_equal
from layer_major_runs import WeightCopies, train_lora
from test_ordering_gpu import BF16, FLUX_WIDTH, ComputeDelay, delay_every_copy, deterministic, device, fresh, template

from utils.dgls import SwapConfig
from utils.dgls.memory.copier import CudaCopier

pytestmark = pytest.mark.gpu
__all__ = ["deterministic", "template"]  # the fixtures, shared with test_ordering_gpu.py


def delayed(copy_ms=20.0, compute_ms=5.0):
    def hook(swapper):
        delay_every_copy(swapper, copy_ms)
        if compute_ms:
            swapper.add_listener(ComputeDelay(compute_ms))

    return hook


def run(template, mode, accumulate, layer_major, swap=None, **kw):
    return train_lora(
        mode,
        accumulate,
        layer_major,
        swap=swap,
        layers=fresh(template),
        device=device(),
        dtype=BF16,
        cfg=FLUX_WIDTH,
        **kw,
    )


@pytest.fixture(scope="module")
def sequential(template):
    cache = {}

    def get(mode, accumulate):
        if (mode, accumulate) not in cache:
            first = run(template, mode, accumulate, layer_major=False)
            assert_bitwise_equal(first, run(template, mode, accumulate, layer_major=False))  # deterministic kernels
            cache[(mode, accumulate)] = first
        return cache[(mode, accumulate)]

    return get


CONFIGS = {
    "pf1": SwapConfig.of(prefetch=1),
    "pf2": SwapConfig.of(prefetch=2),
    "offload": SwapConfig.of(prefetch=2, offload_activations=True),
}


@pytest.mark.parametrize("accumulate", [2, 4])
@pytest.mark.parametrize("mode", ["none", "nonreentrant", "reentrant"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_major_under_delays_equals_resident_sequential_micro_batches(
    template, sequential, name, mode, accumulate
):
    if name == "offload" and mode == "none":
        pytest.skip("activation offload moves checkpointed inputs: nothing is checkpointed")
    got = run(
        template,
        mode,
        accumulate,
        layer_major=True,
        swap=CONFIGS[name],
        swapper_hook=delayed(),
        checkpoint_fn="swapper" if name == "offload" else None,
    )
    assert_bitwise_equal(sequential(mode, accumulate), got)


def test_canary_layer_major_without_the_compute_side_wait_differs(template, sequential, monkeypatch):
    def no_wait(self, token):
        self._wait_issued(token)  # the copy is issued, but compute does not wait for it

    monkeypatch.setattr(CudaCopier, "_wait", no_wait)
    got = run(template, "nonreentrant", 2, layer_major=True, swap=CONFIGS["pf1"], swapper_hook=delayed(compute_ms=0))
    with pytest.raises(AssertionError):
        assert_bitwise_equal(sequential("nonreentrant", 2), got)


@pytest.mark.parametrize("accumulate", [2, 4])
def test_layer_major_with_every_streamed_block_on_disk_under_delays_equals_resident_sequential(
    template, sequential, tmp_path, accumulate
):
    """The disk tier (a host RAM budget that holds only its staging ring) under layer-major: each block is read once
    a direction a step into a ring of 2 buffers, with every read delayed too (a host sleep before each)."""
    from test_ordering_gpu import disk_config

    seen = {}

    def hook(swapper):
        seen["disk"] = list(swapper.store.disk_layers)
        seen["streamed"] = list(swapper.streamed_layers)
        delayed()(swapper)

    got = run(
        template, "nonreentrant", accumulate, layer_major=True, swap=disk_config(template, tmp_path), swapper_hook=hook
    )
    assert seen["disk"] and seen["disk"] == seen["streamed"], "every streamed block is on disk"
    assert_bitwise_equal(sequential("nonreentrant", accumulate), got)


@pytest.mark.parametrize("accumulate", [2, 4])
def test_layer_major_swap_units_kept_over_micro_batches_under_delays_equal_resident_sequential(
    template, sequential, accumulate
):
    """Flux-width double blocks as 8 swap units in 8 slots (engine/row_keeping.py keeps a layer's units over its
    micro-batches): bitwise the resident sequential numbers under delays on every copy and use, and the second step
    copies what a one-micro-batch step copies."""

    def copies(n, hook):
        counter = WeightCopies()

        def both(swapper):
            swapper.add_listener(counter)
            hook(swapper)

        swap = SwapConfig.of(prefetch=7, swap_unit_mb=256)
        record = run(template, "nonreentrant", n, layer_major=True, swap=swap, swapper_hook=both)
        return counter.passes[1:], record

    one, _ = copies(1, lambda swapper: None)
    passes, got = copies(accumulate, delayed())
    assert passes == one and one[0][0] > 0
    assert_bitwise_equal(sequential("nonreentrant", accumulate), got)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
@pytest.mark.parametrize("accumulate", [2, 4])
def test_layer_major_swap_units_partly_kept_under_delays_equal_resident_sequential(
    template, sequential, mode, accumulate
):
    """Flux-width double blocks as 8 swap units in 4 slots (prefetch 3): each layer keeps 2 units over its micro-batches
    and fetches the others again in each (planning/row_copies.plan_row), the prefetch staying within the layer's units
    and demand fetches sparing the kept ones: bitwise the resident sequential numbers under delays on every copy and
    use, and every copy of the last step read by a use (no prefetch wasted on the next layer's units)."""
    counter = WeightCopies()

    def both(swapper):
        swapper.add_listener(counter)
        delayed()(swapper)

    swap = SwapConfig.of(prefetch=3, swap_unit_mb=256)
    got = run(template, mode, accumulate, layer_major=True, swap=swap, swapper_hook=both)
    assert_bitwise_equal(sequential(mode, accumulate), got)
    assert all(copies == used for copies, used in counter.passes[-1:])
