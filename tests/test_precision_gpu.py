"""fp8 storage on CUDA (bf16 model): equal to a fake-quantized model, and close to bf16 storage.

Error bound stated in the README: with e4m3 storage (per-row scales) the loss differs from
bf16 storage by under 1% and the model output by under 5% relative RMS on this model (measured on the
H100: 0.09% and 1.6%).
"""

import pytest
import torch
from helpers import make_layers, round_as_stored, train

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.memory.precision import CastRules

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
FP8 = SwapConfig.of(cast_target=[("bf16", "f8_e4m3")], prefetch=2)


def device():
    return torch.device("cuda", torch.cuda.current_device())


def flat(record):
    return [*record.losses, *(g for step in record.grads for g in step), *record.params, *record.eval_outputs]


def max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(flat(a), flat(b)))


def rel_rms(a, b):
    return ((a.float() - b.float()).square().mean().sqrt() / b.float().square().mean().sqrt()).item()


def fake_quantized_reference(mode, config=FP8):
    """Unswapped, on the device, with the cast params fake-quantized there (in every layer: casts apply
    wherever a layer lives)."""
    layers, trainable = make_layers(BF16)
    rules = CastRules.from_policy(config.compute)
    for layer in layers:
        layer.to(device())
    round_as_stored(layers, rules, device())
    return train(layers, trainable, device(), mode, dtype=BF16)


def swapped(mode, config):
    layers, trainable = make_layers(BF16)
    with LayerSwapper(layers, config, device=device(), log=None) as swapper:
        record = train(layers, trainable, device(), mode, dtype=BF16)
        stats = swapper.step_stats()
        hosts = list(swapper.store.layers.values())
    return record, stats, hosts


@pytest.mark.parametrize("mode", ["none", "nonreentrant", "reentrant"])
@pytest.mark.parametrize(
    "config",
    [
        FP8,
        FP8.replace(threading=True, prefetch=1),
        FP8.replace(cuda_streams=2, batch_move=True),
        FP8.replace(pinned_ram_budget_gb=0.0),
    ],
    ids=["pf2", "thread", "2streams", "pageable"],
)
def test_fp8_storage_equals_fake_quantized_model(mode, config):
    ref1, ref2 = fake_quantized_reference(mode, config), fake_quantized_reference(mode, config)
    spread = max_diff(ref1, ref2)
    got, stats, hosts = swapped(mode, config)
    diff = max_diff(ref1, got)
    if spread == 0:
        assert diff == 0, f"kernels are deterministic here, yet fp8-swapped differs by {diff}"
    else:
        assert diff <= 2 * spread, f"fp8-swapped differs by {diff}, two unswapped runs by {spread}"
    assert all(torch.isfinite(t).all() for t in flat(got))
    assert all(h.layout.landing_bytes > 0 and h.layout.host_bytes < 0.6 * h.layout.slot_bytes for h in hosts)
    assert stats.bytes_moved > 0


def test_fp8_error_vs_bf16_storage_within_bound():
    bf16, bf16_stats, _ = swapped("nonreentrant", SwapConfig.of(prefetch=2))
    fp8, fp8_stats, _ = swapped("nonreentrant", FP8)
    loss_err = max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(fp8.losses, bf16.losses))
    out_err = max(rel_rms(a, b) for a, b in zip(fp8.eval_outputs, bf16.eval_outputs))
    print(f"fp8 vs bf16 storage: loss rel err {loss_err:.4f}, output rel RMS err {out_err:.4f}")
    assert loss_err < 0.01 and out_err < 0.05
    assert fp8_stats.bytes_moved < 0.6 * bf16_stats.bytes_moved
