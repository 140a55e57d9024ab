"""The parts full fine-tuning is cut into, on the CPU: the gradient state machine, the training layout (what
it allocates is what the RAM check counts), and the optimizer kernels behind device updates (SGD as a second
kernel: bitwise equal to unstreamed training with torch's SGD, on the device path and split with the host)."""

import dataclasses

import pytest
import torch
from full_ft import (
    MAX_NORM,
    SGD,
    SPEC,
    assert_same,
    flip_sides_every_step,
    full_layers,
    loss_of_a_layer_run_twice,
    train_dgls,
    train_reference,
)

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.memory.transport import Transport
from utils.dgls.training.device_update import DeviceUpdater
from utils.dgls.training.grad_return import GradBatch, GradState, LayerGrads
from utils.dgls.training.host_training import host_training_bytes
from utils.dgls.training.jobs import Job
from utils.dgls.training.optimizer_kernels import AdamWKernel, SGDKernel

CPU = torch.device("cpu")


# ---------------------------------------------------------------- GradState
def test_gradient_state_follows_its_transitions_and_refuses_any_other():
    g = LayerGrads(3)
    batch = GradBatch(3, params={0, 1})
    g.open(batch)
    assert g.state is GradState.OPEN and g.batch is batch
    assert g.close_direct() is batch and g.state is GradState.DIRECT
    g.promote(Job(3, "accumulate"))  # a second batch in the step: the first one is summed after all
    assert g.state is GradState.SUMMED and g.summed == {0, 1} and g.direct is None
    g.open(GradBatch(3, params={2}))
    g.close_summed(Job(3, "accumulate"))
    grads = g.take()
    assert g.state is GradState.IDLE and grads.summed == {0, 1, 2} and grads.direct is None
    assert g.summed == set() and g.summing is None
    assert g.take().summed == frozenset()  # a layer without gradients still gets its update
    g.open(GradBatch(3))
    g.close_direct()
    assert g.take_early().direct is not None and g.state is GradState.QUEUED
    g.settle()
    assert g.state is GradState.IDLE
    g.open(GradBatch(3, params={0}))
    g.close_direct()
    g.direct_norms[0] = torch.ones(())
    assert g.speculate().direct is not None and g.state is GradState.SPECULATED
    assert g.direct is not None and g.direct_norms  # kept for the norm (and for a redo)
    g.reopen()  # undone before the step: the layer waits for the norm again
    assert g.state is GradState.DIRECT and g.direct_norms
    g.speculate()
    assert g.take().direct is not None and g.state is GradState.IDLE and not g.direct_norms


@pytest.mark.parametrize(
    "before, transition",
    [
        ([], "close_direct"),  # nothing open
        ([], "promote"),
        ([], "take_early"),
        ([], "settle"),
        (["open"], "open"),  # a batch is open already
        (["open"], "take"),  # the step came while a batch was open
        (["open", "close_direct"], "open"),  # a new batch must first sum the direct one (promote)
        (["open", "close_direct"], "close_summed"),
        (["open", "close_direct", "take_early"], "take"),  # queued early: the step settles it
        (["open", "close_direct", "take_early"], "open"),
        ([], "speculate"),  # nothing closed
        (["open"], "speculate"),
        (["open", "close_direct"], "reopen"),  # nothing speculated
        (["open", "close_direct", "speculate"], "open"),  # a grad first reopens it (undone)
        (["open", "close_direct", "speculate"], "settle"),
    ],
)
def test_an_out_of_order_gradient_transition_raises(before, transition):
    g = LayerGrads(5)
    calls = {
        "open": lambda: g.open(GradBatch(5)),
        "close_direct": g.close_direct,
        "close_summed": lambda: g.close_summed(Job(5, "accumulate")),
        "promote": lambda: g.promote(Job(5, "accumulate")),
        "take": g.take,
        "take_early": g.take_early,
        "settle": g.settle,
        "speculate": g.speculate,
        "reopen": g.reopen,
    }
    for name in before:
        calls[name]()
    state = g.state
    with pytest.raises(AssertionError, match="layer 5's gradients are"):
        calls[transition]()
    assert g.state is state


