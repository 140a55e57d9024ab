"""Gradient return: host-trained params' gradients taken off the device, sent home in groups, and summed.

Layout (per trained layer; the buffers are the training layout's, :class:`~..memory.layout.TrainingLayout`)
    - :class:`TrainedParam`: a param's fp32 master, its pinned landing (compute dtype) and its fp32 sum;
    - :class:`LayerGrads`: the layer's gradient state this step (:class:`GradState`), its open batch and
      the group of grads still on the device, the params already summed, and the norms clipping reads.

Mechanics
    1. A param's grad arriving is a use of its layer (``grad_arriving``, before autograd accumulates it: a
       streamed param's shape is empty while it is out). Its post-accumulate-grad hook takes it off the
       param (``param.grad = None``: the trainer's optimizer skips the param) into the layer's group.
    2. A group goes home (the transport's gradients-home direction, one copy a group) once it holds
       ``SEND_GROUP_BYTES``, its layer's last grad, or a grad of another layer, so at most that much plus
       one grad waits on the device, and the backward's thread pays one stream switch (and, for a batch
       read directly, one norm kernel) a group, not a param.
    3. When every param of the layer sent (or the backward ends) the batch closes: read directly by the
       update (one micro-batch a step, nothing summed yet: no fp32 pass on the host), or summed by an
       *accumulate* job (the first batch of a step copies, as autograd assigns a first grad). On a step's
       last micro-batch the job also takes each summed param's norm, for clipping.
    4. The update takes the step's gradients (:meth:`LayerGrads.take`): the direct batch and the summed
       params, with the job the sums wait for. With clipping, a layer's update may start on a step's last
       batch before the norm is known (:mod:`.speculation`): the gradients stay with the layer until the step
       (its norms are read, and a step that clips redoes the update from them).

States (:class:`LayerGrads`, one per layer; each transition is a method that asserts its start state)::

    transition     from                    to              when
    open           IDLE, SUMMED            OPEN            a grad of a new batch arrives
    close_direct   OPEN                    DIRECT          the batch closes, one micro-batch a step, nothing summed
    close_summed   OPEN                    SUMMED          the batch closes into the sums (an accumulate job)
    promote        DIRECT                  SUMMED          a second batch arrives: the first is summed after all
    take           IDLE, DIRECT, SUMMED,   IDLE            the step queues (or keeps) the layer's update
                   SPECULATED
    take_early     DIRECT, SUMMED          QUEUED          no clipping: the step's last batch closed
    settle         QUEUED                  IDLE            the step leaves the update queued early
    speculate      DIRECT, SUMMED          SPECULATED      clipping: the step's last batch closed; the update
                                                           starts at coefficient 1
    reopen         SPECULATED              DIRECT, SUMMED  the speculative update was undone before the step

- IDLE: nothing of this step yet, or its update took the step's gradients (``take`` also from IDLE:
  a layer without a gradient still gets its update).
- OPEN: a batch collects grads; groups go home as they fill.
- DIRECT: closed; the update reads its landings (one micro-batch a step, nothing summed).
- SUMMED: closed into the fp32 sums; ``summing`` is the job that writes them. A grad arriving opens
  the next batch once that job ran (it reads the landings the new batch's copies rewrite).
- QUEUED: the update was queued during backward (no clipping); the step leaves it (``settle``).
- SPECULATED: the update was queued during backward at coefficient 1 (clipping); the gradients and norms stay
  until the step, which keeps the update or redoes it (``take``). A grad arriving first undoes it (``reopen``,
  through ``reopen_speculated``): the layer waits for the norm again.

Threads
    - Every transition, and every field of :class:`LayerGrads` and :class:`TrainedParam`, is written by the
      training thread only (the backward's hooks, the step).
    - Jobs (:class:`~.jobs.Jobs`: the transport's job worker) get what they read as arguments and write only
      tensors (landings read, sums written) and their own :attr:`~.jobs.Job.result`; the training thread reads
      a result after :meth:`~.jobs.Jobs.wait` (the job's ``done`` event is the happens-before).

Hazards handled
    - A landing is rewritten by the next batch's copy only after the job summing it ran (the hook waits
      for ``summing`` before ``open``); a landing the update reads directly is rewritten only after a
      forward that waited for that update (the engine's fetch,
      :meth:`~.host_training.HostTraining.wait_update`).
    - A grad waiting in a group is referenced only by the group; once sent, the transport keeps its
      device memory until the copy ran.
    - A param with no grad in a step keeps its layer's batch open to the end of the backward, but its
      group goes home when the next layer's grads begin: unsent grads never pile up across layers.
    - A second batch of a layer read directly (told one micro-batch a step, given two) sums the first on
      the host before its landings are rewritten (``promote``), in sums allocated then (beyond the
      training layout's figure).
    - Without clipping, a grad arriving after its layer's update was queued is refused in one line: it would
      belong to no step. Either more micro-batches came than ``accumulation_steps``, or (in the pass that
      queued it) the layer ran twice under reentrant checkpointing, whose backwards each fire the hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import DGLSUserError
from ..memory.host_store import HostLayer
from ..memory.transport import Copy, Direction, Transport
from .device_update import FlatLayer
from .jobs import Job, Jobs
from .optimizer_kernels import grad_norms

if TYPE_CHECKING:  # device_sums imports this module's sum_gradient
    from .device_sums import DeviceSums

SEND_GROUP_BYTES = 64 * 2**20  # a layer's grads wait on the device until this many bytes go home together


# ---------------------------------------------------------------- per-layer state
@dataclass(eq=False)
class TrainedParam:
    position: int  # in the layer's layout
    param: nn.Parameter
    master: torch.Tensor  # fp32, host
    packed: torch.Tensor | None  # the compute-dtype copy an update rewrites (None: the master is that copy)
    landing: torch.Tensor  # compute dtype, pinned on CUDA
    acc: torch.Tensor | None = None  # fp32 gradient sum of a step (None: one micro-batch a step, until needed)


@dataclass(eq=False)
class GradBatch:
    """One layer's gradients from one backward pass, sent home in groups (one transport copy each)."""

    layer: int
    copies: list[Copy] = field(default_factory=list)  # its groups' copies home, in order
    params: set[int] = field(default_factory=set)  # positions of the params whose grads were sent
    done: Copy | None = None  # once closed: all of its copies (the transport's join of them)


