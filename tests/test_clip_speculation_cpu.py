"""Speculative updates under gradient clipping, on the CPU: each streamed layer's update starts as its gradients land,
at coefficient 1, and a step that clips undoes it and redoes it; the numbers are bitwise those of updates that wait
for the norm (the reference, tests/full_ft.py), over runs where some steps clip and some do not.

Six steps: the 1st does not clip (its speculative updates are kept), the 2nd clips (undone, redone), the 3rd waits
(the step before it clipped) and clips, the 4th waits and does not clip, the 5th speculates again (kept), the 6th
clips (undone, redone). ``drained``: the job worker ran every speculative host job before the norm (so each is undone
for real); otherwise a job the clipping step reaches first skips itself.
"""

import dataclasses

import pytest
import torch
from full_ft import (
    DEVICE,
    FUSED,
    MAX_NORM,
    NEVER_CLIPS,
    SGD,
    SGD_DEVICE,
    SPEC,
    SPLIT,
    assert_same,
    differs,
    flip_sides_every_step,
    full_layers,
    host_trained_names,
    train_dgls,
    train_reference,
)

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.memory import host_store
from utils.dgls.memory.layout import TrainingLayout, measure
from utils.dgls.training import grad_return, host_training, speculation
from utils.dgls.training.host_optimizer import HostOptimizerSpec
from utils.dgls.training.speculation import clipping_line, undo_problem

CPU = torch.device("cpu")
BF16 = torch.bfloat16
NORMS = [NEVER_CLIPS, MAX_NORM, MAX_NORM, NEVER_CLIPS, NEVER_CLIPS, MAX_NORM]


def drain(training) -> None:
    """Every job queued so far runs (the deferred worker runs a job only when something waits for it)."""
    training.jobs.worker.drain()


def speculated_run(spec, dtype=BF16, accumulate=1, norms=NORMS, drained=True, told=None, lines=None, **kw):
    """DGLS and the reference over ``norms`` (one a step); the reference runs torch's fused kernel for DGLS's
    device path (torch.optim.SGD for SGD, whose single-tensor and fused CPU numbers agree)."""
    layers = full_layers(dtype)
    told = accumulate if told is None else told
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=told, **kw)
    log = lines.append if lines is not None else None
    with LayerSwapper(layers, cfg, device=CPU, log=log) as swapper:
        names = host_trained_names(layers, swapper)
        got = train_dgls(
            layers, swapper, CPU, "nonreentrant", steps=len(norms), accumulate=accumulate, dtype=dtype,
            max_norm=norms, before_clip=drain if drained else None,
        )  # fmt: skip
        training = swapper.training
    reference_spec = FUSED if spec.on_device and spec.type == "adamw" else spec
    want = train_reference(
        full_layers(dtype), names, CPU, "nonreentrant", steps=len(norms), accumulate=accumulate, dtype=dtype,
        max_norm=norms, host_spec=reference_spec,
    )  # fmt: skip
    return got, want, training