# ---------------------------------------------------------------- TrainingLayout
def held_bytes(training) -> dict[str, int]:
    """Bytes of the distinct storages the training state holds: masters (not the packed copies), landings,
    sums, optimizer state (step counts aside) and the spares of speculative updates under clipping."""
    storages: dict[str, dict[int, int]] = {"masters": {}, "gradients": {}, "optimizer": {}, "speculation": {}}

    def add(part, tensor):
        storage = tensor.untyped_storage()
        storages[part][storage.data_ptr()] = storage.nbytes()

    for layer in training.layers.values():
        for tp in layer.params:
            if tp.packed is not None:
                add("masters", tp.master)
            add("gradients", tp.landing)
            if tp.acc is not None:
                add("gradients", tp.acc)
        for state in layer.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.ndim:
                    add("optimizer", value)
    for spare in training.speculation.spares.values():
        for tensor in (spare.masters, *spare.state.values()):
            add("speculation", tensor)
    return {part: sum(sizes.values()) for part, sizes in storages.items() if sizes or part != "speculation"}


@pytest.mark.parametrize(
    "spec, dtype, accumulate",
    [
        (SPEC, torch.float32, 2),  # fp32: the packed copies are the masters; sums
        (SPEC, torch.bfloat16, 1),  # fp32 masters, no sums
        (dataclasses.replace(SPEC, implementation="device"), torch.bfloat16, 2),  # flat layers
        (dataclasses.replace(SPEC, implementation="split"), torch.float32, 1),  # per-param, state prepared
        (SGD, torch.bfloat16, 2),  # one momentum buffer
        (dataclasses.replace(SGD, momentum=0.0, implementation="device"), torch.bfloat16, 1),  # no state at all
    ],
    ids=["fp32-sums", "bf16", "device-flat", "split-fp32", "sgd", "sgd-device-no-momentum"],
)
def test_the_training_layout_allocates_what_the_ram_check_counts(spec, dtype, accumulate):
    """After a step (torch creates host optimizer state on its first step), the masters, landings, sums and
    optimizer state held are exactly the figure the RAM check and the start-up line use."""
    layers = full_layers(dtype)
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=accumulate)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        figure = host_training_bytes(swapper.layouts, swapper.placement.streamed, spec, sums=accumulate != 1)
        assert swapper.training.layout.parts() == figure
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=accumulate, dtype=dtype)
        swapper.training.finish()
        assert held_bytes(swapper.training) == figure
    assert figure["gradients"] > 0 and (figure["optimizer"] == 0) == (spec.type == "sgd" and not spec.momentum)


def test_the_ram_check_and_the_allocation_use_one_training_layout(monkeypatch):
    """The builder measures the training layout once: the object the RAM check read is the one allocated."""
    import utils.dgls.engine.build as build

    checked = []
    real = build.check_host_training
    monkeypatch.setattr(build, "check_host_training", lambda layout, **kw: checked.append(layout) or real(layout, **kw))
    layers = full_layers(torch.bfloat16)
    with LayerSwapper(layers, SwapConfig.of(host_optimizer=SPEC), device=CPU, log=None) as swapper:
        assert len(checked) == 1 and swapper.training.layout is checked[0]


