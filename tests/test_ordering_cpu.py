"""Ordering on the CPU: what makes slot reuse safe is checked where CI runs.

The CPU copier defers every write until its slot is acquired and fills the slot with NaN bytes
meanwhile, and the copier refuses to write a slot that was not released. Each protection the
engine relies on is switched off below, one at a time (a mutation), to show that a test fails
without it: the compute-side wait, the slot-release marker, the saved-tensor protection, and
the predictor's learning.
"""

import random

import pytest
import torch
from helpers import SMALL, assert_bitwise_equal, make_layers, run_layers, train
from torch.utils.checkpoint import checkpoint

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.memory.copier import Copier, DeferredCopier, OrderingError
from utils.dgls.memory.device_pool import DevicePool
from utils.dgls.memory.host_store import HostStore
from utils.dgls.memory.layout import measure
from utils.dgls.streaming.hooks import HookAdapter
from utils.dgls.streaming.schedule import UsePredictor

CPU = torch.device("cpu")
MODES = ["none", "nonreentrant", "reentrant"]


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(mode):
        if mode not in cache:
            cache[mode] = train(*make_layers(), CPU, mode)
        return cache[mode]

    return get


def swapped_run(mode, prefetch=1, seed=None, threading=False):
    """Train with most layers streamed; ``seed`` picks victim slots at random (other slot assignments
    than LRU's, as a different schedule would give)."""
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=prefetch, threading=threading), device=CPU, log=None) as swapper:
        if seed is not None:
            rng = random.Random(seed)
            swapper._victim = lambda candidates: rng.choice(candidates)
        return train(layers, trainable, CPU, mode)


def differs(reference, got) -> bool:
    try:
        assert_bitwise_equal(reference, got)
    except AssertionError:
        return True
    return False


# ---------------------------------------------------------------- the copier on its own
def one_layer_copier(threading=False):
    layers, _ = make_layers()
    layout = measure(layers)[2]
    store = HostStore(CPU, None, 0)
    host = store.add_layer(layout)
    pool = DevicePool(CPU, 2, layout.slot_bytes)
    return DeferredCopier(store, use_thread=threading), host, pool


def test_a_deferred_write_lands_only_when_acquired():
    copier, host, pool = one_layer_copier()
    slot = pool.slots[0]
    (token,) = copier.submit([(slot, host, False)])
    view = slot.buffer[: host.layout.params[0].nbytes].view(torch.float32)
    assert torch.isnan(view).all()  # in flight: undefined contents
    copier.acquire(token)
    assert torch.equal(view, host.master_view(0).flatten())


def test_the_copier_refuses_to_write_a_slot_that_was_not_released():
    copier, host, pool = one_layer_copier()
    slot = pool.slots[0]
    (token,) = copier.submit([(slot, host, False)])
    copier.acquire(token)
    with pytest.raises(OrderingError, match="release the slot before writing it"):
        copier.submit([(slot, host, False)])
    copier.release(slot)
    (again,) = copier.submit([(slot, host, False)])
    assert token.slot is again.slot and any(g is not token for g in again.gates)  # gated on the release
    with pytest.raises(OrderingError, match="was overwritten"):
        copier.acquire(token)  # a stale token


def test_a_worker_thread_writes_at_once_and_acquire_waits_for_it():
    copier, host, pool = one_layer_copier(threading=True)
    (token,) = copier.submit([(pool.slots[1], host, False)])
    copier.acquire(token)
    assert token.issued.is_set() and torch.equal(
        pool.slots[1].buffer[: host.layout.params[0].nbytes].view(torch.float32), host.master_view(0).flatten()
    )
    copier.close()


@pytest.mark.parametrize("threading", [False, True], ids=["deferred", "thread"])
@pytest.mark.parametrize("mode", MODES)
def test_random_slot_assignment_stays_exact(references, mode, threading):
    """Other slot assignments than LRU's (a random victim each time) give the same numbers."""
    for seed in range(3):
        assert_bitwise_equal(references(mode), swapped_run(mode, prefetch=2, seed=seed, threading=threading))


# ---------------------------------------------------------------- mutations
@pytest.mark.parametrize("mode", MODES)
def test_mutation_no_compute_side_wait_reads_poison(references, mode, monkeypatch):
    monkeypatch.setattr(DeferredCopier, "_wait", lambda self, token: None)
    got = swapped_run(mode)
    assert differs(references(mode), got)
    assert any(torch.isnan(loss).any() for loss in got.losses)


@pytest.mark.parametrize("mode", MODES)
def test_mutation_no_release_marker_is_refused(mode, monkeypatch):
    monkeypatch.setattr(Copier, "release", lambda self, slot: None)
    with pytest.raises(OrderingError, match="while layer .* may still read it"):
        swapped_run(mode)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_mutation_no_saved_tensor_protection_differs(references, prefetch, monkeypatch):
    """Without checkpointing autograd keeps views of the slots: without SlotRefs they read other layers."""
    monkeypatch.setattr(HookAdapter, "_pack", lambda self, tensor: tensor)
    assert differs(references("none"), swapped_run("none", prefetch=prefetch))
    assert differs(references("none"), swapped_run("none", prefetch=prefetch, seed=0))