@pytest.mark.parametrize(
    "spec, dtype, accumulate, drained",
    [
        (SPEC, torch.float32, 2, True),  # fp32: the packed copies are the masters; sums
        (FUSED, BF16, 1, True),  # fp32 masters, the landings read directly
        (FUSED, BF16, 1, False),
        (SGD, BF16, 1, True),  # a momentum buffer that a first step creates (an undo removes it again)
        (DEVICE, BF16, 1, True),  # flat layers: the copies home go to the spare, which swaps in
        (DEVICE, BF16, 1, False),
        (DEVICE, BF16, 2, True),  # flat layers stepped per param from the sums
        (SGD_DEVICE, BF16, 1, True),
    ],
    ids=[
        "host-fp32-sums", "host-fused-bf16", "host-fused-bf16-deferred", "sgd-host", "device-flat",
        "device-flat-deferred", "device-sums", "sgd-device",
    ],
)  # fmt: skip
def test_speculated_updates_equal_updates_that_wait_for_the_norm(spec, dtype, accumulate, drained):
    got, want, training = speculated_run(spec, dtype, accumulate, drained=drained)
    assert_same(got, want)
    layers = len(training.layers)
    counts = training.speculation.counts
    assert counts == {"speculated": 4 * layers, "kept": 2 * layers, "redone": 2 * layers, "cancelled": 0}
    assert training.speculation.clipped_steps == 3


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["per-param", "flat"])
def test_split_updates_changing_side_every_step_speculate_on_either_side(monkeypatch, dtype):
    """Every layer changes side at every step: a speculative update on one side is undone where its redo runs, on
    the other. On the device side only flat layers speculate (fp32 layers wait there: still exact)."""
    flip_sides_every_step(monkeypatch)
    got, want, training = speculated_run(SPLIT, dtype)
    assert_same(got, want)
    counts = training.speculation.counts
    assert counts["kept"] > 0 and counts["redone"] > 0
    assert (counts["speculated"] == 4 * len(training.layers)) == (dtype == BF16)


@pytest.mark.parametrize("spec", [SPEC, DEVICE, SPLIT], ids=["host", "device", "split"])
def test_a_clipping_step_that_skips_the_undo_gives_other_numbers(monkeypatch, spec):
    """The mutation: speculative updates of steps that clip are not undone before their redo."""
    monkeypatch.setattr(speculation, "undo", lambda record: None)
    got, want, _ = speculated_run(spec)
    assert differs(got, want)


def test_a_clipping_step_taken_for_one_that_does_not_gives_other_numbers(monkeypatch):
    """The mutation: the speculative updates of a step that clips are kept (its coefficient ignored)."""
    step = host_training.HostTraining.step

    def keep_all(self, lr=None):
        self._coef = None
        step(self, lr)

    monkeypatch.setattr(host_training.HostTraining, "step", keep_all)
    got, want, _ = speculated_run(SPEC)
    assert differs(got, want)


@pytest.mark.parametrize("spec, threading", [(SPEC, False), (DEVICE, True)], ids=["host", "device-threads"])
def test_a_layer_used_again_before_its_step_is_undone_first(spec, threading):
    """Told one micro-batch a step, given two: each layer's update starts at the first one's end, then the second
    forward fetches the layer and its grads arrive; the update is undone before both (the forward sees the weights
    from before the step) and starts again at the second's end."""
    norms = [NEVER_CLIPS, MAX_NORM, NEVER_CLIPS]
    got, want, training = speculated_run(
        spec, torch.float32 if spec is SPEC else BF16, 2, norms, told=1, threading=threading
    )
    assert_same(got, want)
    counts = training.speculation.counts
    layers = len(training.layers)
    assert counts == {"speculated": 4 * layers, "kept": layers, "redone": layers, "cancelled": 2 * layers}


def test_without_speculation_updates_wait_and_no_ram_is_taken_for_it():
    lines = []
    got, want, training = speculated_run(SPEC, lines=lines, speculate_clipping=False)
    assert_same(got, want)
    assert training.speculation.counts["speculated"] == 0 and "speculation" not in training.layout.parts()
    assert any(line.startswith("DGLS clipping: every streamed layer's update waits") for line in lines)


# ---------------------------------------------------------------- host RAM and the start-up line
def spare_storages(training) -> int:
    """Bytes of the distinct storages the spares hold."""
    storages = {}
    for spare in training.speculation.spares.values():
        for tensor in (spare.masters, *spare.state.values()):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize(
    "spec, per_param", [(SPEC, 12), (SGD, 8), (dataclasses.replace(SGD, momentum=0.0), 4), (DEVICE, 12)]
)
def test_the_ram_figure_and_the_start_up_line_count_the_spares(spec, per_param):
    lines = []
    layers = full_layers(BF16)
    with LayerSwapper(layers, SwapConfig.of(host_optimizer=spec), device=CPU, log=lines.append) as swapper:
        training = swapper.training
        params = sum(layer.numel for layer in training.layers.values())
        assert training.layout.parts()["speculation"] == per_param * params == spare_storages(training)
    (ram,) = [line for line in lines if line.startswith("DGLS host training:")]
    (clip,) = [line for line in lines if line.startswith("DGLS clipping:")]
    assert "speculation" in ram and f"({per_param} bytes a param)" in clip and "undoes" in clip


