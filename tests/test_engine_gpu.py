"""The swap engine on CUDA (bf16): equality with the unswapped model, memory bounds, clean removal."""

import pytest
import torch
from helpers import SMALL, make_layers, train

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.demo.model import DemoModelConfig

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def device():
    return torch.device("cuda", torch.cuda.current_device())


def flat(record):
    return [*record.losses, *(g for step in record.grads for g in step), *record.params, *record.eval_outputs]


def max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(flat(a), flat(b)))


def run(mode, swap_config=None, cfg=SMALL):
    layers, trainable = make_layers(BF16, cfg)
    if swap_config is None:
        for layer in layers:
            layer.to(device())
        return train(layers, trainable, device(), mode, dtype=BF16)
    with LayerSwapper(layers, swap_config, device=device(), log=None):
        return train(layers, trainable, device(), mode, dtype=BF16)


@pytest.mark.parametrize("mode", ["none", "nonreentrant", "reentrant"])
@pytest.mark.parametrize(
    "swap_config",
    [
        SwapConfig.of(prefetch=0),
        SwapConfig.of(prefetch=1, threading=True),
        SwapConfig.of(prefetch=3),
        SwapConfig.of(prefetch=2, batch_move=True, cuda_streams=2),
        SwapConfig.of(prefetch=2, event_sync=False),
        SwapConfig.of(prefetch=2, device_sync_mode="layer"),  # the host waits for every copy
        SwapConfig.of(prefetch=2, device_sync_mode="step"),  # and for the device at every pass end
        SwapConfig.of(prefetch=2, pinned_ram_budget_gb=0.0),  # pageable masters, staged
        SwapConfig.of(prefetch=2, selective_packing=1000.0),  # param-by-param copies
    ],
    ids=["pf0", "pf1-thread", "pf3", "batch-2streams", "host-sync", "layer-sync", "step-sync", "pageable", "unpacked"],
)
def test_bf16_equal_to_unswapped(mode, swap_config):
    ref1, ref2 = run(mode), run(mode)
    spread = max_diff(ref1, ref2)
    got = run(mode, swap_config)
    diff = max_diff(ref1, got)
    if spread == 0:
        assert diff == 0, f"kernels are deterministic here, yet swapped differs by {diff}"
    else:
        assert diff <= 2 * spread, f"swapped differs by {diff}, two unswapped runs by {spread}"
    assert all(torch.isfinite(t).all() for t in flat(got))


@pytest.mark.parametrize(
    "settings, host_waits",
    [
        ({}, False),
        ({"event_sync": False}, True),
        ({"device_sync_mode": "layer"}, True),
        ({"device_sync_mode": "step"}, False),
    ],
)
def test_the_weight_copier_waits_on_the_host_as_the_transfer_policy_says(settings, host_waits):
    """The builder hands the CUDA copier ``TransferPolicy.ordered_by_events`` (event_sync and device_sync_mode
    together), which no CPU test reaches: the CPU copier always lands a copy when it is acquired."""
    layers, _ = make_layers(BF16)
    with LayerSwapper(layers, SwapConfig.of(prefetch=1, **settings), device=device(), log=None) as swapper:
        assert swapper.copier.ordered_by_events is not host_waits


def test_peak_vram_within_prediction_and_no_growth():
    cfg = DemoModelConfig(hidden=512, heads=8, double_blocks=6, single_blocks=6, text_dim=64, latent_channels=16)
    dev = device()
    layers, trainable = make_layers(BF16, cfg)
    for layer in layers:
        layer.to(dev)
    weights = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    train(layers, trainable, dev, "nonreentrant", steps=2, dtype=BF16, cfg=cfg)
    activations = torch.cuda.max_memory_allocated(dev) - weights
    del layers, trainable
    torch.cuda.empty_cache()

    layers, trainable = make_layers(BF16, cfg)
    base = torch.cuda.memory_allocated(dev)
    swapper = LayerSwapper(layers, SwapConfig.of(blocks_to_swap=8, prefetch=2), device=dev, log=None)
    torch.cuda.reset_peak_memory_stats(dev)
    predicted = swapper.placement.predicted_device_bytes
    train(layers, trainable, dev, "nonreentrant", steps=3, dtype=BF16, cfg=cfg)
    after_warmup = torch.cuda.memory_allocated(dev)
    train(layers, trainable, dev, "nonreentrant", steps=50, accumulate=1, eval_between=False, dtype=BF16, cfg=cfg)
    after_50 = torch.cuda.memory_allocated(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert peak <= predicted + activations * 1.1 + 8 * 2**20, (peak, predicted, activations)
    assert after_50 <= after_warmup, (after_warmup, after_50)
    pinned_before = swapper.store.pinned_bytes
    assert pinned_before > 0
    swapper.remove()
    assert swapper.store.pinned_bytes == 0 and not swapper.store.layers


def test_swapped_layers_are_real_cuda_copies():
    dev = device()
    layers, trainable = make_layers(BF16)
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=dev, log=None) as swapper:
        train(layers, trainable, dev, "nonreentrant", steps=1, dtype=BF16)
        stats = swapper.step_stats()
        assert stats.bytes_moved > 0 and stats.copy_ms > 0 and stats.peak_vram_bytes > 0
        assert all(host.pinned for host in swapper.store.layers.values())