def steady_state_misses(mode, prefetch, order=None):
    """Prefetch misses of steps 3 and 4: by then the predictor has seen a whole cycle (a step, then the
    eval pass that follows it, which counts towards step 2).
    ``order``: the order the layers run in, if not the list's (as a UNet's skips or a model that
    reuses blocks would): the swapper is given the list in index order either way."""
    layers, trainable = make_layers()
    per_step = []
    with LayerSwapper(layers, SwapConfig.of(prefetch=prefetch), device=CPU, log=None) as swapper:
        marks = [swapper.total_stats()]

        def on_step(_):
            marks.append(swapper.total_stats())
            per_step.append(marks[-1].since(marks[-2]).misses)

        run = layers if order is None else [layers[i] for i in order]
        train(run, trainable, CPU, mode, steps=4, on_step=on_step)
    return per_step[2:]


SHUFFLED = [0, 3, 6, 1, 5, 2, 4, 7]  # blocks 1-6 out of index order (a single block last, as Flux has)


@pytest.mark.parametrize("order", [None, SHUFFLED], ids=["in-order", "shuffled"])
@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_every_use_is_prefetched_once_the_order_is_learned(mode, prefetch, order):
    assert steady_state_misses(mode, prefetch, order) == [0, 0]


def test_mutation_a_predictor_that_never_learns_misses(monkeypatch):
    def observe_only_the_last(self, use):
        self.previous, self.current = self.current, use

    monkeypatch.setattr(UsePredictor, "observe", observe_only_the_last)
    assert all(steady_state_misses(mode, 2, SHUFFLED) != [0, 0] for mode in MODES)


# ---------------------------------------------------------------- saved-tensor hooks around DGLS
def test_outer_saved_tensor_hooks_that_keep_tensors_are_composed(references):
    """The user's own hooks (these keep every tensor as it is) used to switch DGLS's protection off."""
    layers, trainable = make_layers()
    kept = []

    def pack(tensor):
        kept.append(1)
        return tensor

    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None) as swapper:
        rng = random.Random(0)
        swapper._victim = lambda candidates: rng.choice(candidates)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            got = train(layers, trainable, CPU, "none")
    assert kept, "the outer hooks saw the tensors DGLS did not take"
    assert_bitwise_equal(references("none"), got)


def test_save_on_cpu_around_dgls_stays_exact(references):
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None):
        with torch.autograd.graph.save_on_cpu():
            got = train(layers, trainable, CPU, "none")
    assert_bitwise_equal(references("none"), got)


def region_grads(swap: bool, victims_seed: int = 0):
    """Two steps with layers 1-3 in one non-reentrant checkpoint region (as a layer split into swap units
    is); the LoRA gradients."""
    layers, trainable = make_layers()
    data = train.__globals__["SyntheticLatents"](SMALL, samples=4, image_tokens=4, text_tokens=2, seed=0)
    batches = data.batches(2, torch.float32, CPU)
    grads = []
    swapper = LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None) if swap else None
    try:
        if swapper is not None:
            assert {1, 2, 3} <= set(swapper.streamed_layers)
            rng = random.Random(victims_seed)
            swapper._victim = lambda candidates: rng.choice(candidates)
        for _ in range(2):
            inputs, target = next(batches)
            h = run_layers(layers[:1], inputs, "none")
            h = checkpoint(lambda *xs: layers[3](layers[2](layers[1](xs))), *h, use_reentrant=False)
            out = run_layers(layers[4:], h, "none")
            torch.nn.functional.mse_loss(out.float(), target.float()).backward()
            grads.append([p.grad.clone() for p in trainable])
            for p in trainable:
                p.grad = None
    finally:
        if swapper is not None:
            swapper.remove()
    return grads


def assert_same_grads(a, b):
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            assert torch.equal(x, y), "gradients differ"


def test_a_checkpoint_region_over_several_streamed_layers_stays_exact():
    """Views of a slot that the region's recompute makes never stay in the checkpoint's storage: each is
    rebuilt from its layer's current slot when backward needs it, whichever slot that is."""
    reference = region_grads(swap=False)
    for seed in range(3):
        assert_same_grads(reference, region_grads(swap=True, victims_seed=seed))


def test_a_checkpoint_region_over_several_layers_fails_without_the_saved_tensor_protection(monkeypatch):
    """Mutation: without DGLS's hooks over the checkpoint's, the recompute keeps views of a slot that
    is rewritten before the backward reads them."""
    monkeypatch.setattr(HookAdapter, "_push_saved_tensor_hooks", lambda self, outer: None)
    reference = region_grads(swap=False)
    with pytest.raises(Exception) as failure:
        for seed in range(3):
            assert_same_grads(reference, region_grads(swap=True, victims_seed=seed))
    assert not isinstance(failure.value, DGLSUserError)


def test_selective_checkpointing_of_a_streamed_layer_is_refused():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    layers, _ = make_layers()
    data = train.__globals__["SyntheticLatents"](SMALL, samples=2, image_tokens=4, text_tokens=2, seed=0)
    inputs, _ = next(data.batches(2, torch.float32, CPU))
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None) as swapper:
        a = swapper.streamed_layers[0]
        h = run_layers(layers[:a], inputs, "none")

        def contexts():
            return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kw: CheckpointPolicy.MUST_SAVE)

        with pytest.raises(DGLSUserError, match="selective activation checkpointing"):
            checkpoint(lambda *xs: layers[a](xs), *h, use_reentrant=False, context_fn=contexts)
