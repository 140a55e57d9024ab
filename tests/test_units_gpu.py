"""Swap units on CUDA at Flux block width, delays on every stream: bitwise equal to all-resident.

The double blocks (648 MiB of bf16 each) and single blocks (270 MiB) are split at 160 MB: a double
block becomes its modulations, projections and MLP Linears (the largest 144 MiB), a single block its
modulation and two Linears. 20 ms pass before every weight copy and compute sleeps 5 ms at every use,
with deterministic kernels and math attention. Losses, gradients, LoRA weights and eval outputs must equal
all-resident training, for every checkpoint mode, with activation offload too, and with checkpoint_units
(each unit, or each piece of a whole block, under a checkpoint of its own), which must also lower the peak
where the units' activations dominate; a unit read before its copy landed must differ. Flux blocks whose forward
autocasts to bf16 (diffusers' own where diffusers is installed) train bitwise with keep_piece_outputs too.
"""

import copy
import importlib.util
from functools import partial

import flux_autocast
import pytest
import torch
from helpers import assert_bitwise_equal, checkpoint_for, loop_mode, make_layers, train
from test_ordering_gpu import (  # noqa: F401 (fixtures)
    BF16,
    FLUX_WIDTH,
    MS,
    ComputeDelay,
    delay_every_copy,
    deterministic,
    device,
    fresh,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.activations.activation_offload import ActivationOffloader
from utils.dgls.activations.unit_checkpoints import UnitCheckpoints
from utils.dgls.memory.copier import CudaCopier

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


def split_run(
    template,
    mode,
    monkeypatch,
    prefetch=2,
    offload=False,
    compute_ms=5.0,
    checkpoint_units=False,
    unit_mb=UNIT_MB,
    keep_outputs=False,
):
    layers, trainable = fresh(template)
    config = SwapConfig.of(
        prefetch=prefetch,
        swap_unit_mb=unit_mb,
        offload_activations=offload,
        checkpoint_units=checkpoint_units,
        keep_piece_outputs=keep_outputs,
    )
    with LayerSwapper(layers, config, device=device(), log=None) as swapper:
        holders = sum(entry.holder for entry in swapper.entries)
        if unit_mb:
            assert holders >= 4 and swapper.placement.slot_bytes <= UNIT_MB * 2**20
        if compute_ms:
            swapper.add_listener(ComputeDelay(compute_ms))
        delay_every_copy(swapper)  # 20 ms before weight copies, 10 ms before activations out and in
        ckpt = checkpoint_for(mode)
        if offload:
            ckpt = swapper.checkpoint_function(ckpt)
        record = train(layers, trainable, device(), loop_mode(mode), dtype=BF16, cfg=FLUX_WIDTH, checkpoint_fn=ckpt)
        if offload:
            assert swapper.total_stats(sync=True).activation_bytes > 0
        if keep_outputs:
            assert swapper.feature(UnitCheckpoints).replayed > 0
    return record


@pytest.mark.parametrize("mode", MODES)
def test_units_with_delays_stay_bitwise_equal(template, references, monkeypatch, mode):
    assert_bitwise_equal(references(mode), split_run(template, mode, monkeypatch))


@pytest.mark.parametrize("mode", ["nonreentrant", "unsloth"])
def test_units_with_activation_offload_stay_bitwise_equal(template, references, monkeypatch, mode):
    assert_bitwise_equal(references(mode), split_run(template, mode, monkeypatch, prefetch=1, offload=True))


@pytest.mark.parametrize("unit_mb", [UNIT_MB, 0])
@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_units_with_delays_stay_bitwise_equal(template, references, monkeypatch, mode, unit_mb):
    """Swap units, or the pieces of whole blocks, each under its own checkpoint (with activation offload where
    the layer checkpoint is non-reentrant or 'unsloth')."""
    offload = mode in ("nonreentrant", "unsloth")
    got = split_run(template, mode, monkeypatch, offload=offload, checkpoint_units=True, unit_mb=unit_mb)
    assert_bitwise_equal(references(mode), got)


@pytest.mark.parametrize(
    "mode, unit_mb, prefetch",
    [(mode, unit_mb, 1) for mode in MODES[1:] for unit_mb in (UNIT_MB, 0)] + [("nonreentrant", UNIT_MB, 2)],
)
def test_kept_piece_outputs_with_delays_stay_bitwise_equal(template, references, monkeypatch, mode, unit_mb, prefetch):
    """keep_piece_outputs: the pieces' outputs go home with their block's inputs (10 ms behind every copy, restores
    poisoned until they land) and the blocks' recomputes take them instead of running the pieces."""
    got = split_run(
        template, mode, monkeypatch, prefetch, True, checkpoint_units=True, unit_mb=unit_mb, keep_outputs=True
    )
    assert_bitwise_equal(references(mode), got)


def test_a_recompute_that_does_not_wait_for_a_kept_output_differs(template, references, monkeypatch):
    """Only the kept outputs' restores go unwaited (the canary); compute runs without delays, so the recompute
    returns a kept output whose storage still holds the NaN bytes of a restore 10 ms from landing."""
    wait = ActivationOffloader.wait
    monkeypatch.setattr(ActivationOffloader, "wait", lambda self, o: None if o.output else wait(self, o))
    got = split_run(
        template, "nonreentrant", monkeypatch, 1, True, 0.0, checkpoint_units=True, unit_mb=0, keep_outputs=True
    )
    with pytest.raises(AssertionError):
        assert_bitwise_equal(references("nonreentrant"), got)


FLUX_AUTOCAST = flux_autocast.FluxShape(image_side=32, text_tokens=128)  # Flux's width: 24 heads of 128, LoRA r16


@pytest.fixture(scope="module")
def autocast_flux():
    """Flux's double and single blocks at full width, each forward under bf16 autocast (diffusers' own if it is
    installed), and all-resident training per checkpoint mode."""
    diffusers = importlib.util.find_spec("diffusers") is not None
    template = flux_autocast.build_layers(FLUX_AUTOCAST, diffusers)
    cache = {}

    def reference(reentrant):
        if reentrant not in cache:
            layers, trainable = flux_autocast.fresh(template, device())
            cache[reentrant] = flux_autocast.train(layers, trainable, FLUX_AUTOCAST, device(), reentrant)
        return cache[reentrant]

    return template, diffusers, reference


@pytest.mark.parametrize("reentrant, unit_mb", [(False, 128), (False, 0), (True, 0)])
def test_kept_piece_outputs_of_flux_blocks_under_autocast_stay_bitwise_equal(autocast_flux, reentrant, unit_mb):
    """keep_piece_outputs with 128 MB swap units or whole blocks, prefetch 1, every copy 20 ms late and compute
    5 ms late at every use, kept outputs' restores 10 ms behind and poisoned until they land: three AdamW steps
    (lr 1e-3) give all-resident training's losses and LoRA weights bitwise. (Before the pieces' reruns took
    their float32 inputs as autocast takes them, the step-2 loss and the LoRA weights differed.)"""
    template, diffusers, reference = autocast_flux
    layers, trainable = flux_autocast.fresh(template, None)
    config = SwapConfig.of(
        prefetch=1, swap_unit_mb=unit_mb, offload_activations=True, checkpoint_units=True, keep_piece_outputs=True
    )
    with LayerSwapper(layers, config, device=device(), log=None) as swapper:
        assert any(entry.holder for entry in swapper.entries) == bool(unit_mb)
        if diffusers:
            assert "FluxAttention" in {type(p.module).__name__ for p in swapper.pieces}
        swapper.add_listener(ComputeDelay(5.0))
        delay_every_copy(swapper)  # 20 ms before weight copies, 10 ms before the others; restores poisoned
        ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=reentrant))
        got = flux_autocast.train(layers, trainable, FLUX_AUTOCAST, device(), reentrant, checkpoint_fn=ckpt)
        assert swapper.feature(UnitCheckpoints).replayed == 3 * len(swapper.pieces)
    flux_autocast.assert_same(reference(reentrant), got)


