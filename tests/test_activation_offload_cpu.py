"""Activation offload on the CPU: checkpointed blocks' inputs go home during forward and come back before
their recompute, and training is bitwise what it is without offload.

LoRA training of the small demo model (3 double and 3 single blocks, each checkpointed), 2 steps of 2
micro-batches with eval passes between, for non-reentrant, reentrant and a diffusion-pipe ``'unsloth'``-
style checkpoint (large arguments saved as host copies, the recompute inside its own backward). On the CPU a
restore writes NaN at once and the saved bytes only when the recompute waits for it, so a recompute that
does not wait fails here.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from full_ft import SPEC, assert_same, full_layers, host_trained_names, train_dgls, train_reference
from helpers import (
    SMALL,
    assert_bitwise_equal,
    checkpoint_for,
    loop_mode,
    make_layers,
    run_layers,
    skip_waits,
    slow_case,
    train,
)

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.activations.activation_offload import ActivationOffloader
from utils.dgls.activations.recompute_offload import AHEAD_BYTES
from utils.dgls.demo.data import SyntheticLatents
from utils.dgls.memory import host_store
from utils.dgls.memory.layout import GiB
from utils.dgls.memory.transport import Direction

CPU = torch.device("cpu")
MODES = ["nonreentrant", "reentrant", "unsloth"]
BLOCKS = SMALL.double_blocks + SMALL.single_blocks


def run(mode, offloader=None):
    layers, trainable = make_layers()
    ckpt = checkpoint_for(mode)
    if offloader is not None:
        ckpt = offloader.wrap(ckpt)
    # like reentrant checkpointing, the 'unsloth' kind needs an input that requires grad (train sets it)
    return train(layers, trainable, CPU, "nonreentrant" if mode == "nonreentrant" else "reentrant", checkpoint_fn=ckpt)


@pytest.fixture(scope="module")
def references():
    return {mode: run(mode) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("keep", [1, 2, 5])
def test_offloaded_training_is_bitwise_the_same(references, mode, keep):
    offloader = ActivationOffloader(CPU, keep=keep, min_bytes=0)
    got = run(mode, offloader)
    assert_bitwise_equal(got, references[mode])
    assert offloader.offloaded_bytes > 0
    back = offloader.restored_bytes + offloader.dropped_bytes
    assert back == offloader.offloaded_bytes, "everything sent home came back, or was freed meanwhile"
    if mode != "unsloth":  # the checkpoint keeps its inputs (the 'unsloth' kind keeps host copies instead)
        assert offloader.dropped_bytes == 0
    assert not offloader._live, "every host buffer is back in the pool"
    chain, segment = 0, offloader._last
    while segment is not None:
        chain, segment = chain + 1, segment.previous
    assert chain <= BLOCKS, "segments of finished passes are let go"


def forward_only(offloader, mode="nonreentrant"):
    """One checkpointed forward and its loss (no backward yet), and the block inputs it saw."""
    layers, _ = make_layers()
    data = SyntheticLatents(SMALL, samples=4, image_tokens=12, text_tokens=5, seed=3)
    inputs, target = next(data.batches(2, torch.float32, CPU))
    seen = []
    inner = offloader.wrap(checkpoint_for(mode))

    def ckpt(function, *args):
        seen.append(args)
        return inner(function, *args)

    loss = F.mse_loss(run_layers(layers, inputs, mode, ckpt).float(), target.float())
    return loss, seen


@pytest.mark.parametrize("keep", [1, 3])
def test_after_the_forward_the_early_blocks_inputs_hold_no_memory(keep):
    """The inputs of every block but the last ``keep`` point at empty storages until backward; a tensor that
    every block takes (the timestep vector) stays."""
    offloader = ActivationOffloader(CPU, keep=keep, min_bytes=0)
    loss, seen = forward_only(offloader)
    assert len(seen) == BLOCKS
    for k, args in enumerate(seen):
        img = args[0]
        expect_empty = k < BLOCKS - keep
        assert (img.untyped_storage().nbytes() == 0) == expect_empty, (k, keep)
        assert args[-1].untyped_storage().nbytes() > 0, "the timestep vector is taken by every block"
    loss.backward()
    for args in seen:
        assert args[0].untyped_storage().nbytes() > 0, "back on the device after the backward"


def test_the_next_blocks_inputs_come_back_ahead_of_their_recompute():
    """At each recompute the ``keep`` blocks before it start coming back, so no restore is issued only when
    its recompute needs it (the last ``keep`` never left)."""
    offloader = ActivationOffloader(CPU, keep=2, min_bytes=0)
    loss, _ = forward_only(offloader)
    loss.backward()
    assert offloader.demand_restores == 0
    assert offloader.restored_bytes == offloader.offloaded_bytes > 0


def test_a_recompute_that_does_not_wait_for_its_inputs_fails(references, monkeypatch):
    skip_waits(monkeypatch, Direction.ACTIVATIONS_IN)  # the mutation
    got = run("nonreentrant", ActivationOffloader(CPU, keep=1, min_bytes=0))
    with pytest.raises(AssertionError):
        assert_bitwise_equal(got, references["nonreentrant"])


def test_eval_passes_and_small_tensors_are_left_alone():
    offloader = ActivationOffloader(CPU, keep=1, min_bytes=2**20)  # the small model's inputs are under 1 MiB
    forward_only(offloader)[0].backward()
    assert offloader.offloaded_bytes == 0
    offloader = ActivationOffloader(CPU, keep=1, min_bytes=0)
    layers, _ = make_layers()
    data = SyntheticLatents(SMALL, samples=4, image_tokens=12, text_tokens=5, seed=3)
    inputs, _ = next(data.batches(2, torch.float32, CPU))
    with torch.no_grad():
        run_layers(layers, inputs, "nonreentrant", offloader.wrap(checkpoint_for("nonreentrant")))
    assert offloader.offloaded_bytes == 0


def test_running_out_of_host_ram_is_one_line_naming_what_to_drop(monkeypatch):
    """A new host buffer that would leave the host less than its reserve (a tenth of its RAM, 2 GiB at least) is
    refused with the figures and the flags that send the most home, not left to fail inside CUDA or to swap."""
    memory = SimpleNamespace(total=16 * GiB, available=2 * GiB + 4096)
    monkeypatch.setattr(host_store.psutil, "virtual_memory", lambda: memory)  # ram_short reads it there
    with pytest.raises(
        DGLSUserError,
        match=r"activation offload ran out of host RAM: .* 2\.00 GiB available .*"
        r"drop --keep_piece_outputs \(its pieces' outputs\), then --offload_recompute",
    ):
        forward_only(ActivationOffloader(CPU, keep=1, min_bytes=0))
    memory.available = 3 * GiB  # room for these few KiB
    loss, _ = forward_only(ActivationOffloader(CPU, keep=1, min_bytes=0))
    loss.backward()


def test_a_forward_without_backward_gives_its_host_buffers_back():
    """A graph dropped before backward (its loss never used): the next forward reclaims the buffers."""
    offloader = ActivationOffloader(CPU, keep=1, min_bytes=0)
    loss, seen = forward_only(offloader)
    sent = offloader.offloaded_bytes
    assert sent > 0 and offloader._live
    del loss, seen
    loss, _ = forward_only(offloader)
    assert offloader.offloaded_bytes == 2 * sent
    loss.backward()
    assert not offloader._live
    assert sum(len(v) for v in offloader._pool.values()) > 0


# ---------------------------------------------------------------- with the engine (offload_activations)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kw", [{"prefetch": 1}, {"prefetch": 2, "threading": True}], ids=["pf1", "pf2-thread"])
def test_with_streamed_weights_training_is_bitwise_the_same(references, mode, kw):
    """The swapper streams the blocks' weights and sends their inputs home: both come back in time."""
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(offload_activations=True, **kw), device=CPU, log=None) as swapper:
        ckpt = swapper.checkpoint_function(checkpoint_for(mode))
        got = train(
            layers, trainable, CPU, "nonreentrant" if mode == "nonreentrant" else "reentrant", checkpoint_fn=ckpt
        )
        stats = swapper.total_stats()
    assert_bitwise_equal(got, references[mode])
    assert stats.activation_bytes == swapper.activations.offloaded_bytes > 0
    assert swapper.activations.keep == kw["prefetch"]


