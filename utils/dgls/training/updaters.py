"""Updaters: where a host-trained layer's optimizer step runs: the host, the device, or a split of the two.

Each strategy offers :meth:`Updater.submit` (on the training thread: queue ``layer``'s step with the step's
gradients, the clip coefficient and the lr; ``speculated``: a speculative update, whose old values go to its
spare; ``undo``: first undo the layer's speculative update, :mod:`.speculation`) and :meth:`Updater.settle` (the
latest update is written: what a fetch of the layer waits for). The optimizer arithmetic is the optimizer's (host) or an
:class:`~.optimizer_kernels.OptimizerKernel` (device); the state lives in host memory either way, so the
strategy changes the speed, never the numbers.

Strategies
    - :class:`HostUpdater`: a job on the transport's job worker steps the layer's torch optimizer (or
      DeepSpeed's CPU Adam) on its fp32 masters and rewrites the packed compute-dtype copy; for a layer whose
      masters and state live on disk (:mod:`.disk_state`), after reading them and before writing them back.
    - :class:`DeviceSide`: :class:`~.device_update.DeviceUpdater` moves master, state and gradient in,
      runs the kernel and moves them home; on CUDA it is enqueued at once on the transport's
      optimizer-state streams (a fetch waits for its copy home on the device), on the CPU it is a job.
    - :class:`SplitUpdater`: before a step's updates each layer is given to the host or the device,
      whichever would finish it sooner at the rates measured on earlier steps (:mod:`.update_split`).

Tokens (every field below is written on the training thread)
    - ``layer.update``: the latest update job not yet waited for; its result (:class:`UpdateDone`) is read
      only after :meth:`~.jobs.Jobs.wait`.
    - ``layer.home``: the latest device update's copy home (a gate of the weight copy; the host lands it
      before it reads the state).
    - A job that needs the layer's previous update gets that job or copy as an argument; a previous job
      ran before it (one queue, submission order), so the job reads its result on the same thread.

Hazards handled
    - A layer that changes side waits for its previous update on the other side first: a host job lands
      the previous device update's copy home; a device update on CUDA waits (on the training thread) for
      the previous host job.
    - A device update on CUDA reads host sums: it waits for the job that wrote them first.
    - Split updates run on the side they were queued for: without clipping (or speculating) a job queued during
      backward may run after the step assigned new sides.
    - An undo runs where the redo runs, after the speculative update: a host job after the speculative job (one
      queue) and after landing its copy home (``previous``); a device update on CUDA after waiting for the
      speculative job on the training thread (``settle``), its copies gated on the speculative update's home.
    - A speculative job whose step clipped before it started skips itself, and hands on the copy home of the
      update before it (the next update of the layer still lands it).

Cores (:func:`update_threads`): on the worker thread, a host update's torch kernels run with three quarters
of this process's share of torch's intra-op threads, set for that thread around the update and restored after
it: the training thread launches the forward's and backward's kernels meanwhile, and with every core busy on
the update it was descheduled (benchmarks/results/noclip_omp16.md). The share: torch's threads (the cores)
divided by ``processes_here``, the processes whose host updates share this machine's cores
(:func:`~.training_feature.processes_here`: data-parallel processes and pipeline stages update at once, and each
would otherwise take three quarters of every core). The update is elementwise, so its numbers do not depend on
the thread count.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from ..memory.transport import Copy, Transport
from . import speculation
from .device_update import DeviceUpdater, ParamUpdate, timeline_busy
from .disk_state import DiskState
from .grad_return import StepGrads, TrainedLayer
from .jobs import Job, Jobs
from .speculation import Speculated
from .update_split import UpdateSplit

Side = Literal["host", "device"]  # where an update ran


def update_threads(default: int, processes_here: int = 1) -> int:
    """The intra-op threads of a host update on the worker thread: three quarters of this process's share of
    ``default`` (torch's for that thread: the cores, or ``OMP_NUM_THREADS``), ``default`` divided by
    ``processes_here``, at least one (see the module doc)."""
    return max(1, default // max(1, processes_here) * 3 // 4)


@contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """This thread's intra-op threads set to ``count`` (None: unchanged) for the block, then restored."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class UpdateDone:
    """An update job's result: the copy a reader must still wait for, and its timing (split rates)."""

    home: Copy | None  # device updates: the copy home of its last chunk; host: None (all written)
    side: Side
    params: int
    seconds: float


def _resolved(previous: Job | Copy | None) -> Copy | None:
    """The copy home of a layer's previous update, on the thread that runs the jobs (see Tokens)."""
    if isinstance(previous, Job):
        return previous.result.home
    return previous


class Updater(ABC):
    """One update strategy (see the module doc)."""

    def __init__(self, jobs: Jobs, record: Callable[[UpdateDone], None] | None = None) -> None:
        self.jobs = jobs
        self.split: UpdateSplit | None = None
        self._record = record if record is not None else _ignore  # a finished job's timing (split: the rates)

    @abstractmethod
    def submit(
        self,
        layer: TrainedLayer,
        grads: StepGrads,
        coef: torch.Tensor | None,
        lr: float | None,
        speculated: Speculated | None = None,
        undo: Speculated | None = None,
    ) -> None:
        """Queue ``layer``'s step (training thread); ``speculated``/``undo``: see the module doc."""

    def side(self, layer: TrainedLayer) -> Side:
        """Where an update of ``layer`` submitted now runs."""
        return "host"

    def settle(self, layer: TrainedLayer) -> Copy | None:
        """Wait for ``layer``'s latest update job; the copy a fetch of the layer must still wait for."""
        if layer.update is not None:
            done = self.jobs.wait(layer.update)
            layer.update = None
            layer.home = done.home
            self._record(done)
        return layer.home

    def begin_step(self, layers: dict[int, TrainedLayer]) -> None:
        """Before a step's updates are queued (split: the sides)."""
        return None  # host updates: nothing to do

    def end_step(self) -> None:
        """After a step's updates were queued."""
        return None  # host updates: nothing to do

    def pinned_bytes(self) -> int:
        return 0

    def synchronize(self) -> None:
        """Every update enqueued on the device is home (host reads of masters and state follow)."""
        return None  # host updates: nothing to do


class HostUpdater(Updater):
    """Steps on the host, as jobs (see the module doc)."""

    def __init__(
        self,
        jobs: Jobs,
        transport: Transport,
        largest_layer: int,
        record=None,
        disk: DiskState | None = None,
        processes_here: int = 1,
    ) -> None:
        super().__init__(jobs, record)
        self.transport = transport
        self.processes_here = processes_here  # the job's processes on this machine: their updates share its cores
        self.disk = disk  # masters and state of the layers it spilled: read before their update, written after
        self._largest = largest_layer
        self._grad_buffer: torch.Tensor | None = None  # one micro-batch a step: fp32 grads an update reads

    def submit(self, layer, grads, coef, lr, speculated=None, undo=None) -> None:
        if speculated is not None:
            speculated.side = "host"
        previous = layer.update if layer.update is not None else layer.home
        run = partial(self.run, layer, grads, coef, lr, previous, speculated, undo)
        if self.disk is not None:
            self.disk.queued(layer.index)
        layer.update = self.jobs.submit(layer.index, "update", run)

    def run(
        self,
        layer: TrainedLayer,
        grads: StepGrads,
        coef: torch.Tensor | None,
        lr: float | None,
        previous: Job | Copy | None,
        speculated: Speculated | None = None,
        undo: Speculated | None = None,
    ) -> UpdateDone:
        """The update job: undo a speculative update (``undo``), keep the old values (``speculated``), scale by
        the clip coefficient, step the layer's optimizer on its masters, rewrite the packed copies."""
        began = time.perf_counter()
        if speculated is not None and speculated.cancelled:  # its step clipped before it started
            return UpdateDone(_resolved(previous), "host", 0, 0.0)
        if self.disk is not None:  # a spilled layer's read, issued before this update waits for its gradients
            self.disk.ahead()
        direct = grads.direct
        if direct is not None:  # one micro-batch a step: read the landings (after their copies)
            self.transport.land(direct.done)
        home = _resolved(previous)
        if home is not None:  # the previous update ran on the device: its state must be home
            self.transport.land(home)
        threads = update_threads(torch.get_num_threads(), self.processes_here) if self.jobs.worker.on_thread() else None
        with torch.no_grad(), _threads(threads):
            slot = self.disk.bring_in(layer) if self.disk is not None and layer.index in self.disk.spilled else None
            if undo is not None:
                speculation.undo(undo)
            if speculated is not None:
                speculation.save(speculated)
            self._give_grads(layer, grads, coef)
            if lr is not None:
                for group in layer.optimizer.param_groups:
                    group["lr"] = lr
            layer.optimizer.step()
            for tp in layer.params:
                if tp.master.grad is not None:
                    tp.master.grad = None
                    if tp.packed is not None:
                        tp.packed.copy_(tp.master)
            if slot is not None:
                self.disk.send_home(layer, slot)
        return UpdateDone(None, "host", layer.numel, time.perf_counter() - began)

    def _give_grads(self, layer: TrainedLayer, grads: StepGrads, coef: torch.Tensor | None) -> None:
        """Each master's ``.grad`` for the optimizer: its landing (converted to fp32 in the reused buffer) or
        its sum, scaled by ``coef``; None for a param without a gradient this step (the optimizer skips it)."""
        direct = grads.direct
        offset = 0
        for tp in layer.params:
            if direct is not None and tp.position in direct.params:
                grad = tp.landing
                if grad.dtype != torch.float32:
                    n = grad.numel()
                    grad = self._grads(layer.numel)[offset : offset + n].view(grad.shape).copy_(grad)
                    offset += n
            elif tp.position in grads.summed:
                grad = tp.acc
            else:
                tp.master.grad = None
                continue
            if coef is not None:
                grad.mul_(coef)
            tp.master.grad = grad

    def _grads(self, numel: int) -> torch.Tensor:
        """The reused fp32 buffer a host update converts a layer's gradient landings into (job thread only)."""
        if self._grad_buffer is None or self._grad_buffer.numel() < numel:
            self._grad_buffer = torch.empty(max(numel, self._largest), dtype=torch.float32)
        return self._grad_buffer


class DeviceSide(Updater):
    """Steps on the device through :class:`~.device_update.DeviceUpdater` (see the module doc)."""

    def __init__(self, jobs: Jobs, updater: DeviceUpdater, record=None) -> None:
        super().__init__(jobs, record)
        self.updater = updater

    def side(self, layer: TrainedLayer) -> Side:
        return "device"

    def submit(self, layer, grads, coef, lr, speculated=None, undo=None) -> None:
        if speculated is not None:
            speculated.side = "device"
        if self.updater.cuda:  # enqueued on the device's streams now
            if grads.summing is not None:
                self.jobs.wait(grads.summing)  # its host sums are what the update copies in
            self.settle(layer)  # split: the previous update ran on the host and writes the state
            if undo is not None:
                speculation.undo(undo)
            layer.home = self.enqueue(layer, grads, coef, lr, layer.home, speculated)
            return
        previous = layer.update if layer.update is not None else layer.home
        run = partial(self.run, layer, grads, coef, lr, previous, speculated, undo)
        layer.update = self.jobs.submit(layer.index, "update", run)

    def run(self, layer, grads, coef, lr, previous: Job | Copy | None, speculated=None, undo=None) -> UpdateDone:
        """The update job (CPU): the device update, run now on the job's thread."""
        began = time.perf_counter()
        if speculated is not None and speculated.cancelled:  # its step clipped before it started
            return UpdateDone(_resolved(previous), "device", 0, 0.0)
        if undo is not None:
            speculation.undo(undo)
        home = self.enqueue(layer, grads, coef, lr, _resolved(previous), speculated)
        return UpdateDone(home, "device", layer.numel, time.perf_counter() - began)

    def enqueue(
        self,
        layer: TrainedLayer,
        grads: StepGrads,
        coef: torch.Tensor | None,
        lr: float | None,
        previous: Copy | None,
        speculated: Speculated | None = None,
    ) -> Copy | None:
        """The layer's step on the device, in the optimizer's param order; its copy home. ``speculated``: master
        and state go home into its spare, which then takes the place of the layer's buffers (a flat layer)."""
        direct = grads.direct
        after = (direct.done,) if direct is not None else ()  # the landings are read after their copies
        spare = speculated.spare if speculated is not None else None
        if speculated is not None:
            speculation.before_device_update(speculated)
        flat = layer.flat is not None and self.updater.kernel.flat  # else the kernel's state is not in flat buffers
        if flat and direct is not None and len(direct.params) == len(layer.params):
            into = (spare.masters, spare.state) if spare is not None else None
            done = self.updater.update_flat(layer.optimizer, layer.flat, coef, lr, after, previous, into)
        else:
            work = []
            for tp, group in layer.in_groups:
                home = spare.views(tp.position) if spare is not None else None
                if direct is not None and tp.position in direct.params:
                    work.append(ParamUpdate(tp.master, tp.landing, tp.packed, group, home))
                elif tp.position in grads.summed:
                    work.append(ParamUpdate(tp.master, tp.acc, tp.packed, group, home))
            done = self.updater.update(layer.optimizer, work, coef, lr, after, previous)
        if spare is not None:
            speculation.swap(layer, spare)
        return done

    def pinned_bytes(self) -> int:
        return self.updater.pinned_bytes()

    def synchronize(self) -> None:
        self.updater.synchronize()


class SplitUpdater(Updater):
    """Each layer's step on the host or the device, by the measured rates (see the module doc)."""

    def __init__(
        self,
        jobs: Jobs,
        transport: Transport,
        updater: DeviceUpdater,
        sizes: dict[int, int],
        all_at_once: bool,
        processes_here: int = 1,
    ) -> None:
        super().__init__(jobs, self._note)
        largest = max(sizes.values(), default=0)
        self.host = HostUpdater(jobs, transport, largest, self._note, processes_here=processes_here)
        self.device = DeviceSide(jobs, updater, self._note)
        self.split = UpdateSplit(sizes)
        self.all_at_once = all_at_once  # every update of a step queued by the step (clipping, no speculation)
        self._work: dict[Side, list[tuple[int, float]]] = {"host": [], "device": []}  # finished jobs since a step
        self._span: tuple | None = None  # CUDA, all at once: (start event, end event, params) of a step's share
        self._span_start = None
        self._queued = 0  # params queued on the device since the span started
        self._timelines: list[list] = []  # CUDA, trickling in: chunk timings of steps not yet read
        if updater.cuda and not all_at_once:  # updates trickle in during backward: time each chunk
            updater.timeline = []

    def side(self, layer: TrainedLayer) -> Side:
        return "device" if self.split.on_device[layer.index] else "host"

    def submit(self, layer, grads, coef, lr, speculated=None, undo=None) -> None:
        if self.split.on_device[layer.index]:
            self._queued += layer.numel
            self.device.submit(layer, grads, coef, lr, speculated, undo)
        else:
            self.host.submit(layer, grads, coef, lr, speculated, undo)

    def _note(self, done: UpdateDone) -> None:
        if done.side == "host" or not self.device.updater.cuda:  # on CUDA the device's share is timed there
            self._work[done.side].append((done.params, done.seconds))

    def begin_step(self, layers) -> None:
        """Fold the last steps' measured rates in and assign this step's sides; on CUDA with every update queued
        now (``all_at_once``) start timing the device's share."""
        for side, work in self._work.items():
            if work:
                record = self.split.record_host if side == "host" else self.split.record_device
                record(sum(n for n, _ in work), sum(s for _, s in work))
                work.clear()
        span, self._span = self._span, None
        if span is not None and span[1].query():
            self.split.record_device(span[2], span[0].elapsed_time(span[1]) / 1000)
        updater = self.device.updater
        if updater.timeline is not None:  # read steps whose chunks all went home; later ones next time
            self._timelines.append(updater.timeline)
            updater.timeline = []
            while self._timelines:
                if self._timelines[0]:
                    busy = timeline_busy(self._timelines[0])
                    if busy is None:
                        break
                    self.split.record_device(*busy)
                self._timelines.pop(0)
        self.split.assign(layers)
        self._span_start = updater.mark(end=False) if self.all_at_once else None
        self._queued = 0

    def end_step(self) -> None:
        if self._span_start is not None and self._queued:
            self._span = (self._span_start, self.device.updater.mark(end=True), self._queued)
        self._span_start = None

    def pinned_bytes(self) -> int:
        return self.device.pinned_bytes()

    def synchronize(self) -> None:
        self.device.synchronize()


def _ignore(done: UpdateDone) -> None:
    """No strategy above this one keeps timings."""