def with_ram_beside_the_reserve(monkeypatch, spare_bytes: int) -> None:
    """The RAM check sees the training state's figure (without spares), the packed weights and ``spare_bytes`` more
    beside the host's reserve (the RAM rule, host_store.ram_room, sees it: the pinned budget and the rest of the
    program see the host as it is)."""

    class Memory:
        total = 64 * 2**30  # reserve: 6.4 GiB
        available = 0

    def room() -> tuple[int, int]:
        return Memory.available, host_store.ram_reserve(Memory.total)

    def check(layout, **kw):
        parts = layout.parts()
        parts.pop("speculation", None)
        beside = sum(parts.values()) + layout.packed_bytes + spare_bytes
        Memory.available = host_store.ram_reserve(Memory.total) + beside
        return real(layout, **kw)

    import utils.dgls.engine.build as build

    real = build.check_host_training
    monkeypatch.setattr(host_store, "ram_room", room)  # the RAM rule (ram_short reads it here) sees this host
    monkeypatch.setattr(host_training, "ram_room", room)  # and the spares' room, imported by name
    monkeypatch.setattr(build, "check_host_training", check)


def test_spares_the_ram_does_not_hold_leave_the_last_layers_waiting(monkeypatch):
    """Room for the spares of the first two streamed layers only (in half of the RAM left): those speculate, the
    others wait (the start-up line says which and why), and the numbers stay the reference's."""
    probe = full_layers(BF16)
    with LayerSwapper(probe, SwapConfig.of(host_optimizer=SPEC), device=CPU, log=None) as swapper:
        layout = swapper.training.layout
        first_two = sum(layout.spare_bytes(i) for i in sorted(layout.layers)[:2])
        streamed = sorted(layout.layers)
    with_ram_beside_the_reserve(monkeypatch, 2 * first_two + 100)  # the spares take half of what is left
    lines = []
    got, want, training = speculated_run(SPEC, lines=lines)
    assert_same(got, want)
    assert set(training.speculation.spares) == set(streamed[:2])
    assert training.speculation.counts["speculated"] == 4 * 2
    (clip,) = [line for line in lines if line.startswith("DGLS clipping:")]
    assert f"streamed layers {streamed[0]}-{streamed[1]} (2 of {len(streamed)})" in clip
    assert "the other layers' updates wait for the norm" in clip


def test_no_room_for_any_spare_makes_every_update_wait_and_says_so(monkeypatch):
    with_ram_beside_the_reserve(monkeypatch, 100)
    lines = []
    got, want, training = speculated_run(SPEC, lines=lines)
    assert_same(got, want)
    assert training.speculation.counts["speculated"] == 0
    (clip,) = [line for line in lines if line.startswith("DGLS clipping:")]
    assert "waits for the gradient norm" in clip and "do not fit" in clip and "12 bytes a param" in clip


def test_the_clipping_line_says_why_updates_wait():
    layouts = dict(enumerate(measure(full_layers(), host_trained=True)))  # fp32: no layer is flat
    layout = TrainingLayout(layouts, state_keys=(), sums=False, device_updates=False)
    assert "none (clip_grads = False)" in clipping_line(layout, SPEC, clipping=False, speculate=True)
    assert "speculate_clipping = False" in clipping_line(layout, SPEC, clipping=True, speculate=False)
    deepspeed = dataclasses.replace(SPEC, implementation="deepspeed")
    assert "C++ object" in clipping_line(layout, deepspeed, clipping=True, speculate=True)
    assert undo_problem(SPEC) is None and undo_problem(SGD_DEVICE) is None
    device = TrainingLayout(layouts, state_keys=(), sums=False, device_updates=True, spares="flat")
    assert "flat layers only" in clipping_line(device, DEVICE, clipping=True, speculate=True)
    nothing = TrainingLayout({}, state_keys=(), sums=False, device_updates=False)
    assert "no streamed layer" in clipping_line(nothing, SPEC, clipping=True, speculate=True)


