"""Activation offload on CUDA at Flux block width, delays on every stream: bitwise equal to all-resident.

The blocks' weights stream (20 ms before every weight copy), their inputs (2 x 12 x 3072 bf16, above the
offload threshold) go home and come back (10 ms before every copy either way), and compute sleeps 5 ms at
every layer use, with deterministic kernels and math attention. Losses, gradients, LoRA weights and eval
outputs must equal all-resident training with the same checkpointing, for non-reentrant, reentrant and a
diffusion-pipe 'unsloth'-style checkpoint; a recompute that does not wait for its restore must differ. With
recompute offload, what each recompute saves goes home and comes back under the same delays.
"""

import pytest
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

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.activations.activation_offload import ActivationOffloader

pytestmark = pytest.mark.gpu
MODES = ["nonreentrant", "reentrant", "unsloth"]


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
            cache[mode] = train(
                layers,
                trainable,
                device(),
                loop_mode(mode),
                dtype=BF16,
                cfg=FLUX_WIDTH,
                checkpoint_fn=checkpoint_for(mode),
            )
        return cache[mode]

    return get


def offloaded_run(template, mode, monkeypatch, prefetch=2, compute_ms=5.0, kept=None, recompute=False):
    layers, trainable = fresh(template)
    config = SwapConfig.of(prefetch=prefetch, offload_activations=True, offload_recompute=recompute)
    with LayerSwapper(layers, config, device=device(), log=None) as swapper:
        delay_every_copy(swapper)  # 20 ms before weight copies, 10 ms before activations out and in
        if kept is not None:  # as a plan with room for more inputs applies it
            swapper.apply_placement(swapper.streamed_layers, prefetch, kept_activations=kept)
        if compute_ms:
            swapper.add_listener(ComputeDelay(compute_ms))
        ckpt = swapper.checkpoint_function(checkpoint_for(mode))
        record = train(layers, trainable, device(), loop_mode(mode), dtype=BF16, cfg=FLUX_WIDTH, checkpoint_fn=ckpt)
        stats = swapper.total_stats(sync=True)
        offloader = swapper.activations
    assert stats.activation_bytes > 0
    assert offloader.restored_bytes + offloader.dropped_bytes == offloader.offloaded_bytes
    if recompute:
        assert offloader.recompute.sent_bytes > 0
        assert offloader.recompute.restored_bytes == offloader.recompute.sent_bytes
    return record


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [1, 2])
def test_offloaded_inputs_with_delays_stay_bitwise_equal(template, references, monkeypatch, mode, prefetch):
    assert_bitwise_equal(references(mode), offloaded_run(template, mode, monkeypatch, prefetch))


def test_a_recompute_that_does_not_wait_for_its_restore_differs(template, references, monkeypatch):
    """Compute runs without delays, so a recompute overtakes the 10 ms-delayed restore it does not wait for
    and reads the NaN bytes the restored storage holds until the copy lands."""
    monkeypatch.setattr(ActivationOffloader, "wait", lambda self, offload: None)  # the canary
    with pytest.raises(AssertionError):
        got = offloaded_run(template, "nonreentrant", monkeypatch, prefetch=1, compute_ms=0)
        assert_bitwise_equal(references("nonreentrant"), got)


@pytest.mark.parametrize("mode", MODES)
def test_recompute_offload_with_delays_stays_bitwise_equal(template, references, monkeypatch, mode):
    """What each recompute saves goes home too (from the second recompute of each block on), 10 ms behind
    every copy either way, and its restores are poisoned until they land."""
    got = offloaded_run(template, mode, monkeypatch, prefetch=1, recompute=True)
    assert_bitwise_equal(references(mode), got)


def test_a_backward_that_does_not_wait_for_a_recomputed_tensor_differs(template, references, monkeypatch):
    """Every block keeps its inputs on the device (kept=4), so only recompute offload restores anything; without
    its wait the backward reads the NaN bytes of a restore still 10 ms from landing."""
    monkeypatch.setattr(ActivationOffloader, "wait", lambda self, offload: None)  # the canary
    got = offloaded_run(template, "nonreentrant", monkeypatch, prefetch=1, compute_ms=0, kept=4, recompute=True)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(references("nonreentrant"), got)


@pytest.mark.parametrize("mode", ["nonreentrant", "unsloth"])
def test_a_plan_keeping_more_inputs_on_the_device_stays_bitwise_equal(template, references, monkeypatch, mode):
    """Of the 4 blocks, the last 2 keep their inputs on the device and the first 2 send them home (one block
    more than prefetch 1 keeps); restores run one block ahead."""
    assert_bitwise_equal(references(mode), offloaded_run(template, mode, monkeypatch, prefetch=1, kept=2))


def test_a_vram_budget_offloads_by_itself_and_stays_bitwise_equal(template, references, monkeypatch):
    """offload_activations unset with a VRAM budget on CUDA: the probe sends inputs home, the plan keeps
    what fits, the planner re-places layers between steps; the numbers are all-resident training's."""
    layers, trainable = fresh(template)
    with LayerSwapper(layers, SwapConfig.of(vram_budget=4.0), device=device(), log=None) as swapper:
        assert swapper.activations is not None
        delay_every_copy(swapper)
        ckpt = swapper.checkpoint_function(checkpoint_for("nonreentrant"))
        record = train(
            layers, trainable, device(), "nonreentrant", steps=6, dtype=BF16, cfg=FLUX_WIDTH, checkpoint_fn=ckpt
        )
        profile, plan = swapper.driver.profile, swapper.driver.plan
        sent = swapper.activations.offloaded_bytes
    assert profile.sent_segments > 0 and sent > 0 and plan.kept_activations >= 1
    layers, trainable = fresh(template)
    for layer in layers:
        layer.to(device())
    reference = train(
        layers,
        trainable,
        device(),
        "nonreentrant",
        steps=6,
        dtype=BF16,
        cfg=FLUX_WIDTH,
        checkpoint_fn=checkpoint_for("nonreentrant"),
    )
    assert_bitwise_equal(reference, record)


def test_waits_for_late_restores_are_counted_apart_from_the_weights(template):
    """Restores 10 ms behind their gates and compute with no delay: the recomputes wait for them, and the step
    stats say so in ``activation_wait_ms`` (the benchmarks' 'activation waits'), not in the weights' waits; with
    timing off (collect_timing=False) neither is measured."""
    seen = {}
    for timing in (True, False):
        layers, trainable = fresh(template)
        config = SwapConfig.of(prefetch=1, offload_activations=True, collect_timing=timing)
        with LayerSwapper(layers, config, device=device(), log=None) as swapper:
            delay_every_copy(swapper, weights_ms=0.0, others_ms=10.0)
            ckpt = swapper.checkpoint_function(checkpoint_for("nonreentrant"))
            train(layers, trainable, device(), "nonreentrant", dtype=BF16, cfg=FLUX_WIDTH, checkpoint_fn=ckpt)
            seen[timing] = swapper.total_stats(sync=True)
    assert seen[True].activation_bytes > 0
    assert seen[True].activation_wait_ms > 5.0, "at least one 10 ms-late restore was waited for"
    assert "for their restores" in seen[True].line()
    assert seen[False].activation_wait_ms == 0.0
