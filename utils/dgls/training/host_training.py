"""Host training: full fine-tuning of streamed layers, with fp32 masters and the optimizer in host memory.

A thin facade over three parts, each with its own module doc:

- the training layout (:class:`~..memory.layout.TrainingLayout`): where masters, gradient landings, sums and
  optimizer state go in host memory; the same object allocates them and answers the RAM check
  (:func:`check_host_training`);
- the gradient return (:class:`~.grad_return.GradReturn`): hooks, groups sent home, batches, sums, with
  a per-layer :class:`~.grad_return.GradState`;
- the update strategy (:mod:`.updaters`): host, device or split, the device's arithmetic an
  :class:`~.optimizer_kernels.OptimizerKernel` (AdamW, SGD); or for an optimizer whose step sums over every param
  (Prodigy ...), one instance over all of them stepped after the backward (:mod:`.whole_step`), which the trainer
  hands its params to (:meth:`HostTraining.adopt`) and whose resident params' gradients it takes before the
  trainer's optimizer steps (:meth:`HostTraining.take_resident_grads`).

What the trainer calls
    1. Backward: the hooks take each grad off its param and send it home (the trainer's optimizer skips
       host-trained params: they have no ``.grad``); :meth:`backward_done` closes what stayed open.
    2. ``clip_grad_norm_(params, max_norm)``: one norm over host and device params (device norms on the
       device, host norms from the sums or taken on the device before the grads left), the coefficient
       applied to device grads now and to host grads in the update.
    3. ``step(lr)``: each layer's update, in layer order (the next forward's order). The engine's fetch of
       a layer waits for that layer's update only (:meth:`wait_update`), so the forward of layer k runs
       while layers after k are updated. Without clipping (``clipping=False``) a layer's update is queued
       as soon as its step's last micro-batch closed, at the lr the trainer gave for this step
       (:meth:`set_step_lr`), and
       ``step`` queues only the layers that had no gradient. With clipping, the same happens on speculation
       (:mod:`.speculation`): the update runs at coefficient 1, and ``step`` keeps it (the step did not clip) or
       queues its undo and the update with the coefficient. With ``clip_mode`` ``previous_norm`` (opt-in, inexact:
       :mod:`.previous_norm`) updates start as without clipping, at the previous step's coefficient.

With a VRAM budget (``first_step``, the planner's): step 1 is the planner's probe, and its plan may hand layers to
the trainer before their first update (:mod:`..planning.autoplan`). Until the first step's updates are queued, none
starts during backward; :meth:`before_step` (the trainer calls it before its optimizer step; clipping calls it)
lets the planner fix its plan, and :meth:`release` gives the layers it made resident back with their gradients.

Threads
    - Per-layer state (:class:`~.grad_return.LayerGrads`, ``layer.update``, ``layer.home``) is written by
      the training thread only; jobs on the transport's job worker (its thread on CUDA or with
      ``threaded``, deferred otherwise: a job runs only when something waits for it, so a missing wait
      changes the numbers in a CPU test) get their inputs as arguments and hand back results that are
      read after waiting for them.

Hazards handled
    - Slot copies made before an update hold old weights: the engine evicts every host-trained layer at
      the end of each backward (:meth:`~..engine.swapper.LayerSwapper.pass_end`), so the next use fetches anew.
      Evicted params point at empty placeholders, so a trainer that zero-fills missing grads
      (DeepSpeed's gradient reduction) allocates nothing.
    - A param with no grad in a step is skipped by its optimizer, as one without ``.grad`` is.
    - Before the step, every reader sees the weights from before it: a speculated layer fetched, given another
      gradient, or read (:meth:`finish`) is undone first (:meth:`cancel`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from functools import partial

import torch

from ..errors import DGLSUserError
from ..memory.host_store import HostLayer, ram_room, ram_short
from ..memory.layout import LayerLayout, TrainingLayout, human_bytes
from ..memory.peers import NO_OTHERS, Others, others_on_machine
from ..memory.pinned import PinnedMemory
from ..memory.transport import Copy, Direction, Transport
from . import optimizer_types, previous_norm, speculation
from .data_parallel import agree
from .device_update import DeviceUpdater, FlatLayer, FlatParam
from .disk_state import DiskState
from .grad_return import SEND_GROUP_BYTES, GradReturn, GradState, TrainedLayer, TrainedParam
from .host_optimizer import HostOptimizerSpec
from .jobs import Job, Jobs
from .optimizer_kernels import grad_norms
from .previous_norm import PreviousNorm
from .speculation import Spare, Speculation, clipping_line, refresh_copies, spares_for
from .update_split import UpdateSplit
from .updaters import DeviceSide, HostUpdater, SplitUpdater, Updater, update_threads
from .whole_step import STATE_KEY, WholeStep

# the RAM check's advice where a VRAM budget places the layers (check_host_training's ``probe``)
PROBE_ADVICE = (
    "a VRAM budget's first step streams every layer (its probe): replace the budget with a placement by hand "
    "(gpu_layers or blocks_to_swap; each layer kept on the GPU takes its share off this figure: --plan prints the "
    "placement the budget would choose), or free RAM"
)

__all__ = [
    "SEND_GROUP_BYTES",
    "HostTraining",
    "check_deferred_state",
    "check_host_training",
    "grad_norms",
    "host_training_bytes",
    "training_layout",
    "update_buffer_bytes",
    "update_threads",
]


def training_layout(
    layouts: Mapping[int, LayerLayout],
    spec: HostOptimizerSpec,
    accumulation_steps: int = 1,
    clipping: bool = True,
    speculate: bool = True,
) -> TrainingLayout:
    """The training layout of the streamed layers ``layouts`` for ``spec`` (sums with several micro-batches a
    step, or a whole step, whose update comes after the next backward could rewrite the landings; with one
    micro-batch, per-layer updates read the landings; spares where updates speculate under clipping). An own class's
    state is counted as measured on it, on fp32 masters (:meth:`~.host_optimizer.HostOptimizerSpec.state_rate`)."""
    return TrainingLayout(
        layouts,
        state_keys=spec.state_keys,
        state_bytes=spec.state_rate(torch.float32).bytes if spec.own_class else None,
        sums=accumulation_steps != 1 or spec.whole_step,
        device_updates=spec.on_device,
        spares=spares_for(spec, clipping, speculate),
        one_group=spec.gradient_release,  # :meth:`~.host_optimizer.HostOptimizerSpec.groups`
        state_at_start=spec.split,  # the split updater prepares every layer's state (HostTraining._strategy)
    )


def reserve_sizes(layout: TrainingLayout) -> tuple[int, int]:
    """The largest trained param and the largest layer's trained params (elements) of ``layout``: what the device
    update buffers are sized for (:meth:`~.device_update.DeviceUpdater.reserve`)."""
    sizes = [[p.numel for p in place.params] for place in layout.layers.values()]
    return max(max(s) for s in sizes), max(sum(s) for s in sizes)


def update_buffer_bytes(layout: TrainingLayout, spec: HostOptimizerSpec) -> int:
    """Device bytes of the update buffers :class:`HostTraining` reserves for ``layout`` (0 with host updates, or with
    nothing trained on the host): the VRAM planner's figure."""
    if not spec.on_device or not layout.layers:
        return 0
    return DeviceUpdater.reserved_bytes(*reserve_sizes(layout), spec.device_kernel())