def test_off_the_checkpoint_function_is_the_trainers_own():
    layers, _ = make_layers()
    with LayerSwapper(layers, SwapConfig(), device=CPU, log=None) as swapper:
        ckpt = checkpoint_for("nonreentrant")
        assert swapper.checkpoint_function(ckpt) is ckpt


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
@pytest.mark.parametrize("recompute", [False, True], ids=["inputs", "recompute"])
def test_with_full_fine_tuning_training_is_bitwise_the_same(mode, recompute):
    """Every weight trains, streamed layers on the host (their gradients sent home during the backward that
    also brings the inputs back, and with offload_recompute what the recomputes saved): the numbers of training
    without streaming or offload."""
    layers = full_layers()
    config = SwapConfig.of(
        host_optimizer=SPEC, accumulation_steps=2, prefetch=2, offload_activations=True, offload_recompute=recompute
    )
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        names = host_trained_names(layers, swapper)
        record = train_dgls(layers, swapper, CPU, mode, checkpoint_fn=swapper.checkpoint_function(checkpoint_for(mode)))
        sent = swapper.activations.offloaded_bytes
        recomputed = swapper.activations.recompute.sent_bytes if recompute else 1
    assert sent > 0 and recomputed > 0
    assert_same(record, train_reference(full_layers(), names, CPU, mode))