@dataclass(frozen=True)
class StepGrads:
    """What one update reads: each trained param's gradient of the step, from its landing or its sum."""

    direct: GradBatch | None  # params read from their landings, after ``direct.done``
    summed: frozenset[int]  # positions of the params read from their sums
    summing: Job | None  # the job that writes the sums last (an update comes after it)


class GradState(Enum):
    IDLE = "idle"  # nothing of this step yet (or its update was taken)
    OPEN = "open"  # a batch collects grads; its groups go home as they fill
    DIRECT = "direct"  # closed: the update reads its landings
    SUMMED = "summed"  # closed into the fp32 sums (``summing`` writes them)
    QUEUED = "queued"  # its update was queued during backward (no clipping); the step leaves it
    SPECULATED = "speculated"  # its update was queued during backward at coefficient 1 (clipping; .speculation)


@dataclass(eq=False)
class LayerGrads:
    """A layer's gradient state this step (see the module doc); written by the training thread only."""

    index: int
    state: GradState = GradState.IDLE
    batch: GradBatch | None = None  # OPEN: the batch collecting
    group: list[tuple[TrainedParam, torch.Tensor]] = field(default_factory=list)  # OPEN: grads not sent yet
    group_bytes: int = 0
    direct: GradBatch | None = None  # DIRECT: the batch the update reads
    summed: set[int] = field(default_factory=set)  # positions with a sum this step
    summing: Job | None = None  # the latest accumulate job (its landings are read until it ran)
    direct_norms: dict[int, torch.Tensor] = field(default_factory=dict)  # DIRECT: device norms, by position

    def open(self, batch: GradBatch) -> None:
        """IDLE or SUMMED -> OPEN: a grad of a new batch arrived (the previous batch's sum ran)."""
        self._expect(GradState.IDLE, GradState.SUMMED)
        self.batch = batch
        self.state = GradState.OPEN

    def close_direct(self) -> GradBatch:
        """OPEN -> DIRECT: the update will read this batch from its landings."""
        self._expect(GradState.OPEN)
        batch, self.batch = self.batch, None
        self.direct = batch
        self.state = GradState.DIRECT
        return batch

    def close_summed(self, job: Job) -> GradBatch:
        """OPEN -> SUMMED: ``job`` sums this batch into the fp32 sums."""
        self._expect(GradState.OPEN)
        batch, self.batch = self.batch, None
        self.summed |= batch.params
        self.summing = job
        self.state = GradState.SUMMED
        return batch

    def promote(self, job: Job) -> None:
        """DIRECT -> SUMMED: a second batch came; ``job`` sums the first one on the host after all."""
        self._expect(GradState.DIRECT)
        self.summed |= self.direct.params
        self.direct, self.summing = None, job
        self.direct_norms.clear()
        self.state = GradState.SUMMED

    def take(self) -> StepGrads:
        """IDLE, DIRECT, SUMMED or SPECULATED -> IDLE: the step's gradients go to the update."""
        self._expect(GradState.IDLE, GradState.DIRECT, GradState.SUMMED, GradState.SPECULATED)
        grads = self._handed_over()
        self.state = GradState.IDLE
        return grads

    def take_early(self) -> StepGrads:
        """DIRECT or SUMMED -> QUEUED: the last micro-batch closed without clipping; the update starts now."""
        self._expect(GradState.DIRECT, GradState.SUMMED)
        grads = self._handed_over()
        self.state = GradState.QUEUED
        return grads

    def settle(self) -> None:
        """QUEUED -> IDLE: the step that the early update belongs to was taken."""
        self._expect(GradState.QUEUED)
        self.state = GradState.IDLE

    def speculate(self) -> StepGrads:
        """DIRECT or SUMMED -> SPECULATED: the update starts on the step's gradients, which stay here (the norm
        reads them; a step that clips redoes the update from them)."""
        self._expect(GradState.DIRECT, GradState.SUMMED)
        self.state = GradState.SPECULATED
        return StepGrads(self.direct, frozenset(self.summed), self.summing)

    def reopen(self) -> None:
        """SPECULATED -> DIRECT or SUMMED: the speculative update was undone; the layer waits for the norm."""
        self._expect(GradState.SPECULATED)
        self.state = GradState.DIRECT if self.direct is not None else GradState.SUMMED

    def _handed_over(self) -> StepGrads:
        grads = StepGrads(self.direct, frozenset(self.summed), self.summing)
        self.direct, self.summing = None, None
        self.summed = set()
        self.direct_norms = {}
        return grads

    def _expect(self, *states: GradState) -> None:
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise AssertionError(f"layer {self.index}'s gradients are {self.state.value}, expected {allowed}")