class HostTraining:
    """Host masters, gradient returns and the host optimizer of the streamed layers (see the module doc)."""

    def __init__(
        self,
        layers: dict[int, HostLayer],
        spec: HostOptimizerSpec,
        transport: Transport,
        *,
        pin: bool,
        threaded: bool,
        accumulation_steps: int = 1,
        clipping: bool = True,
        updater: DeviceUpdater | None = None,
        layout: TrainingLayout | None = None,
        first_step: Callable[[bool], None] | None = None,
        speculate: bool = True,
        host_norm_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        after_step: Callable[[Callable[[Callable[[int], None]], None]], None] | None = None,
        disk_state: DiskState | None = None,
        clip_mode: str = "exact",
        processes_here: int = 1,
    ) -> None:
        """``first_step``: the VRAM planner's, called once before the first step's clipping or updates (True), or at
        its updates when nothing came first (False); until the first step's updates are queued, none starts
        during backward (see the module doc). Data parallel (:mod:`.data_parallel`): ``host_norm_sum`` sums the
        host-trained part of the squared gradient norm over the processes that each train a share of the layers;
        ``after_step(when_written)`` runs once a step's updates are queued (the share's publication,
        :meth:`when_written`). ``disk_state``: the masters and optimizer state of the layers it spilled live on disk
        (:mod:`.disk_state`; host updates).
        ``clip_mode`` ``previous_norm``: updates start early at the previous step's coefficient (:mod:`.previous_norm`;
        the training policy refuses what it cannot combine with). ``processes_here``: the job's processes on this
        machine, whose host updates share its cores (:func:`.updaters.update_threads`)."""
        self.disk_state = disk_state
        self.processes_here = processes_here
        self._host_norm_sum = host_norm_sum
        self._after_step = after_step
        self.spec, self.implementation = spec, spec.kernel
        self._first_step = first_step
        self._hold = first_step is not None
        self.transport = transport  # gradients home (its CPU backend lands them late unless ``threaded``)
        self.worker = transport.job_worker  # the jobs (accumulations, host updates) run on its thread, or deferred
        self.jobs = Jobs(self.worker)
        # clip_mode previous_norm: the previous step's coefficient, the early layers' norms (.previous_norm)
        self.previous_norm = PreviousNorm(self.jobs) if clipping and clip_mode == previous_norm.MODE else None
        self.updater = updater  # the device's updates (device and split), None for host updates
        self.accumulation_steps = accumulation_steps
        self.clipping = clipping
        # with one micro-batch a step, updates read it straight from its landings (no fp32 sum on the host)
        self.direct = accumulation_steps == 1 and not spec.whole_step
        self._step_lr: float | None = None  # the lr of early updates (clipping off); None: each group's
        self._closed: dict[int, TrainedLayer] = {}  # clipping: step's last batch closed, not speculated on yet
        self.layout = layout or training_layout(
            {i: h.layout for i, h in layers.items()}, spec, accumulation_steps, clipping, speculate
        )
        if self.layout.device_updates != (updater is not None):
            raise AssertionError("the training layout was placed for another update strategy than this one")
        # landings, and for device updates masters, sums and state: page-locked at their exact size
        # (:mod:`..memory.pinned`)
        self._memory = PinnedMemory(pin, "stream fewer layers (blocks_to_swap), or free RAM")
        self._coef: torch.Tensor | None = None
        self._finite = True  # this step's norm is finite (clip_mode previous_norm: else the next step waits)
        if updater is not None and self.layout.layers:
            self.device_bytes = updater.reserve(*reserve_sizes(self.layout), spec.device_kernel())
        else:
            self.device_bytes = 0  # device updates: their scratch buffers
        spares: dict[int, Spare] = {}
        self.layers: dict[int, TrainedLayer] = {i: self._layer(i, layers[i], spares) for i in self.layout.layers}
        # clipping: which layers' updates start before the norm is known, and what became of them (.speculation)
        if self.previous_norm is not None:
            line = previous_norm.clipping_line(len(self.layout.layers))
        else:
            line = clipping_line(self.layout, spec, clipping, speculate)
        self.speculation = Speculation(spares, line)
        self.grads = GradReturn(
            self.layers,
            transport,
            self.jobs,
            direct=self.direct,
            clipping=clipping,
            accumulation_steps=accumulation_steps,
            late=not threaded,
            new_sum=self._new_sum,
            last_closed=self._update_early,
            reopen_speculated=self.cancel,
        )
        self.updates = self._strategy(spec)
        self.whole = self.updates if isinstance(self.updates, WholeStep) else None  # a whole step's instance
        if threaded:
            self.worker.start()

    def _strategy(self, spec: HostOptimizerSpec) -> Updater:
        largest = max((layer.numel for layer in self.layers.values()), default=0)
        if spec.whole_step:
            return WholeStep(self.jobs, spec, self.layers)
        if self.updater is None:
            return HostUpdater(
                self.jobs, self.transport, largest, disk=self.disk_state, processes_here=self.processes_here
            )
        if not spec.split:
            return DeviceSide(self.jobs, self.updater)
        sizes = {idx: layer.numel for idx, layer in self.layers.items()}
        # else updates trickle in during backward
        all_at_once = self.clipping and not self.speculation.spares and self.previous_norm is None
        split = SplitUpdater(self.jobs, self.transport, self.updater, sizes, all_at_once, self.processes_here)
        for layer in self.layers.values():
            if layer.flat is None:  # flat layers have theirs
                self.updater.prepare(layer.optimizer)  # pinned state, found by either side
        return split

    def _layer(self, idx: int, host: HostLayer, spares: dict[int, Spare]) -> TrainedLayer:
        """Layer ``idx``'s buffers from the training layout, its masters filled, its optimizer built (its spare
        into ``spares``, if it has one)."""
        place = self.layout.layers[idx]
        buffers = self.layout.allocate(idx, self._memory.empty, _plain)
        if buffers.spare_masters is not None:
            shapes = {p.position: p.param.shape for p in place.params}
            offsets = self.layout.spare_offsets(idx)
            spares[idx] = Spare(buffers.spare_masters, buffers.spare_state, offsets, shapes)
        params = []
        with torch.no_grad():
            for p, master, landing, acc in zip(place.params, buffers.masters, buffers.landings, buffers.sums):
                packed = host.master_view(p.position)
                if master is None:
                    master, packed = packed, None  # the packed copy is the fp32 master itself
                else:
                    master.copy_(p.param.param.data if p.param.param.numel() else packed)
                params.append(TrainedParam(p.position, p.param.param, master, packed, landing, acc))
        optimizer = None if self.spec.whole_step else self.spec.build([tp.master for tp in params])
        in_groups = _in_groups(params, optimizer) if optimizer is not None else []
        layer = TrainedLayer(idx, host, params, optimizer, in_groups, place.numel)
        if place.flat:
            flat = []
            for (tp, group), p in zip(layer.in_groups, sorted(place.params, key=lambda p: p.flat)):
                if tp.position != p.position:  # spec.build's order must be the one the buffers were laid out in
                    raise AssertionError("the flat layout does not follow the optimizer's param order")
                flat.append(FlatParam(p.flat, p.numel, tp.master, tp.packed, group))
            layer.flat = FlatLayer(buffers.flat_masters, buffers.landing, flat, buffers.flat_state)
            self.updater.prepare(optimizer, layer.flat)
        if self.disk_state is not None and idx in self.disk_state.spilled:
            self.disk_state.adopt(layer)  # its masters to the file now: one layer's masters in RAM at a time
        return layer

    def _new_sum(self, shape: torch.Size) -> torch.Tensor:
        """An fp32 sum allocated after start-up (pinned for device updates, which copy it in asynchronously)."""
        return self._memory.zeros(shape, torch.float32) if self.layout.device_updates else torch.zeros(shape)

    # ---------------------------------------------------------------- what the engine calls
    def install(self, grad_arriving: Callable[[int], None]) -> None:
        """Hooks on every host-trained param: before its grad is accumulated, ``grad_arriving(layer)`` (the
        engine makes the layer resident: autograd writes ``.grad`` with the param's shape, and a streamed
        param's shape is empty while it is out); after, the grad is sent home."""
        self.grads.install(grad_arriving)

    def remove_hooks(self) -> None:
        self.grads.remove_hooks()

    def backward_done(self) -> None:
        """The backward pass ended: close the batches of layers that did not get every grad (and start the
        speculative updates that can start now)."""
        self.grads.backward_done()
        self._start_speculation()

    def pinned_bytes(self) -> int:
        """Page-locked bytes this module holds: landings, and for device updates the masters, sums and
        state (packed copies are the host store's), counted where they are allocated."""
        return self._memory.nbytes + self.updates.pinned_bytes()

    def owns(self, param: torch.Tensor) -> bool:
        return self.grads.owns(param) is not None

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s fp32 master (a copy read from the file where it lives on disk: call :meth:`finish` first)."""
        tp = self.grads.owns(param)
        if tp is None:
            return None
        if self.disk_state is not None and tp.packed is not None:
            spilled = (self.layers[i] for i in self.disk_state.spilled if i in self.layers)
            layer = next((lay for lay in spilled if any(t is tp for t in lay.params)), None)
            if layer is not None:
                return self.disk_state.master(layer, tp.position)
        return tp.master

    @property
    def split(self) -> UpdateSplit | None:
        """Split updates: which side updates each layer (:class:`~.update_split.UpdateSplit`), else None."""
        return self.updates.split

    @property
    def waited_s(self) -> float:
        """Seconds the training thread spent blocked on host jobs (updates, accumulations)."""
        return self.jobs.waited_s

    @property
    def job_s(self) -> dict[str, float]:
        """Seconds the host spent on each kind of job."""
        return self.jobs.job_s

    def check(self) -> None:
        self.worker.check()

    def finish(self) -> None:
        """Run every job submitted so far, and bring every device update home (state dicts, removal). Speculative
        updates are undone first: their step has not come."""
        for layer in self.layers.values():
            if layer.grads.state is GradState.SPECULATED:
                self.cancel(layer)
            if layer.grads.summing is not None:
                self.jobs.wait(layer.grads.summing)
            self.updates.settle(layer)
        self.transport.synchronize(Direction.GRADS_HOME)
        self.updates.synchronize()
        if self.disk_state is not None:
            self.disk_state.settle()

    def when_written(self, written: Callable[[int], None]) -> None:
        """``written(idx)`` for every layer once its latest update is in its packed copy (data parallel's
        publication, :mod:`.data_parallel`): a job queued after the layer's update (one queue: after it, and after
        an undo and redo), which lands a device update's copy home first, so ``written`` runs on the job thread after
        the writes. Without a job thread (jobs run when waited for, and another process waits for these), every
        update is written first (:meth:`finish`), then ``written`` runs for each layer here."""
        if not self.worker.threaded:
            self.finish()
            for idx in self.layers:
                written(idx)
            return
        for layer in self.layers.values():
            if layer.grads.state is GradState.SPECULATED:  # as finish: its step has not come
                self.cancel(layer)
            previous = layer.update if layer.update is not None else layer.home
            self.jobs.submit(layer.index, "publish", partial(self._written, layer.index, previous, written))

    def _written(self, idx: int, previous: Job | Copy | None, written: Callable[[int], None]) -> None:
        """The publication job of layer ``idx`` (:meth:`when_written`), on the job thread after its update."""
        home = previous.result.home if isinstance(previous, Job) else previous
        if home is not None:
            self.transport.land(home)
        written(idx)

    def wait_update(self, idx: int) -> Copy | None:
        """Before layer ``idx``'s packed copy is streamed: its latest update must be written. Host updates
        are waited for here; for a device update on CUDA the copy its fetch must wait for is returned."""
        layer = self.layers.get(idx)
        if layer is None:
            return None
        if layer.grads.state is GradState.SPECULATED:  # a use before the step: the weights from before it
            self.cancel(layer)
        return self.updates.settle(layer)

    # ---------------------------------------------------------------- what the trainer calls
    def clip_grad_norm_(
        self,
        params: Iterable[torch.Tensor],
        max_norm: float,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One gradient norm over ``params`` (host-trained ones from their sums or their device norms, the
        others from ``.grad``), in their order; device grads are scaled now, host ones in :meth:`step`.
        ``reduce`` sums the squared norm over other processes that hold other layers (pipeline stages).
        Returns the total norm (a CPU float32 tensor)."""
        if not self.clipping:
            raise DGLSUserError(
                "gradient clipping was asked for, but DGLS was told there is none (clip_grads = False), so the host "
                "updates of streamed layers ran during backward: set clip_grads = True"
            )
        self.before_step()
        host = self.grads.host_norms()
        if self.previous_norm is not None:  # the layers whose updates started hold their norms there
            host.update(self.previous_norm.norms())
        norms: list[torch.Tensor | int] = []  # a host norm, or the index of a device one
        trained_here: list[bool] = []  # each norm's: a host-trained param's (True) or a resident one's
        on_device: list[torch.Tensor] = []
        device_grads = []
        for p in params:
            if self.grads.owns(p) is not None:
                if id(p) in host:
                    norm, device = host[id(p)]
                    norms.append(len(on_device) if device else norm)
                    trained_here.append(True)
                    if device:
                        on_device.append(norm)
            elif p.grad is not None:
                norms.append(len(on_device))
                trained_here.append(False)
                on_device.append(torch.linalg.vector_norm(p.grad.detach().float(), 2))
                device_grads.append(p.grad)
        if on_device:  # one copy home for all of them
            fetched = torch.stack([n.to(on_device[0].device) for n in on_device]).cpu().unbind()
            norms = [fetched[n] if isinstance(n, int) else n for n in norms]
        if self._host_norm_sum is not None:  # data parallel: each process holds its share of the host-trained norms
            zero = torch.zeros((), dtype=torch.float32)
            mine = [n for n, h in zip(norms, trained_here) if h]
            resident = [n for n, h in zip(norms, trained_here) if not h]
            squared = self._host_norm_sum(torch.stack(mine).square().sum() if mine else zero)
            squared = squared + (torch.stack(resident).square().sum() if resident else zero)
        else:
            squared = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float32)
        if reduce is not None:
            squared = reduce(squared)
        total = squared.sqrt()
        coef = torch.clamp(torch.tensor(float(max_norm), dtype=torch.float32) / (total + 1e-6), max=1.0)
        applied = self.previous_norm.applied(coef) if self.previous_norm is not None else coef
        for grad in device_grads:
            grad.detach().mul_(applied.to(grad.device))
        self._coef, self._finite = coef, bool(total.isfinite())
        return total

    def before_step(self) -> None:
        """Before the trainer's optimizer step (and its clipping): the first one lets the VRAM planner fix its plan,
        which may :meth:`release` layers to the trainer; later ones do nothing."""
        self._fix_plan(True)

    def _fix_plan(self, in_time: bool) -> None:
        """The VRAM planner's one re-placement, before the first step's updates (``in_time``: before the trainer's
        optimizer step too), which may :meth:`release` layers; then the RAM check of the optimizer state the first
        updates of the layers still streamed make (:func:`check_deferred_state`). Later calls do nothing."""
        first, self._first_step = self._first_step, None
        if first is not None:
            # every stage fixes its plan at the same step: the machine's processes check their state together, and
            # all stop with the first refusal any of them met (the plan's own included)
            problem = None
            try:
                first(in_time)
            except DGLSUserError as exc:
                problem = str(exc)
            others = others_on_machine(self.layout.deferred_state() if problem is None else 0)
            if problem is None:
                try:
                    check_deferred_state(self.layout, in_time, others)
                except DGLSUserError as exc:
                    problem = str(exc)
            agree(problem)

    def release(self, indices: Iterable[int]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Stop training layers ``indices`` on the host, before any update of theirs ran (the VRAM planner made them
        resident; the trainer's optimizer trains them from this step on). Returns each of their params that has a
        gradient this step with that gradient, a host tensor in the param's compute dtype, for the caller to put
        on the device; their hooks are removed and their host buffers unpinned."""
        out: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        released = sorted(set(indices) & set(self.layers))
        for idx in released:
            layer = self.layers[idx]
            g = layer.grads
            started = (GradState.OPEN, GradState.QUEUED, GradState.SPECULATED)
            if layer.update is not None or layer.home is not None or g.state in started:
                raise AssertionError(f"layer {idx} is released to the trainer after its update began")
            if g.summing is not None:
                self.jobs.wait(g.summing)
            if g.direct is not None:
                self.transport.land(g.direct.done)
            for tp in layer.params:
                if g.direct is not None and tp.position in g.direct.params:
                    out.append((tp.param, tp.landing.clone()))
                elif tp.position in g.summed:
                    out.append((tp.param, tp.acc.to(tp.landing.dtype, copy=True)))
            self.grads.forget(layer)
            del self.layers[idx]
            self.layout.layers.pop(idx, None)
            self.layout.spares -= {idx}  # its spare is freed below: parts() and the clipping line count the rest
            self.layout.spares_wanted = tuple(i for i in self.layout.spares_wanted if i != idx)
            if self.updates.split is not None:
                self.updates.split.sizes.pop(idx, None)
                self.updates.split.on_device.pop(idx, None)
            if self.updater is not None:
                self.updater.forget(layer.optimizer)
            spare = self.speculation.spares.pop(idx, None)
            spared = [spare.masters, *spare.state.values()] if spare is not None else []
            flat = [layer.flat.masters, layer.flat.landings, *layer.flat.state.values()] if layer.flat else []
            for t in [
                *flat,
                *spared,
                *(t for tp in layer.params for t in (tp.landing, tp.master, tp.acc) if t is not None),
            ]:
                self._memory.free(t)  # a view at a buffer's start frees the buffer; other tensors are not its
        if self.whole is not None and released:
            self.whole.released()  # built before the plan: over these layers' masters, without their params' copies
        return out

    def step(self, lr: float | None = None) -> None:
        """Queue every layer's update (layer order); ``lr`` overrides the spec's (a schedule's current lr)."""
        if self.previous_norm is not None and self._coef is None:  # resident params unscaled, host ones scaled
            raise DGLSUserError(
                "clip_mode previous_norm scales every update of a step by the previous step's clip coefficient, but "
                "this step was not clipped (the trainer stepped without clip_grad_norm_): clip every step, or use "
                "clip_mode exact"
            )
        self._fix_plan(False)  # the trainer may have stepped already: the planner keeps the placement
        coef, self._coef = self._coef, None
        exact, finite, self._finite = coef, self._finite, True
        if self.previous_norm is not None:  # every update of the step at the previous step's coefficient
            coef = self.previous_norm.applied(coef)
        self._closed.clear()  # not started: they wait, as the norm is known
        keep = coef is None or bool(coef == 1.0)  # the step does not clip: speculative updates are its own
        self.speculation.step_begins(keep)
        self.updates.begin_step(self.layers)
        for layer in self.layers.values():
            for tp in layer.params:
                tp.param.grad = None  # a trainer may have zero-filled it (DeepSpeed's gradient reduction)
            if layer.grads.state is GradState.QUEUED:
                layer.grads.settle()
            elif layer.grads.state is GradState.SPECULATED:
                record = self.speculation.pop(layer.index)
                grads = layer.grads.take()
                if keep and record.lr == lr:
                    self.speculation.counts["kept"] += 1
                else:  # undone where the update with the coefficient runs, just before it
                    self.speculation.counts["redone"] += 1
                    self.updates.submit(layer, grads, coef, lr, undo=record)
            else:
                self.updates.submit(layer, layer.grads.take(), coef, lr)
        self.updates.end_step()
        self.grads.step_taken()
        self._hold = False
        self.speculation.step_taken(clipped=not keep)
        if self.previous_norm is not None:
            self.previous_norm.step_taken(exact, finite)
        if self._after_step is not None:
            self._after_step(self.when_written)

    def mirror_logged_state(self, trainer: torch.optim.Optimizer, device: torch.device) -> None:
        """Per-layer classes whose values train.py logs from its own instance (``logged_state``: Automagic's
        ``avg_lr``, stacked over every param of it): that instance holds the streamed params but never steps them
        (DGLS steps one instance per layer), so each streamed param's value is copied into its state, on
        ``device`` (beside the resident params' values). Logging only: the trainer's instance has no gradient for
        these params, so nothing it does reads them. Read while this step's host updates may still run: a value
        lags a step at most, and before a layer's first update it is its group's lr (the class's starting value)."""
        kind = optimizer_types.TYPES.get(self.spec.type)
        keys = kind.logged_state if kind is not None else ()
        if not keys or not isinstance(trainer, torch.optim.Optimizer):  # a DeepSpeed wrapper: train.py logs nothing
            return
        targets, values = [], []  # gathered on the host, moved in one copy (one per step, not one per param)
        for layer in self.layers.values():
            if layer.optimizer is None:
                continue
            for tp, group in layer.in_groups:
                state = layer.optimizer.state.get(tp.master, {})
                for key in keys:
                    value = state.get(key)  # a number as it is; the class's start (the group's lr) if none yet
                    value = value if value is not None else group["lr"]
                    targets.append((trainer.state[tp.param], key))
                    values.append(torch.as_tensor(value, dtype=torch.float32).reshape(()))
        if values:
            moved = torch.stack(values).to(device)
            for (state, key), value in zip(targets, moved.unbind()):
                state[key] = value

    def adopt(self, params: Iterable[torch.Tensor]) -> None:
        """A whole step (:mod:`.whole_step`): the stage's params in the trainer's order, before its first step or
        checkpoint; the instance steps the resident ones too. Otherwise nothing."""
        if self.whole is not None:
            self.whole.adopt(params)

    def take_resident_grads(self) -> None:
        """A whole step: after clipping, before the trainer's optimizer steps, the resident params' gradients go to
        the host instance (the trainer's finds none). Otherwise nothing."""
        if self.whole is not None:
            self.whole.take_resident_grads()

    def set_step_lr(self, lr: float | None) -> None:
        """The lr this step's early updates (no clipping) run at: the trainer's, read before its backward passes
        (its scheduler moves it only after the step). None: each param group's own."""
        self._step_lr = lr

    def _update_early(self, layer: TrainedLayer) -> None:
        """The layer's step's last batch closed. No clipping: its update starts now, at this step's lr. Clipping:
        so it does on speculation, at coefficient 1, where the layer has a spare and this step speculates. Neither
        in the VRAM planner's probe step, whose layers may still change hands: :meth:`step` queues them."""
        if self._hold:
            return
        if not self.clipping:
            self.updates.submit(layer, layer.grads.take_early(), None, self._step_lr)
            return
        if self.previous_norm is not None:  # at the previous step's coefficient; step 1 waits for its own
            if self.previous_norm.ready:
                grads = self.previous_norm.take(layer)
                self.updates.submit(layer, grads, self.previous_norm.previous, self._step_lr)
            return
        if not self.speculation.active:
            return
        self._closed[layer.index] = layer
        self._start_speculation()

    def _start_speculation(self) -> None:
        """Start the speculative update of each layer whose step's last batch closed, where it can start without
        a wait: on CUDA a device update copies the layer's host sums in, so it waits for the job writing them."""
        for idx, layer in list(self._closed.items()):
            g = layer.grads
            if g.state not in (GradState.DIRECT, GradState.SUMMED):
                del self._closed[idx]  # another batch came; its close puts it back
                continue
            side = self.updates.side(layer)
            if self.transport.cuda and side == "device" and g.summing is not None and not g.summing.done.is_set():
                continue
            del self._closed[idx]
            record = self.speculation.start(layer, side, self._step_lr)
            if record is not None:
                self.updates.submit(layer, g.speculate(), None, self._step_lr, speculated=record)

    def cancel(self, layer: TrainedLayer) -> None:
        """Undo ``layer``'s speculative update before its step (a use of the layer meanwhile); its gradients reopen,
        and it speculates again only if another batch closes them, else waits for the norm. Rare, so done here, on
        the training thread: after the update's job, and its copies home."""
        record = self.speculation.pop(layer.index)
        record.cancelled = True  # a job not started yet skips itself
        home = self.updates.settle(layer)
        if home is not None:
            self.transport.land(home)
        if record.ran:
            speculation.undo(record)
            refresh_copies(layer)
        self.speculation.counts["cancelled"] += 1
        layer.grads.reopen()

    def state_dict(self) -> dict:
        """The optimizer state of every host-trained layer (the masters are in the model's state dict)."""
        self.finish()
        if self.whole is not None:
            return self.whole.state_dict()
        if self.disk_state is None:
            return {idx: layer.optimizer.state_dict() for idx, layer in self.layers.items()}
        out = {}
        for idx, layer in self.layers.items():
            with self.disk_state.held(layer):  # a spilled layer's state is copied while it is read in
                out[idx] = _copied(layer.optimizer.state_dict()) if idx in self.disk_state.spilled else None
            out[idx] = out[idx] or layer.optimizer.state_dict()
        return out

    def state_problem(self, state: object, keep_hyper_parameters: bool = False) -> str | None:
        """Why ``state`` (a :meth:`state_dict` read back from a checkpoint) cannot be loaded into these layers, or
        None: it must hold the optimizer state of exactly these layers, each param's state of that param's shape
        and of this optimizer's kind. torch's own ``load_state_dict`` checks only the number of params, so a
        checkpoint saved with another placement or optimizer would load into the wrong layers, or be dropped.
        SGD on the device: unless ``keep_hyper_parameters``, the saved momentum must be zero exactly where this
        run's is (the device's kernel has a momentum buffer only with momentum, sized at start-up). A whole step's
        state is its instance's (:meth:`.whole_step.WholeStep.state_problem`)."""
        if self.whole is not None:
            return self.whole.state_problem(state)
        if isinstance(state, dict) and STATE_KEY in state:
            return (
                "holds one optimizer's state over every param (a type whose step sums over them), and [optimizer] "
                f"type {self.spec.type!r} steps one optimizer per layer here: resume with the [optimizer] type it was "
                "saved with, or pass --reset_optimizer"
            )
        if not isinstance(state, dict) or not all(isinstance(v, dict) and "state" in v for v in state.values()):
            return "holds no per-layer optimizer states"
        try:
            saved = {int(k): v for k, v in state.items()}
        except (TypeError, ValueError):
            return "holds no per-layer optimizer states (its keys are not layer numbers)"
        if set(saved) != set(self.layers):
            return (
                f"holds the optimizer state of layers {sorted(saved)} of this pipeline stage, and this run trains "
                f"layers {sorted(self.layers)} of it on the host: resume with the placement it was saved with (the "
                "same --blocks_to_swap or --gpu_layers, and pipeline_stages)"
            )
        for idx, layer in self.layers.items():
            groups = saved[idx].get("param_groups")
            if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
                return f"holds no optimizer state for layer {idx}"
            if (problem := self.spec.saved_state_problem(idx, groups, layer.optimizer.param_groups)) is not None:
                return problem
            if self.spec.type == "sgd" and self.spec.on_device and not keep_hyper_parameters:
                momenta = [
                    g.get("momentum", 0.0) for g in groups if bool(g.get("momentum", 0.0)) != bool(self.spec.momentum)
                ]
                if momenta:
                    return (
                        f"holds SGD with momentum {momenta[0]} for layer {idx}, and [optimizer] momentum is "
                        f"{self.spec.momentum} here: SGD on the device keeps a momentum buffer only with momentum, so "
                        f"resume with momentum = {momenta[0]}, or pass --reset_optimizer_params to keep this run's"
                    )
            here = [len(g["params"]) for g in layer.optimizer.param_groups]
            if [len(g["params"]) for g in groups] != here:
                count = sum(len(g["params"]) for g in groups)
                return f"holds {count} params for layer {idx}, which trains {sum(here)} here: another model?"
            params = [p for group in layer.optimizer.param_groups for p in group["params"]]
            ids = [i for group in groups for i in group["params"]]
            per_param = saved[idx]["state"] if isinstance(saved[idx]["state"], dict) else {}
            for i, param in zip(ids, params):
                for key, value in per_param.get(i, {}).items():
                    if isinstance(value, torch.Tensor) and value.ndim and value.shape != param.shape:
                        return (
                            f"holds {key} of shape {list(value.shape)} for a param of layer {idx} of shape "
                            f"{list(param.shape)}: another model?"
                        )
        return None

    def load_state_dict(self, state: dict, keep_hyper_parameters: bool = False) -> None:
        """Load a :meth:`state_dict` (checked: :meth:`state_problem`). ``keep_hyper_parameters``: the param groups'
        settings (lr, betas, weight_decay ...) stay as built, not as saved (train.py's ``--reset_optimizer_params``)."""
        if (problem := self.state_problem(state, keep_hyper_parameters)) is not None:
            raise DGLSUserError(f"the host optimizer state {problem}")
        self.finish()
        self.layout.state_at_start = True  # loaded now, not made at the first update (deferred_state: none left)
        if self.previous_norm is not None:  # a resume: the loaded step waits for its own norm, as step 1
            self.previous_norm.previous = None
        if self.whole is not None:
            self.whole.load_state_dict(state, keep_hyper_parameters)
            return
        for idx, layer in self.layers.items():
            replaced = [t for s in layer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            settings = [{k: v for k, v in g.items() if k != "params"} for g in layer.optimizer.param_groups]
            if self.disk_state is not None:
                with self.disk_state.held(layer):  # its masters in for the load; the loaded state written back
                    layer.optimizer.load_state_dict(state[idx] if idx in state else state[str(idx)])
            else:
                layer.optimizer.load_state_dict(state[idx] if idx in state else state[str(idx)])
            if keep_hyper_parameters:
                for group, kept in zip(layer.optimizer.param_groups, settings):
                    group.update(kept)
            _regroup(layer)  # torch's load replaced the param groups: the device path reads the new ones
            if self.updater is not None:
                self.updater.adopt_state(layer.optimizer, layer.flat, replaced)

    def close(self) -> None:
        """Finish the queued work (the transport stops its worker thread itself) and remove the hooks."""
        try:
            if self.worker.threaded and self.worker.error is None:
                self.finish()
        finally:
            self.remove_hooks()  # the disk state stays open: the engine reads the true weights after this


def _in_groups(params: list[TrainedParam], optimizer: torch.optim.Optimizer) -> list[tuple[TrainedParam, dict]]:
    """``params`` in ``optimizer``'s order, each with the param group it is in now (its hyper-parameters)."""
    by_master = {id(tp.master): tp for tp in params}
    return [(by_master[id(m)], group) for group in optimizer.param_groups for m in group["params"]]


def _regroup(layer: TrainedLayer) -> None:
    """After ``optimizer.load_state_dict``, which builds new param group dicts (the checkpoint's lr, betas,
    weight decay ...): the device path's references to the old ones (``in_groups``, the flat params') are
    replaced, so the device's kernel and the host's optimizer step with the same hyper-parameters."""
    layer.in_groups = _in_groups(layer.params, layer.optimizer)
    if layer.flat is not None:
        group_of = {id(tp.master): group for tp, group in layer.in_groups}
        layer.flat.params = [dataclasses.replace(fp, group=group_of[id(fp.master)]) for fp in layer.flat.params]


def _copied(state: dict) -> dict:
    """An optimizer state dict whose tensors are copies (a spilled layer's are unbound once it is written back)."""
    return {
        **state,
        "state": {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in state["state"].items()
        },
    }


def _plain(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def host_training_bytes(
    layouts: list[LayerLayout],
    streamed: Iterable[int],
    spec: HostOptimizerSpec,
    sums: bool = True,
    clipping: bool = True,
    speculate: bool = True,
) -> dict[str, int]:
    """Host bytes full fine-tuning of the streamed layers needs beyond their packed copies: the training
    layout's figure (:meth:`~..memory.layout.TrainingLayout.parts`). ``sums``: fp32 gradient sums (kept with several
    micro-batches a step; with one, the updates read the landings); ``clipping`` and ``speculate``: spares for
    speculative updates (all of them: the RAM check may keep fewer)."""
    return training_layout({idx: layouts[idx] for idx in streamed}, spec, 2 if sums else 1, clipping, speculate).parts()


def _counted(layout: TrainingLayout, save_copy: int = 0, probe: bool = False) -> dict[str, int]:
    """The parts of the host RAM :func:`check_host_training` counts for ``layout`` (same arguments): what is
    allocated before the first update, less the optional spares, with a save's copy."""
    parts = _allocated_now(layout, layout.deferred_state() if probe else 0)
    parts.pop("speculation", None)
    if save_copy:
        parts["a save's copy of the other processes' masters"] = save_copy
    return parts


def host_training_need(layout: TrainingLayout, save_copy: int = 0, probe: bool = False) -> int:
    """The host RAM :func:`check_host_training` counts for ``layout`` (same arguments), in bytes."""
    return sum(_counted(layout, save_copy, probe).values())


def host_training_beside(layout: TrainingLayout, probe: bool = False) -> int:
    """What a process holds beside :func:`host_training_need` once running: the packed copies, and under a budget's
    probe the state made at the first updates (the room optional spares must leave, counted for every process)."""
    return layout.packed_bytes + (layout.deferred_state() if probe else 0)


def _others_text(others: Others) -> str:
    """The RAM check's words for the job's other processes on this machine (:func:`.peers.others_on_machine`)."""
    if not others.count:
        return ""
    plural = "es" if others.count > 1 else ""
    return f", the job's {others.count} other process{plural} on this machine {human_bytes(others.need)} more"


def check_host_training(
    layout: TrainingLayout, save_copy: int = 0, probe: bool = False, others: Others = NO_OTHERS
) -> str:
    """Refuse, with the numbers, when the host cannot hold the masters, gradients and optimizer state and
    still keep its reserve (a tenth of its RAM, 2 GiB at least: the weight store's rule; much of this is
    page-locked, which the host cannot swap out); otherwise the start-up line that says how much they take.
    ``layout`` is the object :class:`HostTraining` then allocates from (the builder hands it the same one). The
    spares of speculative updates (:mod:`.speculation`) are optional: the layout keeps those that fit in half of
    what is left beside the rest (:meth:`~..memory.layout.TrainingLayout.limit_spares`); the clipping line says what
    became of them. ``save_copy``: bytes one process holds besides while a save runs (a data-parallel job's reader,
    the other owners' masters: :mod:`.shared_saves`), counted as needed too. ``probe``: a VRAM budget places the
    layers, its first step streaming every one (``layout`` holds them all): the optimizer state made at a layer's
    first update (:meth:`~..memory.layout.TrainingLayout.deferred_state`) comes after the plan, for the layers it
    streams only, and is counted then (:func:`check_deferred_state`); what is allocated now is counted here, and
    the advice is to place the layers by hand. ``others``: what the job's other processes on this machine need
    beside (bytes, how many, what they hold besides: :func:`..memory.peers.others_on_machine`; pipeline stages),
    counted too; the spares then take their share of what is left, one per process."""
    later = layout.deferred_state() if probe else 0
    parts = _counted(layout, save_copy, probe)
    need = sum(parts.values())
    if (short := ram_short(need + others.need)) is not None:
        available, reserve = short
        described = ", ".join(f"{name} {human_bytes(n)}" for name, n in parts.items())
        advice = PROBE_ADVICE if probe else "stream fewer layers (blocks_to_swap), or free RAM"
        raise DGLSUserError(
            f"full fine-tuning of the streamed layers needs {human_bytes(need)} of host RAM ({described}) beyond "
            f"their packed weights{_others_text(others)}, and {human_bytes(available)} is free, of which "
            f"{human_bytes(reserve)} stays for the rest of the host: {advice}"
        )
    if layout.spares_wanted:  # optional: at most half of what is left once the packed copies (and the state made
        # later, and the other processes' needs and holdings) are made too, so that saving a checkpoint and the data
        # loader still find room beside pinned RAM; this process's share of it, one per process on the machine
        available, reserve = ram_room()
        left = available - reserve - need - host_training_beside(layout, probe) - others.need - others.holdings
        layout.limit_spares(max(0, left) // 2 // (others.count + 1))
    parts = _allocated_now(layout, later)
    described = ", ".join(f"{name} {human_bytes(n)}" for name, n in parts.items())
    line = f"DGLS host training: {human_bytes(sum(parts.values()))} of host RAM ({described})"
    if later:
        line += (
            f"; the optimizer state of the layers the VRAM budget's plan streams (up to {human_bytes(later)}, every "
            "layer streamed) is made at their first update and counted once the plan is fixed"
        )
    return line


def _allocated_now(layout: TrainingLayout, later: int) -> dict[str, int]:
    """The layout's parts less the optimizer state made ``later`` (the part dropped where nothing is left of it)."""
    parts = layout.parts()
    parts["optimizer"] -= later
    if later and not parts["optimizer"]:
        del parts["optimizer"]
    return parts


def check_deferred_state(layout: TrainingLayout, in_time: bool = True, others: Others = NO_OTHERS) -> None:
    """The VRAM budget's placement is fixed and the layers a plan made resident are released (before any update):
    refuse, with the numbers, before the first update makes the optimizer state of the layers still streamed, when
    the host cannot hold it and keep its reserve (:func:`check_host_training`'s rule, on what is free now).
    ``in_time``: the planner heard of the step before the trainer's optimizer step; otherwise it kept the probe's
    placement (every layer streamed), and the line says how to let it plan. ``others``: the state the job's other
    processes on this machine make at the same step (pipeline stages), counted too."""
    need = layout.deferred_state()
    if (short := ram_short(need + others.need)) is not None:
        available, reserve = short
        what = (
            "the VRAM budget's plan streams"
            if in_time
            else "the trainer stepped before DGLS heard of the step (clip through DGLS, or call before_step() "
            "before the optimizer step, to let the VRAM budget plan), so the probe's placement streams"
        )
        raise DGLSUserError(
            f"{what} {len(layout.layers)} trained layers, whose optimizer state needs {human_bytes(need)} of host "
            f"RAM at their first update{_others_text(others)}, and {human_bytes(available)} is free, of which "
            f"{human_bytes(reserve)} stays for the rest of the host: a larger --vram_budget keeps more layers on the "
            "GPU, or place them by hand (gpu_layers or blocks_to_swap), or free RAM"
        )
