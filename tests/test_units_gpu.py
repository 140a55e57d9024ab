"""Swap units on CUDA at Flux block width, delays on every stream: bitwise equal to all-resident.

The double blocks (648 MiB of bf16 each) and single blocks (270 MiB) are split at 160 MB: a double
block becomes its modulations, projections and MLP Linears (the largest 144 MiB), a single block its
modulation and two Linears. 20 ms pass before every weight copy and compute sleeps 5 ms at every use,
with deterministic kernels and math attention. Losses, gradients, LoRA weights and eval outputs must equal
all-resident training, for every checkpoint mode, with activation offload too; a unit read before its
copy landed must differ.
"""

import pytest
from helpers import assert_bitwise_equal, checkpoint_for, loop_mode, make_layers, train
from test_ordering_gpu import (  # noqa: F401 (fixtures)
    BF16,
    FLUX_WIDTH,
    MS,
    ComputeDelay,
    delay_copies,
    deterministic,
    device,
    fresh,
)

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.copier import CudaCopier

pytestmark = pytest.mark.gpu
MODES = ["none", "nonreentrant", "reentrant", "unsloth"]
UNIT_MB = 160


@pytest.fixture(scope="module")
def template():
    return make_layers(BF16, FLUX_WIDTH)[0]


@pytest.fixture(scope="module")
def references(template):
    cache = {}

    def get(mode):
        if mode not in cache:
            layers, trainable = fresh(template)
            for layer in layers:
                layer.to(device())
            ckpt = checkpoint_for(mode)
            cache[mode] = train(
                layers, trainable, device(), loop_mode(mode), dtype=BF16, cfg=FLUX_WIDTH, checkpoint_fn=ckpt
            )
        return cache[mode]

    return get


def split_run(template, mode, monkeypatch, prefetch=2, offload=False, compute_ms=5.0):
    delay_copies(monkeypatch, 20.0)
    layers, trainable = fresh(template)
    config = SwapConfig(prefetch=prefetch, swap_unit_mb=UNIT_MB, offload_activations=offload)
    with LayerSwapper(layers, config, device=device(), log=None) as swapper:
        holders = sum(entry.holder for entry in swapper.entries)
        assert holders >= 4 and swapper.placement.slot_bytes <= UNIT_MB * 2**20
        if compute_ms:
            swapper.add_listener(ComputeDelay(compute_ms))
        ckpt = checkpoint_for(mode)
        if offload:
            swapper.activations.delay_cycles = int(10 * MS)
            swapper.activations.poison_restores = True
            ckpt = swapper.checkpoint_function(ckpt)
        record = train(layers, trainable, device(), loop_mode(mode), dtype=BF16, cfg=FLUX_WIDTH, checkpoint_fn=ckpt)
        if offload:
            assert swapper.total_stats(sync=True).activation_bytes > 0
    return record


@pytest.mark.parametrize("mode", MODES)
def test_units_with_delays_stay_bitwise_equal(template, references, monkeypatch, mode):
    assert_bitwise_equal(references(mode), split_run(template, mode, monkeypatch))


@pytest.mark.parametrize("mode", ["nonreentrant", "unsloth"])
def test_units_with_activation_offload_stay_bitwise_equal(template, references, monkeypatch, mode):
    assert_bitwise_equal(references(mode), split_run(template, mode, monkeypatch, prefetch=1, offload=True))


def test_a_unit_read_before_its_copy_landed_differs(template, references, monkeypatch):
    def no_wait(self, token):  # the canary: the copy is issued, but compute does not wait for it
        self._wait_issued(token)

    monkeypatch.setattr(CudaCopier, "_wait", no_wait)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(references("none"), split_run(template, "none", monkeypatch, prefetch=1, compute_ms=0))