def test_a_per_layer_optimizer_class_waits_for_the_norm():
    """A class DGLS does not know the whole state of steps after the norm, exactly as before; start-up says so."""
    pytest.importorskip("pytorch_optimizer")
    spec = HostOptimizerSpec.from_table({"type": "Lion", "lr": 1e-4, "weight_decay": 0.01})
    assert "steps its own class" in undo_problem(spec)
    whole = HostOptimizerSpec.from_table({"type": "Prodigy", "lr": 1.0})
    assert "one instance over every param, after the backward" in undo_problem(whole)
    lines = []
    got, want, training = speculated_run(spec, lines=lines)
    assert_same(got, want)
    assert not training.speculation.spares and "speculation" not in training.layout.parts()
    assert any("steps its own class" in line for line in lines if line.startswith("DGLS clipping:"))


class LooksLikeCuda:
    """The training's transport, but ``cuda`` (device updates still run as the CPU backend's jobs)."""

    cuda = True

    def __init__(self, transport) -> None:
        self._transport = transport

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


@pytest.mark.parametrize("sums_written", [False, True], ids=["sums-pending", "sums-written"])
def test_on_cuda_a_device_update_from_host_sums_starts_once_they_are_written(monkeypatch, sums_written):
    """On CUDA the training thread enqueues device updates, and one from host sums would wait there, in the
    backward, for the job writing them: it starts at a later close or the backward's end if that job ran by then
    (``sums_written``: each accumulate job runs as it is queued), else it waits for the norm. Exact either way."""
    init = host_training.HostTraining.__init__

    def looking_like_cuda(self, *args, **kw):
        init(self, *args, **kw)
        self.transport = LooksLikeCuda(self.transport)

    monkeypatch.setattr(host_training.HostTraining, "__init__", looking_like_cuda)
    if sums_written:
        submit_sum = grad_return.GradReturn._submit_sum

        def written(self, layer, batch, last):
            job = submit_sum(self, layer, batch, last)
            self.jobs.wait(job)
            return job

        monkeypatch.setattr(grad_return.GradReturn, "_submit_sum", written)
    got, want, training = speculated_run(DEVICE, BF16, accumulate=2, drained=False)
    assert_same(got, want)
    assert training.speculation.counts["speculated"] == (4 * len(training.layers) if sums_written else 0)


@pytest.mark.parametrize("spec", [SPEC, SPLIT], ids=["host", "split"])
def test_a_redo_at_the_groups_lr_runs_at_the_lr_from_before_the_speculative_update(monkeypatch, spec):
    """Early updates told one lr (``set_step_lr``), the step none (each group's own): every speculative update is
    redone, and its redo runs at the group's lr from before it, as the update that waits does (the host's
    speculative update wrote its lr into the group; an undo puts the group's lr back too)."""
    if spec is SPLIT:
        flip_sides_every_step(monkeypatch)
    norms = [NEVER_CLIPS, MAX_NORM, NEVER_CLIPS]
    runs = []
    for speculate in (True, False):
        layers = full_layers(BF16)
        cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=1, speculate_clipping=speculate)
        with LayerSwapper(layers, cfg, device=CPU) as swapper:
            swapper.training.set_step_lr(10 * spec.lr)
            runs.append(train_dgls(layers, swapper, CPU, "nonreentrant", steps=3, accumulate=1, dtype=BF16,
                                   max_norm=norms, before_clip=drain))  # fmt: skip
            if speculate:
                assert swapper.training.speculation.counts["redone"] > 0
    assert_same(*runs)
