"""Speculative updates under gradient clipping: a streamed layer's update starts as its gradients land, at clip
coefficient 1; a step that clips undoes it and redoes it with its coefficient. Bitwise the update that waits.

Why
    With clipping, an update needs the gradient norm over every param, known only when the backward ends: the
    whole step's updates then run after the backward, and the next forward waits for each layer's in turn. A step
    that does not clip has a coefficient of exactly 1, so its updates can run during the backward, as they do
    without clipping, if a step that does clip can take them back.

Exactness (what makes a kept speculative update the waiting update, bit for bit)
    - The coefficient is ``clamp(max_norm / (norm + 1e-6), max=1)``: 1.0 exactly when the step does not clip, and
      a gradient times 1.0 is the gradient (IEEE); an update run without the multiplication is the waiting one.
    - A step whose coefficient is anything else (it clips, or the norm is NaN), or whose lr is not the one the
      update ran at, undoes the update (:func:`undo`) and queues the waiting one: every value the update wrote is
      back bit for bit (fp32 master, optimizer state tensors, step counts, the param groups' lr; the compute-dtype
      copy is derived from the master and rewritten by the update that follows), and the same arithmetic runs on
      them.
    - Only optimizers whose whole state DGLS knows speculate: DGLS's AdamW and SGD on torch's kernels (host or
      device). A per-layer class ([optimizer] type) may keep state where an undo does not reach, and DeepSpeed's
      CPU Adam keeps its beta powers in its C++ object: they wait (:func:`undo_problem`); start-up says so.

Where the old values go (:class:`Spare`, one per layer, placed and counted by the training layout: 4 bytes a param
for the master and 4 per state tensor, AdamW 12, SGD with momentum 8, SGD without 4)
    - Host update (:func:`save`): the job copies the layer's master and state into the spare, then steps in place.
      Undo: a flat layer swaps the spare with its buffers (:func:`swap`); another copies the spare back.
    - Device update of a flat layer: the update's copies home write master and state into the spare, which then
      becomes the layer's (:func:`swap`): not a byte more crosses the link or host memory. Undo: swap back.
    - A layer the device updates per param (fp32 compute, several dtypes) or with a param without a gradient this
      step waits when its update is the device's. On CUDA a device update from host sums starts once the job that
      writes them ran (the training thread would wait for it in the backward, behind the host's other jobs): at a
      later layer's close or the backward's end (:meth:`~.host_training.HostTraining.backward_done`), else it
      waits for the norm.

Policy (:class:`Speculation`; it changes the speed, never the numbers)
    - The layers whose spares fit the host RAM left beside the training state speculate, the first in the forward
      first: their gradients land last, and the waiting updates of later layers get the forward of the first ones
      to catch up.
    - The first step speculates; a step after one that clipped waits (a run that clips at every step would undo
      every update). A host job not started when its step clips skips itself (``cancelled``).
    - A layer used again before the step (a second gradient this step, a fetch for a forward, a read of its weights)
      is undone first (:meth:`~.host_training.HostTraining.cancel`): before the step, everyone reads the weights
      from before it. A second gradient reopens the layer's step, which speculates again when its last batch closes;
      otherwise its update waits for the norm.

Threads
    - A :class:`Speculated` record is made, submitted (``side``) and ``cancelled`` on the training thread; the thread
      that runs the update fills ``ran``/``steps``/``absent``; :func:`undo` runs after that update, on whichever
      thread runs the redo or the cancel (after waiting for the update's job, and on CUDA for its copies home).
    - :func:`swap` re-points the layer's master and state views in place (``Tensor.set_``): the optimizer's keys,
      the flat params and the trained params keep their identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..memory.layout import TrainingLayout, human_bytes
from .grad_return import TrainedLayer
from .host_optimizer import HOST_OPTIMIZERS, HostOptimizerSpec

COUNTS = ("speculated", "kept", "redone", "cancelled")


def undo_problem(spec: HostOptimizerSpec) -> str | None:
    """Why updates of ``spec``'s optimizer cannot be undone exactly (they wait for the norm), or None: only DGLS's
    own kernels speculate (a whitelist: an optimizer type added later waits until its state is known)."""
    if spec.whole_step:
        return f"[optimizer] type {spec.type!r} steps one instance over every param, after the backward"
    if spec.per_layer or spec.type not in HOST_OPTIMIZERS:
        return (
            f"[optimizer] type {spec.type!r} steps its own class, whose state DGLS does not know well enough to undo "
            "a step (type 'adamw' or 'sgd' speculate)"
        )
    if spec.implementation == "deepspeed":
        return (
            "DeepSpeed's CPU Adam keeps its step's beta powers in its C++ object, which an undo does not reach "
            "(--host_adam torch_fused, device or split speculate)"
        )
    return None


def spares_for(spec: HostOptimizerSpec, clipping: bool, speculate: bool) -> str:
    """Which layers the training layout gives a spare (:class:`~..memory.layout.TrainingLayout`'s ``spares``)."""
    if not (clipping and speculate) or undo_problem(spec) is not None:
        return "none"
    return "flat" if spec.implementation == "device" else "all"


@dataclass(eq=False)
class Spare:
    """A layer's second fp32 master and state (see the module doc), the params at ``offsets`` (by position)."""

    masters: torch.Tensor
    state: dict[str, torch.Tensor]  # the optimizer's state keys (the device kernel's), in their order
    offsets: dict[int, int]
    shapes: dict[int, torch.Size]

    def views(self, position: int) -> tuple[torch.Tensor, ...]:
        """The master and then each state tensor of the param at ``position``, shaped as the param."""
        offset, shape = self.offsets[position], self.shapes[position]
        n = shape.numel()
        return tuple(b[offset : offset + n].view(shape) for b in (self.masters, *self.state.values()))


@dataclass(eq=False)
class Speculated:
    """One layer's speculative update of this step: where its old values are, filled by the side that ran it."""

    layer: TrainedLayer
    spare: Spare
    lr: float | None  # the lr it ran at
    side: str = ""  # "host" or "device", set when submitted
    cancelled: bool = False  # its result is not wanted: a job that has not started skips itself
    ran: bool = False  # it wrote the layer's values (an undo is due)
    steps: list[tuple[dict, torch.Tensor]] = field(default_factory=list)  # (param's state, its step count before)
    absent: set[int] = field(default_factory=set)  # ids of masters without optimizer state before (a first step)
    lrs: list[float] = field(default_factory=list)  # each param group's lr before (a host update writes its lr there)


def _steps(layer: TrainedLayer) -> list[tuple[dict, torch.Tensor]]:
    """Each param's state that counts steps, with its count now (a copy)."""
    state = layer.optimizer.state
    found = []
    for tp in layer.params:
        st = state.get(tp.master)
        if st and isinstance(st.get("step"), torch.Tensor):
            found.append((st, st["step"].clone()))
    return found


def save(record: Speculated) -> None:
    """Host update, before it steps (on the job's thread): the layer's master and state into the spare."""
    layer, spare = record.layer, record.spare
    record.steps = _steps(layer)
    record.lrs = [group["lr"] for group in layer.optimizer.param_groups]
    with torch.no_grad():
        _save(record, layer, spare)
    record.ran = True


def _save(record: Speculated, layer: TrainedLayer, spare: Spare) -> None:
    if layer.flat is not None:
        spare.masters.copy_(layer.flat.masters)
        for key, buffer in layer.flat.state.items():
            spare.state[key].copy_(buffer)
    else:
        keys = set(spare.state) | {"step"}
        for tp in layer.params:
            master, *states = spare.views(tp.position)
            master.copy_(tp.master)
            st = layer.optimizer.state.get(tp.master)
            if not st:
                record.absent.add(id(tp.master))
                continue
            if not set(st) <= keys:
                raise AssertionError(f"layer {layer.index}'s optimizer state has {sorted(st)}: an undo restores {keys}")
            for key, view in zip(spare.state, states):
                view.copy_(st[key])


def before_device_update(record: Speculated) -> None:
    """Device update, before it counts its steps: the counts to restore."""
    record.steps = _steps(record.layer)
    record.lrs = [group["lr"] for group in record.layer.optimizer.param_groups]
    record.ran = True


def undo(record: Speculated) -> None:
    """Put back every value ``record``'s update wrote (nothing if it never ran); the compute-dtype copies are the
    caller's (:func:`refresh_copies`, unless an update follows)."""
    if not record.ran:
        return
    layer, spare = record.layer, record.spare
    with torch.no_grad():
        if record.side == "device" or layer.flat is not None:
            swap(layer, spare)
        else:
            _copy_back(record, layer, spare)
    for st, step in record.steps:
        st["step"] = step
    for group, lr in zip(layer.optimizer.param_groups, record.lrs, strict=True):
        group["lr"] = lr  # a redo at the groups' own lr runs at the one the waiting update reads
    record.ran = False


def _copy_back(record: Speculated, layer: TrainedLayer, spare: Spare) -> None:
    for tp in layer.params:
        master, *states = spare.views(tp.position)
        tp.master.copy_(master)
        if id(tp.master) in record.absent:
            layer.optimizer.state.pop(tp.master, None)
            continue
        st = layer.optimizer.state[tp.master]
        for key, view in zip(spare.state, states):
            st[key].copy_(view)


def swap(layer: TrainedLayer, spare: Spare) -> None:
    """A flat layer's masters and state buffers trade places with its spare's; every view of them (masters, the
    optimizer's state) is re-pointed in place, so the optimizer and the flat params keep their tensors."""
    flat = layer.flat
    if flat is None:
        raise AssertionError(f"layer {layer.index} is not flat: its spare cannot take its buffers' place")
    flat.masters, spare.masters = spare.masters, flat.masters
    for key in flat.state:
        flat.state[key], spare.state[key] = spare.state[key], flat.state[key]
    with torch.no_grad():
        for fp in flat.params:
            _repoint(fp.master, flat.masters, fp.offset)
            st = layer.optimizer.state[fp.master]
            for key, buffer in flat.state.items():
                _repoint(st[key], buffer, fp.offset)


def _repoint(view: torch.Tensor, buffer: torch.Tensor, offset: int) -> None:
    """``view`` (contiguous) now shows ``buffer``'s elements from ``offset`` on."""
    view.set_(buffer.untyped_storage(), buffer.storage_offset() + offset, view.shape, view.stride())


def refresh_copies(layer: TrainedLayer) -> None:
    """The compute-dtype copies written again from the masters (after an undo that no update follows)."""
    with torch.no_grad():
        for tp in layer.params:
            if tp.packed is not None:
                tp.packed.copy_(tp.master)


def _every_param_stepped(layer: TrainedLayer) -> bool:
    g = layer.grads
    positions = set(g.direct.params) if g.direct is not None else set()
    return len(positions | g.summed) == len(layer.params)


class Speculation:
    """Which layers speculate, this step's records, and what happened to them (see the module doc)."""

    def __init__(self, spares: dict[int, Spare], line: str) -> None:
        self.spares = spares
        self.line = line  # the start-up line: what DGLS does with clipping, and why
        self.active = bool(spares)  # this step speculates (the last one did not clip)
        self.records: dict[int, Speculated] = {}
        self.counts = dict.fromkeys(COUNTS, 0)  # layer updates, since start-up
        self.clipped_steps = 0

    def start(self, layer: TrainedLayer, side: str, lr: float | None) -> Speculated | None:
        """A record for ``layer``'s update starting now on ``side``, or None: it waits for the norm."""
        spare = self.spares.get(layer.index)
        if not self.active or spare is None:
            return None
        if side == "device" and (layer.flat is None or not _every_param_stepped(layer)):
            return None
        record = Speculated(layer, spare, lr)
        self.records[layer.index] = record
        self.counts["speculated"] += 1
        return record

    def pop(self, idx: int) -> Speculated:
        return self.records.pop(idx)

    def step_begins(self, keep: bool) -> None:
        """The step's coefficient is known: its speculative updates stay (``keep``, lr allowing), or none is
        wanted any more (a job not started skips itself)."""
        if not keep:
            for record in self.records.values():
                record.cancelled = True

    def step_taken(self, clipped: bool) -> None:
        """After the step: the next one speculates unless this one clipped."""
        self.clipped_steps += clipped
        self.active = bool(self.spares) and not clipped

    def describe(self) -> str:
        """What happened since start-up, in a few words (benchmarks, the end of a run)."""
        c = self.counts
        return (
            f"{c['speculated']} layer updates speculated: {c['kept']} kept, {c['redone']} redone, "
            f"{c['cancelled']} undone before their step; {self.clipped_steps} steps clipped"
        )


def clipping_line(layout: TrainingLayout, spec: HostOptimizerSpec, clipping: bool, speculate: bool) -> str:
    """The start-up line of what DGLS does with clipping, for the spares ``layout`` ended up with."""
    head = "DGLS clipping: "
    if not layout.layers:
        return head + "no streamed layer trains on the host"
    if not clipping:
        return head + "none (clip_grads = False): each streamed layer's update starts as its gradients land"
    wait = head + "every streamed layer's update waits for the gradient norm (the end of backward): "
    if not speculate:
        return wait + "speculation is off (speculate_clipping = False)"
    if (problem := undo_problem(spec)) is not None:
        return wait + problem
    if not layout.spares_wanted:
        return wait + "device updates undo flat layers only (one compute dtype, bf16 or fp16), and none is"
    spare = sum(layout.spare_bytes(i) for i in layout.spares)
    wanted = sum(layout.spare_bytes(i) for i in layout.spares_wanted)
    per_param = 4 * (1 + len(layout.state_keys))
    if not layout.spares:
        budget = human_bytes(layout.spare_budget or 0)
        return wait + (
            f"the old values a speculative update keeps ({human_bytes(wanted)}, {per_param} bytes a param) do not fit "
            f"the {budget} of host RAM left beside the training state and the packed weights"
        )
    which = "the streamed layers' updates"
    if layout.spares != set(layout.spares_wanted):
        first = sorted(layout.spares)
        which = f"the updates of streamed layers {first[0]}-{first[-1]} ({len(first)} of {len(layout.spares_wanted)})"
    line = (
        f"{head}{which} start as their gradients land, at coefficient 1; a step that clips undoes them and redoes "
        f"them with its coefficient (bitwise the updates that wait for the norm), and the step after it waits. Old "
        f"values: {human_bytes(spare)} of host RAM ({per_param} bytes a param)"
    )
    if layout.spares != set(layout.spares_wanted):
        line += (
            f"; the other layers' updates wait for the norm: {human_bytes(wanted)} for all did not fit the "
            f"{human_bytes(layout.spare_budget or 0)} of host RAM left"
        )
    return line