def test_with_the_vram_budget_planner_training_is_bitwise_the_same():
    """The planner probes with offload on (so it measures the activations that stay and each block's inputs)
    and re-places layers between steps; the inputs kept on the device follow its plan (on the CPU, where it
    measures no activations, every block's: nothing goes home after the probe)."""
    layers, trainable = make_layers()
    config = SwapConfig.of(vram_budget=1.0, offload_activations=True)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        ckpt = swapper.checkpoint_function(checkpoint_for("nonreentrant"))
        got = train(layers, trainable, CPU, "nonreentrant", steps=4, checkpoint_fn=ckpt)
        profile, plan = swapper.driver.profile, swapper.driver.plan
        assert profile.sent_segments == BLOCKS - profile.probe_kept > 0 and profile.segment_bytes > 0
        assert swapper.activations.keep == plan.kept_activations == BLOCKS
        assert swapper.activations.offloaded_bytes > 0
    reference = train(*make_layers(), CPU, "nonreentrant", steps=4, checkpoint_fn=checkpoint_for("nonreentrant"))
    assert_bitwise_equal(got, reference)


@pytest.mark.parametrize("kept", [1, 4, BLOCKS])
def test_a_plan_that_keeps_more_inputs_on_the_device_sends_only_the_rest_home(references, kept):
    """``apply_placement(..., kept_activations)``: the inputs of the last ``kept`` blocks of each forward stay,
    the others go home and come back, restores still one block ahead; the numbers do not change."""
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(offload_activations=True, prefetch=1), device=CPU, log=None) as swapper:
        swapper.apply_placement(swapper.streamed_layers, 1, kept_activations=kept)
        assert (swapper.activations.keep, swapper.activations.ahead) == (kept, 1)
        got = train(
            layers,
            trainable,
            CPU,
            "nonreentrant",
            checkpoint_fn=swapper.checkpoint_function(checkpoint_for("nonreentrant")),
        )
        sent = swapper.activations.segments_sent
    assert_bitwise_equal(got, references["nonreentrant"])
    assert sent == 4 * (BLOCKS - kept), "4 passes with grad, each sending all but the last kept blocks' inputs"