@dataclass(eq=False)
class TrainedLayer:
    index: int
    host: HostLayer
    params: list[TrainedParam]  # layout order (hooks, batches)
    optimizer: torch.optim.Optimizer | None  # None: a whole step's one instance steps it (:mod:`.whole_step`)
    # the params in the optimizer's order, with their param groups (the optimizer's current dicts: a checkpoint
    # load replaces them, and :func:`~.host_training._regroup` re-points these)
    in_groups: list[tuple[TrainedParam, dict]] = field(default_factory=list)
    numel: int = 0  # trained params
    flat: FlatLayer | None = None  # device updates in bf16/fp16: masters, state and landings back to back
    grads: LayerGrads = field(init=False)  # its gradient state this step
    update: Job | None = None  # the latest update job not yet waited for (a fetch waits for it)
    home: Copy | None = None  # the latest device update's copy home, once known on the training thread

    def __post_init__(self) -> None:
        self.grads = LayerGrads(self.index)


# ---------------------------------------------------------------- the gradient return
class GradReturn:
    """The hooks, groups, batches and sums of the host-trained layers (see the module doc)."""

    def __init__(
        self,
        layers: dict[int, TrainedLayer],
        transport: Transport,
        jobs: Jobs,
        *,
        direct: bool,
        clipping: bool,
        accumulation_steps: int,
        late: bool,
        new_sum: Callable[[torch.Size], torch.Tensor],
        last_closed: Callable[[TrainedLayer], None],
        reopen_speculated: Callable[[TrainedLayer], None],
    ) -> None:
        self.layers = layers
        self.transport = transport
        self.jobs = jobs
        self.direct = direct  # one micro-batch a step: updates read the landings when they can
        self.clipping = clipping
        self.accumulation_steps = accumulation_steps
        self._late = late  # the CPU backend lands the gradients late (a missing wait computes with NaN)
        self._new_sum = new_sum  # an fp32 sum allocated after start-up (a second batch read directly)
        self._last_closed = last_closed  # a layer's step's last batch closed (its update may start)
        self._reopen_speculated = reopen_speculated  # undo a layer's speculative update (it waits for the norm)
        self._owner_of = {id(tp.param): (layer, tp) for layer in layers.values() for tp in layer.params}
        self._hooks: dict[int, list] = {}  # layer -> its params' hook handles
        self._grouping: TrainedLayer | None = None  # the layer whose grads arrived last (the only open group)
        self._backwards = 0  # backward passes since the last step
        self._queued_in: dict[int, int] = {}  # layer -> the pass (``_backwards``) its update started in
        self.device_sums: DeviceSums | None = None  # the layer-major schedule's: grads summed on the device first

    def owns(self, param: torch.Tensor) -> TrainedParam | None:
        owner = self._owner_of.get(id(param))
        return owner[1] if owner is not None else None

    # ---------------------------------------------------------------- hooks
    def install(self, grad_arriving: Callable[[int], None]) -> None:
        for layer in self.layers.values():
            hooks = self._hooks.setdefault(layer.index, [])
            for tp in layer.params:
                param = tp.param
                hooks.append(param.register_hook(partial(_before_accumulate, grad_arriving, layer.index)))
                hooks.append(param.register_post_accumulate_grad_hook(partial(self._grad_ready, layer, tp)))

    def remove_hooks(self) -> None:
        for index in list(self._hooks):
            self._remove_hooks(index)

    def _remove_hooks(self, index: int) -> None:
        for handle in self._hooks.pop(index, []):
            handle.remove()

    def forget(self, layer: TrainedLayer) -> None:
        """``layer`` no longer trains on the host (its hooks removed; the caller took its gradients and drops
        it from ``layers``)."""
        self._remove_hooks(layer.index)
        for tp in layer.params:
            self._owner_of.pop(id(tp.param), None)
        if self._grouping is layer:
            self._grouping = None

    def _grad_ready(self, layer: TrainedLayer, tp: TrainedParam, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: take the grad off the param into its layer's group."""
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if self.device_sums is not None:  # None: summed on the device; the sum comes back through _take
            grad = self.device_sums.add(param, grad, partial(self._take, layer, tp), (layer.index, tp.position))
            if grad is None:
                return
        self._take(layer, tp, grad)

    def receive(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``param``'s gradient handed over outside its hook (data parallel: the mean reduced to this process, the
        param's owner, :mod:`.data_parallel`, also of a device sum flushed after its layer's micro-batches): taken as
        the hook takes one, past the device sums (under the layer-major schedule it is the step's sum already)."""
        layer, tp = self._owner_of[id(param)]
        self._take(layer, tp, grad)

    def _take(self, layer: TrainedLayer, tp: TrainedParam, grad: torch.Tensor) -> None:
        """``grad`` (``tp``'s gradient, off the param) into its layer's group."""
        g = layer.grads
        if g.state is GradState.OPEN and tp.position in g.batch.params:  # a second grad in one pass: its own batch
            self._close(layer)
        if g.state is not GradState.OPEN:
            if g.state is GradState.SPECULATED:  # its update started before this grad: undone, it waits
                self._reopen_speculated(layer)
            if g.state is GradState.QUEUED:  # started early: no clipping, or clip_mode previous_norm
                started, wait = "without clipping", "set clip_grads = True"
                if self.clipping:
                    started, wait = "with clip_mode previous_norm", "use clip_mode exact"
                if self._queued_in.get(layer.index) == self._backwards:
                    raise DGLSUserError(
                        f"layer {layer.index} got a second gradient in one backward pass (it runs more than once, with "
                        f"reentrant checkpointing: each run's backward is its own), and {started} its update "
                        f"started after the first: {wait} (updates then wait for the step), or checkpoint with "
                        "use_reentrant=False"
                    )
                raise DGLSUserError(
                    f"layer {layer.index} got gradients from more backward passes in a step than accumulation_steps "
                    f"({self.accumulation_steps}) says, and {started} its update had started: set "
                    "accumulation_steps to the micro-batches of each optimizer step"
                )
            if g.state is GradState.DIRECT:  # a second batch this step: sum on the host after all
                self._promote(layer)
            if g.summing is not None:
                self.jobs.wait(g.summing)  # its landings are still being read
            g.open(GradBatch(layer.index))
        if self._grouping is not layer:  # another layer's grads began: its group goes now, not at its close
            if self._grouping is not None:
                self._send_group(self._grouping)
            self._grouping = layer
        g.batch.params.add(tp.position)
        g.group.append((tp, grad))
        g.group_bytes += grad.nbytes
        if len(g.batch.params) == len(layer.params):
            self._close(layer)
        elif g.group_bytes >= SEND_GROUP_BYTES:
            self._send_group(layer)

    def _send_group(self, layer: TrainedLayer) -> None:
        """Send the grads the open batch holds on the device: one stream switch and, where the update reads
        the landings directly, one norm kernel for the group (the norms clipping needs, taken before the
        grads leave the device)."""
        g = layer.grads
        group, g.group, g.group_bytes = g.group, [], 0
        if not group:
            return
        grads = [grad for _, grad in group]
        if self.direct and self.clipping and not g.summed:  # this batch is read directly
            for (tp, _), norm in zip(group, grad_norms(grads), strict=True):
                g.direct_norms[tp.position] = norm
        pairs = [(tp.landing, grad) for (tp, _), grad in zip(group, grads)]
        copy = self.transport.submit(Direction.GRADS_HOME, pairs, after_compute=True, late=self._late)
        g.batch.copies.append(copy)

    def _close(self, layer: TrainedLayer) -> None:
        self._send_group(layer)
        g = layer.grads
        g.batch.done = self.transport.join(g.batch.copies)
        last = self._backwards + 1 >= self.accumulation_steps
        if self.direct and not g.summed:
            g.close_direct()  # the update reads the landings: no host pass over the gradients
        else:
            batch = g.batch
            job = self._submit_sum(layer, batch, last)
            g.close_summed(job)
        if last:  # no clipping: nothing to wait for; clipping: the update may start on speculation
            self._queued_in[layer.index] = self._backwards  # read if it started early (QUEUED) and a grad comes
            self._last_closed(layer)

    def _promote(self, layer: TrainedLayer) -> None:
        """A layer read straight from its landings got a second batch this step: sum its first one on the
        host (an accumulate job) before the landings are rewritten."""
        layer.grads.promote(self._submit_sum(layer, layer.grads.direct, True))

    def _submit_sum(self, layer: TrainedLayer, batch: GradBatch, last: bool) -> Job:
        """Queue the job adding ``batch`` into the sums (copying into those not summed yet this step)."""
        g = layer.grads
        work = []
        for tp in layer.params:
            if tp.position in batch.params:
                if tp.acc is None:
                    tp.acc = self._new_sum(tp.param.shape)
                work.append((tp.position, tp.landing, tp.acc, tp.position not in g.summed))
        norms = last and self.clipping
        return self.jobs.submit(layer.index, "accumulate", partial(_accumulate, self.transport, batch, work, norms))

    def backward_done(self) -> None:
        """The backward pass ended: close the batches of layers that did not get every grad."""
        for layer in self.layers.values():
            if layer.grads.state is GradState.OPEN:
                self._close(layer)
        self._backwards += 1

    def step_taken(self) -> None:
        """The step's updates were queued: the next backward is a step's first micro-batch."""
        self._backwards = 0
        self._queued_in.clear()

    # ---------------------------------------------------------------- norms (clipping)
    def host_norms(self) -> dict[int, tuple[torch.Tensor, bool]]:
        """Every host-trained param with a gradient this step: its norm, and whether that norm is on the
        device (taken before the grad was sent) rather than on the host (of its sum). Waits for the sums."""
        norms: dict[int, tuple[torch.Tensor, bool]] = {}
        for layer in self.layers.values():
            g = layer.grads
            summed = self.jobs.wait(g.summing) if g.summing is not None else None
            for tp in layer.params:
                if tp.position in g.direct_norms:
                    norms[id(tp.param)] = (g.direct_norms[tp.position], True)
                elif tp.position in g.summed:
                    norm = summed.get(tp.position) if summed else None
                    norms[id(tp.param)] = (norm if norm is not None else grad_norms([tp.acc])[0], False)
        return norms


def _accumulate(
    transport: Transport, batch: GradBatch, work: list[tuple[int, torch.Tensor, torch.Tensor, bool]], norms: bool
) -> dict[int, torch.Tensor]:
    """The accumulate job: land ``batch``, then each (position, landing, sum, first): copy the landing into the
    sum (first) or add it. Returns the sums' norms by position (``norms``: the step's last micro-batch)."""
    transport.land(batch.done)
    taken = {}
    with torch.no_grad():
        for position, landing, acc, first in work:
            sum_gradient(acc, landing, first)
            if norms:
                taken[position] = grad_norms([acc])[0]
    return taken


def sum_gradient(acc: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """Add a micro-batch's ``grad`` into the fp32 sum ``acc``: the step's first is copied (as autograd assigns a first
    grad), each later one added, in micro-batch order. The one implementation of a step's gradient sum: the host's
    accumulate job and the layer-major device sums (:mod:`.device_sums`) both call it, so their sums are the same."""
    if first:
        acc.copy_(grad)
    else:
        acc.add_(grad)


def _before_accumulate(grad_arriving: Callable[[int], None], idx: int, grad: torch.Tensor) -> None:
    grad_arriving(idx)