class MLPBlock(nn.Module):
    """Two MLPs, the second called with a keyword argument: at 8,192 tokens each MLP keeps 256 MiB for backward,
    far more than its 32 MiB of weights."""

    def __init__(self, width: int = 1024, hidden: int = 8192) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.second = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x):
        x = x + self.first(x)
        return x + self.second(input=x)


@pytest.mark.parametrize("unit_mb", [20, 0])
def test_checkpointed_units_lower_the_peak_of_a_layers_backward(unit_mb):
    """Six streamed blocks under non-reentrant checkpoints: with their MLPs checkpointed as well (as swap units of
    16 MiB Linears, or inside whole blocks), a block's backward holds one MLP's activations, not two, and the
    input gradient is bitwise the same. (On the H100: 624 -> 496 MiB with units; whole blocks dropped by more
    than 128 MiB.)"""
    torch.manual_seed(0)
    template = [MLPBlock().to(BF16) for _ in range(6)]
    x = torch.randn(8192, 1024, dtype=BF16, device=device())
    results = {}
    for checkpoint_units in (False, True):
        layers = [copy.deepcopy(layer).requires_grad_(False) for layer in template]
        config = SwapConfig.of(prefetch=1, swap_unit_mb=unit_mb, checkpoint_units=checkpoint_units)
        with LayerSwapper(layers, config, device=device(), log=None) as swapper:
            assert len(swapper.pieces) == (12 if checkpoint_units else 0)
            h = inputs = x.clone().requires_grad_()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False)
            h.float().square().mean().backward()
            torch.cuda.synchronize()
            results[checkpoint_units] = (torch.cuda.max_memory_allocated() - before, inputs.grad.cpu())
    (plain_peak, plain_grad), (pieces_peak, pieces_grad) = results[False], results[True]
    assert torch.equal(plain_grad, pieces_grad)
    assert pieces_peak < plain_peak - 96 * 2**20, f"{plain_peak / 2**20:.0f} MiB -> {pieces_peak / 2**20:.0f} MiB"


def test_a_unit_read_before_its_copy_landed_differs(template, references, monkeypatch):
    def no_wait(self, token):  # the canary: the copy is issued, but compute does not wait for it
        self._wait_issued(token)

    monkeypatch.setattr(CudaCopier, "_wait", no_wait)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(references("none"), split_run(template, "none", monkeypatch, prefetch=1, compute_ms=0))