# ---------------------------------------------------------------- recompute offload (recompute_offload.py)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("keep", [1, BLOCKS])
def test_with_recompute_offload_training_is_bitwise_the_same(references, mode, keep):
    """What the recomputes save goes home too (all of it in the first step, all but the last third of each
    recompute after), and comes back before the backward reads it."""
    offloader = ActivationOffloader(CPU, keep=keep, min_bytes=0, recompute=True)
    got = run(mode, offloader)
    assert_bitwise_equal(got, references[mode])
    recompute = offloader.recompute
    assert recompute.sent_bytes > 0
    assert recompute.restored_bytes == recompute.sent_bytes
    assert not recompute._live, "every record was read back and let go"
    assert offloader.restored_bytes + offloader.dropped_bytes == offloader.offloaded_bytes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [0, slow_case(1), 3])  # 1 in the slow step
def test_with_streamed_weights_and_recompute_offload_training_is_bitwise_the_same(references, mode, prefetch):
    """offload_recompute turns activation offload on; views of the streamed weights' slots bypass it."""
    layers, trainable = make_layers()
    config = SwapConfig.of(offload_recompute=True, prefetch=prefetch)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        ckpt = swapper.checkpoint_function(checkpoint_for(mode))
        got = train(
            layers, trainable, CPU, "nonreentrant" if mode == "nonreentrant" else "reentrant", checkpoint_fn=ckpt
        )
        recompute = swapper.activations.recompute
        stats = swapper.total_stats()
    assert_bitwise_equal(got, references[mode])
    assert recompute.sent_bytes > 0 and recompute.restored_bytes == recompute.sent_bytes
    assert stats.activation_bytes == swapper.activations.offloaded_bytes > recompute.sent_bytes


@pytest.mark.parametrize("mode", MODES)
def test_recomputed_tensors_come_back_ahead_of_their_reads_within_the_window(mode):
    """The default window (1 GiB, more than this model's recomputes save) has every sent tensor on its way back
    before the backward reads it; a window of 0 bytes leaves most restores to the read itself."""
    demands = {}
    for ahead in (0, AHEAD_BYTES):
        offloader = ActivationOffloader(CPU, keep=BLOCKS, min_bytes=0, recompute=True)
        recompute = offloader.recompute
        recompute.ahead_bytes = ahead
        first = []  # the first step's recomputes send all they save (nothing to go by), the last read at once

        def after_step(step, recompute=recompute, first=first):
            if step == 1:
                first.extend((recompute.demand_restores, recompute.sent_tensors))

        layers, trainable = make_layers()
        train(
            layers,
            trainable,
            CPU,
            loop_mode(mode),
            checkpoint_fn=offloader.wrap(checkpoint_for(mode)),
            on_step=after_step,
        )
        demands[ahead] = (recompute.demand_restores - first[0]) / (recompute.sent_tensors - first[1])
    assert demands[AHEAD_BYTES] == 0
    assert demands[0] > 0.5


def test_a_backward_that_reads_a_recomputed_tensor_without_waiting_fails(references, monkeypatch):
    """The block inputs all stay (keep covers every block), so only recompute offload's restores are skipped."""
    skip_waits(monkeypatch, Direction.ACTIVATIONS_IN)  # the mutation
    got = run("nonreentrant", ActivationOffloader(CPU, keep=BLOCKS, min_bytes=0, recompute=True))
    with pytest.raises(AssertionError):
        assert_bitwise_equal(got, references["nonreentrant"])


def test_a_depth_set_inside_a_layer_major_steps_keeping_outlasts_it():
    """keeping(N) raises the kept calls for a layer-major step and puts the old depth back after it; a depth set
    inside the block (a placement change: the planner's) is the new one and stays, not overwritten by the old."""
    offloader = ActivationOffloader(CPU, keep=2, min_bytes=0)
    with offloader.keeping(4):
        assert offloader.keep == 4
    assert offloader.keep == 2 and offloader.kept_last_step == 4
    with offloader.keeping(4):
        offloader.set_depth(6, 3)
    assert (offloader.keep, offloader.ahead) == (6, 3)
    with offloader.keeping(4):
        offloader.set_depth(4, 1)  # the raised value itself
    assert offloader.keep == 4
    offloader.close()