# ---------------------------------------------------------------- optimizer kernels
def stepped(optimizer_class, kernel, **hyper):
    """Three steps of ``kernel`` on a master and of ``optimizer_class(fused=True)``: both masters and states."""
    make = torch.Generator().manual_seed
    ours = torch.randn(1000, generator=make(1))
    theirs = torch.nn.Parameter(ours.clone())
    optimizer = optimizer_class([theirs], fused=True, **hyper)
    group = optimizer.param_groups[0]
    state: dict = {}
    kernel.new_state(state, ours.shape, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    for i in range(3):
        grad = torch.randn(1000, generator=make(10 + i))
        theirs.grad = grad.clone()
        optimizer.step()
        steps = []
        if kernel.counts_steps:
            state["step"] += 1
            steps = [state["step"].clone()]
        kernel.step([ours], [grad.clone()], [[state[k]] for k in kernel.state_keys], steps, group, None)
    return ours, theirs.detach(), state, optimizer.state[theirs]


def test_the_adamw_kernel_is_torch_fused_adamw():
    ours, theirs, state, their_state = stepped(torch.optim.AdamW, AdamWKernel(), lr=1e-2, weight_decay=0.01)
    assert torch.equal(ours, theirs)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(state[key], their_state[key]), key


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_sgd_kernel_is_torch_sgd_from_its_first_step(momentum):
    """The momentum buffer starts as zeros and every step runs as a later one: the first step's numbers are
    still torch's, which copies the first gradient into the buffer."""
    kernel = SGDKernel(momentum)
    ours, theirs, state, their_state = stepped(torch.optim.SGD, kernel, lr=1e-2, momentum=momentum, weight_decay=0.01)
    assert torch.equal(ours, theirs)
    if momentum:
        assert torch.equal(state["momentum_buffer"], their_state["momentum_buffer"])
    else:
        assert kernel.state_keys == () and state == {}


def test_a_second_kernel_sizes_the_device_scratch_by_its_state():
    """Master, state and gradient in fp32, two raw buffers: AdamW's two moments take 8 bytes a param more
    than SGD without momentum."""
    updater = DeviceUpdater(Transport(CPU), capacity=100)
    assert updater.reserve(10, 1000, SGDKernel(0.0)) == 2 * (4 * 2 + 8) * 100
    assert updater.reserve(10, 1000, SGDKernel(0.9)) == 2 * (4 * 3 + 8) * 100
    assert updater.reserve(10, 1000, AdamWKernel()) == 2 * (4 * 4 + 8) * 100


def test_sgd_on_the_device_is_accepted_and_deepspeed_stays_adamw_only():
    assert "fused SGD kernel on the training device" in dataclasses.replace(SGD, implementation="device").kernel
    with pytest.raises(Exception, match="the deepspeed host optimizer is AdamW"):
        dataclasses.replace(SGD, implementation="deepspeed")


def sgd_run(spec, accumulate, dtype, max_norm=MAX_NORM, **kw):
    layers = full_layers(dtype)
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=accumulate, **kw)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        names = {
            f"{i}.{n}"
            for i, layer in enumerate(layers)
            for n, p in layer.named_parameters()
            if swapper.training.owns(p)
        }
        got = train_dgls(layers, swapper, CPU, "nonreentrant", accumulate=accumulate, dtype=dtype, max_norm=max_norm)
    want = train_reference(
        full_layers(dtype),
        names,
        CPU,
        "nonreentrant",
        accumulate=accumulate,
        dtype=dtype,
        max_norm=max_norm,
        host_spec=dataclasses.replace(spec, implementation="torch"),  # torch.optim.SGD, the single-tensor loop
    )
    return got, want


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize(
    "implementation, dtype, accumulate",
    [("device", torch.float32, 2), ("device", torch.bfloat16, 1), ("split", torch.bfloat16, 1)],
    ids=["device-sums", "device-flat", "split-flat"],
)
def test_sgd_device_updates_equal_unstreamed_training_with_torch_sgd(
    monkeypatch, implementation, dtype, accumulate, momentum
):
    """--host_adam device or split with [optimizer] type = 'sgd': the device path runs the SGD kernel (on the
    CPU here), every layer changing side every step when split; the numbers are torch.optim.SGD's."""
    if implementation == "split":
        flip_sides_every_step(monkeypatch)
    spec = dataclasses.replace(SGD, implementation=implementation, momentum=momentum)
    got, want = sgd_run(spec, accumulate, dtype, prefetch=1)
    assert_same(got, want)


def test_sgd_device_updates_without_clipping_and_with_threads_equal_unstreamed_training():
    spec = dataclasses.replace(SGD, implementation="device")
    got, want = sgd_run(spec, 1, torch.bfloat16, max_norm=None, clip_grads=False, threading=True, prefetch=2)
    assert_same(got, want)


def test_a_gradient_after_an_early_update_is_refused_in_one_line():
    """Without clipping a layer's update starts once its step's last micro-batch closed: a further backward
    before the step (more micro-batches than accumulation_steps) has no step to go to."""
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=SGD, accumulation_steps=1, clip_grads=False)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        with pytest.raises(DGLSUserError, match="more backward passes in a step than accumulation_steps"):
            train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=2, max_norm=None)


def test_a_layer_run_twice_under_reentrant_checkpointing_without_clipping_is_refused_as_such():
    """Reentrant checkpointing runs one backward per checkpointed call, so a layer called twice in a forward gets
    its hooks fired twice in one pass; without clipping its update started after the first: the line says so, not
    that accumulation_steps is wrong."""
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=SGD, accumulation_steps=1, clip_grads=False)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        loss = loss_of_a_layer_run_twice(layers, swapper)
        with pytest.raises(
            DGLSUserError, match="layer 1 got a second gradient in one backward pass .* clip_grads = True"
        ):
            loss.backward()
