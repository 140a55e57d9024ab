"""Host training: full fine-tuning of streamed layers, with fp32 masters and the optimizer in host memory.

Layout (per streamed layer with trainable params, a :class:`TrainedLayer`)
    - the packed compute-dtype copy in the host store: what the copier streams into a slot, as for frozen
      weights;
    - an fp32 master per param (ordinary RAM; for fp32 compute the packed copy itself is the master);
    - a pinned gradient landing per param in the compute dtype (where the device-to-host copy writes);
    - an fp32 gradient accumulator per param (summed over the micro-batches of a step);
    - the layer's optimizer state (:mod:`.host_optimizer`), in host memory; it never touches the device.

Mechanics
    1. Backward: a param's grad is produced on the device in its slot's dtype. A grad arriving is a use of
       its layer (a grad can reach a param before anything else in the layer's backward reads a weight, e.g.
       a bias fed by an output whose gradient arrived first). Its post-accumulate-grad hook takes it off the
       param (``param.grad = None``: the trainer's optimizer skips the param) into the layer's open group. A
       group goes to its landings (the transport's gradients-home direction) once it holds ``SEND_GROUP_BYTES``,
       its layer's last grad, or a grad of another layer (a param without a grad would otherwise hold its
       layer's group until the backward ends), so at most that much plus one grad waits on the device, and
       the thread running the backward (it also launches the backward's kernels) pays one stream switch and
       one norm kernel a group instead of one per param (the SDXL UNet has 1,362: per param, they lengthened
       its forward+backward by about an eighth). When every param of the layer has sent (or the backward
       ends), the layer's batch is closed and an *accumulate* job is queued: land the copies, add them into
       the fp32 accumulators (the first micro-batch of a step copies instead, as autograd assigns a first
       grad). On the last micro-batch of a step (``accumulation_steps``) the job also takes each param's
       norm, for clipping.
    2. ``clip_grad_norm_(params, max_norm)``: one norm over host and device params (device norms on the
       device, host norms from the accumulators), the coefficient applied to device grads now and to
       host grads in the update.
    3. ``step(lr)``: an *update* job per layer, in layer order (the next forward's order): scale by the
       clip coefficient, step the layer's optimizer on its masters, write the new compute-dtype copy
       into the packed buffer. The engine's fetch of a layer waits for that layer's update only
       (``wait_update``), so the forward of layer k runs while the host updates layers after k.
       With one micro-batch a step (``accumulation_steps == 1``) no fp32 sum is kept: the update reads
       the landings, converting them into one reused fp32 buffer, and each grad's norm is taken on the
       device before it is sent (a second batch of one layer in a step falls back to the host sum). That
       saves 4 bytes of host RAM a param, a quarter of what AdamW's full fine-tuning holds.
       Without clipping (``clipping=False``: no norm to wait for) a layer's update is queued as soon as
       its gradients of the step's last micro-batch are summed, so the host updates during backward;
       its learning rate is read then (``lr_source``, the trainer's current one), and ``step`` only
       queues the layers that had no gradient.

Device updates (``--host_adam device``, :mod:`.device_update`): the update of step 3 runs on the
device instead, its master and moments copied in and back out through the transport's optimizer-state
directions; on CUDA it is enqueued at once (no job), and a fetch of the layer waits for it on the device
(``wait_update`` returns its :class:`~.transport.Copy`, a gate of the weight copy). With one micro-batch
a step it reads the gradient landings (after their copies), as host updates do.

Split updates (``--host_adam split``, :mod:`.update_split`): before a step's updates are queued, each
layer is given to the device or to the host (torch's fused CPU AdamW), whichever would finish it sooner
at the rates measured on earlier steps; both read the landings directly with one micro-batch a step
and the same pinned host state. A layer that changes side waits for its previous update on the other
side first: a host job for a device update's event, a device update (enqueued by the training thread)
for the previous host job.

Jobs run in submission order: on a worker thread (CUDA, or ``threaded``), or deferred (CPU): a job runs
only when something waits for it, so a missing wait changes the numbers in a CPU test (a fetch without
``wait_update`` streams the old weights; an accumulation without ``land`` reads NaN).

Cores (:func:`update_threads`): on the worker thread, a host update's torch kernels (AdamW, the gradients'
conversion to fp32) run with three quarters of torch's intra-op threads, set for that thread around the
update and restored after it (``DeepSpeedCPUAdam`` runs on OpenMP threads of its own, which this leaves
as they are). The training thread launches the forward's and backward's kernels meanwhile, and with
every core busy on the update it was descheduled, which made the step slower with all of the cores than
with fewer (benchmarks/results/noclip_omp16.md, noclip_omp12.md, noclip_omp8.md). The update is
elementwise, so its numbers do not depend on the thread count; the norms (reductions, whose numbers do)
keep the default. ``torch.set_num_threads`` also sets the count that a thread running its
first parallel kernel meanwhile takes up for good; it is restored after each update, and the transport's
other worker thread (the copier's) only issues copies, whose numbers do not depend on it either.

Hazards handled
    - A landing is rewritten by the next micro-batch's copy only after its accumulation finished.
    - Slot copies made before an update hold old weights: the engine evicts every host-trained layer at
      the end of each backward (:meth:`~.swapper.LayerSwapper.pass_end`), so the next use fetches anew.
      Evicted params point at empty placeholders, so a trainer that zero-fills missing grads
      (DeepSpeed's gradient reduction) allocates nothing.
    - A param with no grad in a step is skipped by its optimizer, as one without ``.grad`` is; its
      layer's batch stays open to the end of the backward, but its group is sent when the next layer's
      grads begin, so unsent grads never pile up on the device across layers.
    - A grad waiting in a group is referenced only by the group; once sent, ``record_stream`` keeps its
      memory from reuse until its copy ran.
    - Split updates run on the side they were queued for: without clipping a host job queued during
      backward may run after the step assigned new sides, and sent to the device then it would enqueue a
      device update from the worker thread, beside the training thread's own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import psutil
import torch
from torch import nn

from .device_update import DeviceUpdater, FlatLayer, FlatParam, ParamUpdate, timeline_busy
from .errors import DGLSUserError
from .host_optimizer import HostOptimizerSpec
from .host_store import HostLayer, ram_reserve
from .layout import LayerLayout, aligned
from .pinned import PinnedMemory
from .stats import human_bytes
from .transport import Copy, Direction, Transport
from .update_split import UpdateSplit

SEND_GROUP_BYTES = 64 * 2**20  # a layer's grads wait on the device until this many bytes go home together


def update_threads(default: int) -> int:
    """The intra-op threads of a host update on the worker thread: three quarters of ``default`` (torch's
    for that thread: the cores, or ``OMP_NUM_THREADS``), at least one; the rest stay free for the training
    thread (see the module doc)."""
    return max(1, default * 3 // 4)


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


def grad_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 2-norm of each of ``grads``, in one fused kernel per device (the norms clipping adds up)."""
    return list(torch._foreach_norm(grads, 2, dtype=torch.float32))


@dataclass(eq=False)
class TrainedParam:
    position: int  # in the layer's layout
    param: nn.Parameter
    master: torch.Tensor  # fp32, host
    packed: torch.Tensor | None  # the compute-dtype copy an update rewrites (None: the master is that copy)
    landing: torch.Tensor  # compute dtype, pinned on CUDA
    acc: torch.Tensor | None = None  # fp32 gradient sum of this step (allocated at its first use)
    fresh: bool = True  # acc holds nothing yet this step
    norm: torch.Tensor | None = None  # of acc, taken on the step's last micro-batch
    direct_norm: torch.Tensor | None = None  # device updates: of the grad on the device, before it was sent


@dataclass(eq=False)
class GradBatch:
    """One layer's gradients from one backward pass, sent home in groups (one transport copy each)."""

    layer: int
    copies: list[Copy] = field(default_factory=list)  # its groups' copies home, in order
    params: set[int] = field(default_factory=set)  # positions of the params whose grads were sent
    done: Copy | None = None  # once closed: all of its copies (the transport's join of them)


@dataclass(eq=False)
class Job:
    layer: int
    kind: str  # "accumulate" or "update"
    run: Callable[[], None]
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class TrainedLayer:
    index: int
    host: HostLayer
    params: list[TrainedParam]
    optimizer: torch.optim.Optimizer
    # device updates: the params in the optimizer's order, with their param groups (fixed at start-up)
    in_groups: list[tuple[TrainedParam, dict]] = field(default_factory=list)
    numel: int = 0  # trained params
    flat: FlatLayer | None = None  # device updates in bf16/fp16: masters, moments and landings back to back
    batch: GradBatch | None = None  # open during the layer's backward
    group: list[tuple[TrainedParam, torch.Tensor]] = field(default_factory=list)  # the batch's unsent grads
    group_bytes: int = 0
    accumulating: Job | None = None  # the latest accumulate job (its landing is read until done)
    update: Job | None = None  # the latest update job (a fetch waits for it)
    updated_early: bool = False  # this step's update was queued during backward (clipping off)
    direct: GradBatch | None = None  # device updates: this step's only batch, read from its landings
    update_done: Copy | None = None  # device updates on CUDA: the latest one is home (its last copy home)


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
    ) -> None:
        self.spec, self.implementation = spec, spec.kernel
        self.transport = transport  # gradients home (its CPU backend lands them late unless ``threaded``)
        self.worker = transport.job_worker  # the jobs (accumulations, host updates) run on its thread, or deferred
        self._late_grads = not threaded
        self.updater = updater
        # with one micro-batch a step, updates read it straight from its landings (no fp32 sum on the host)
        self.direct = accumulation_steps == 1
        self.split: UpdateSplit | None = None  # split updates: which side updates each layer this step
        self._host_work: list[tuple[int, float]] = []  # split: (params, seconds) of host updates since a step
        self._device_work: list[tuple[int, float]] = []  # split on the CPU: the same for device updates
        self._device_span: tuple | None = None  # split on CUDA: timing events around a step's device updates
        self._timelines: list[list] = []  # split on CUDA without clipping: chunk timings of steps not yet read
        self._grad_buffer: torch.Tensor | None = None  # one micro-batch a step: fp32 grads a host update reads
        self._pin_sums = pin and updater is not None  # device updates copy the sums in asynchronously
        # landings, and for device updates masters and sums: page-locked at their exact size (:mod:`.pinned`)
        self._memory = PinnedMemory(pin, "stream fewer layers (blocks_to_swap), or free RAM")
        self.accumulation_steps = accumulation_steps
        self.clipping = clipping
        self.lr_source: Callable[[], float | None] = lambda: None  # the lr of early updates (clipping off)
        self.layers: dict[int, TrainedLayer] = {}
        self._by_param: dict[int, TrainedParam] = {}
        self._hooks: list = []
        self._grouping: TrainedLayer | None = None  # the layer whose grads arrived last (the only open group)
        self._coef: torch.Tensor | None = None
        self._backwards = 0  # backward passes since the last step
        self.waited_s = 0.0  # seconds the training thread spent blocked on host jobs (updates, accumulations)
        self.job_s = {"accumulate": 0.0, "update": 0.0}  # seconds the host spent on each kind of job
        self.device_bytes = 0  # device updates: their scratch buffers
        for idx, host in sorted(layers.items()):
            trained = self._layer(idx, host, pin)
            if trained is not None:
                self.layers[idx] = trained
        if updater is not None and self.layers:
            sizes = [[tp.param.numel() for tp in layer.params] for layer in self.layers.values()]
            self.device_bytes = updater.reserve(max(max(s) for s in sizes), max(sum(s) for s in sizes))
            if spec.split:
                self.split = UpdateSplit({idx: layer.numel for idx, layer in self.layers.items()})
                if updater.cuda and not clipping:  # updates trickle in during backward: time each chunk
                    updater.timeline = []
                for layer in self.layers.values():
                    if layer.flat is None:  # flat layers have theirs
                        updater.prepare(layer.optimizer)  # pinned moments, found by either side
        if threaded:
            self.worker.start()

    def _layer(self, idx: int, host: HostLayer, pin: bool) -> TrainedLayer | None:
        chosen = [(k, p) for k, p in enumerate(host.layout.params) if p.param.requires_grad]
        if not chosen:
            return None
        dtypes = {p.dtype for _, p in chosen}
        if self.updater is not None and len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16}:
            return self._flat_layer(idx, host, chosen, pin)
        landing_bytes = sum(aligned(p.nbytes) for _, p in chosen)
        landing = self._memory.empty((landing_bytes,), torch.uint8)
        pin_masters = pin and self.updater is not None  # device updates copy them asynchronously
        params, offset = [], 0
        with torch.no_grad():
            for k, p in chosen:
                packed = host.master_view(k)
                if p.dtype == torch.float32:
                    master, packed = packed, None  # the packed copy is the fp32 master itself
                else:
                    master = self._memory.empty(p.shape, torch.float32) if pin_masters else torch.empty(p.shape)
                    master.copy_(_initial(p, packed))
                view = landing[offset : offset + p.nbytes].view(p.dtype).view(p.shape)
                offset += aligned(p.nbytes)
                params.append(self._trained(TrainedParam(k, p.param, master, packed, view)))
        return self._with_optimizer(idx, host, params)

    def _flat_layer(self, idx: int, host: HostLayer, chosen: list, pin: bool) -> TrainedLayer:
        """Device (or split) updates of a layer computed in bf16/fp16: masters, moments and landings flat,
        in the optimizer's order (:class:`~.device_update.FlatLayer`)."""
        order = [kp for kp in chosen if kp[1].param.ndim > 1] + [kp for kp in chosen if kp[1].param.ndim <= 1]
        total = sum(p.param.numel() for _, p in order)
        masters = self._memory.empty((total,), torch.float32)
        landings = self._memory.empty((total,), order[0][1].dtype)
        params, offset = [], 0
        with torch.no_grad():
            for k, p in order:
                n = p.param.numel()
                packed = host.master_view(k)
                master = masters[offset : offset + n].view(p.shape).copy_(_initial(p, packed))
                landing = landings[offset : offset + n].view(p.shape)
                params.append(self._trained(TrainedParam(k, p.param, master, packed, landing)))
                offset += n
        layer = self._with_optimizer(idx, host, params)
        flat, offset = [], 0
        for tp, group in layer.in_groups:  # spec.build's order: must be the one the buffers were filled in
            n = tp.param.numel()
            if tp.master.storage_offset() - masters.storage_offset() != offset:
                raise AssertionError("the flat layout does not follow the optimizer's param order")
            flat.append(FlatParam(offset, n, tp.master, tp.packed, group))
            offset += n
        layer.flat = FlatLayer(masters, landings, flat)
        self.updater.prepare(layer.optimizer, layer.flat)
        return layer

    def _trained(self, tp: TrainedParam) -> TrainedParam:
        if not self.direct:
            self._sum_of(tp)
        self._by_param[id(tp.param)] = tp
        return tp

    def _with_optimizer(self, idx: int, host: HostLayer, params: list[TrainedParam]) -> TrainedLayer:
        params.sort(key=lambda tp: tp.position)  # layout order (hooks, batches); the optimizer's is in_groups
        optimizer = self.spec.build([tp.master for tp in params])
        by_master = {id(tp.master): tp for tp in params}
        in_groups = [(by_master[id(m)], group) for group in optimizer.param_groups for m in group["params"]]
        return TrainedLayer(idx, host, params, optimizer, in_groups, sum(tp.param.numel() for tp in params))

    def _sum_of(self, tp: TrainedParam) -> torch.Tensor:
        """The param's fp32 gradient sum, allocated at its first use."""
        if tp.acc is None:
            shape = tp.param.shape
            tp.acc = self._memory.zeros(shape, torch.float32) if self._pin_sums else torch.zeros(shape)
        return tp.acc

    # ---------------------------------------------------------------- hooks
    def install(self, grad_arriving: Callable[[int], None]) -> None:
        """Hooks on every host-trained param: before its grad is accumulated, ``grad_arriving(layer)`` (the
        engine makes the layer resident: autograd writes ``.grad`` with the param's shape, and a streamed
        param's shape is empty while it is out); after, the grad is sent home."""
        for layer in self.layers.values():
            for tp in layer.params:
                param = tp.param
                self._hooks.append(param.register_hook(partial(_before_accumulate, grad_arriving, layer.index)))
                self._hooks.append(param.register_post_accumulate_grad_hook(partial(self._grad_ready, layer, tp)))

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def pinned_bytes(self) -> int:
        """Page-locked bytes this module holds: landings, and for device updates the masters, sums and
        moments (packed copies are the host store's), counted where they are allocated."""
        return self._memory.nbytes + (self.updater.pinned_bytes() if self.updater is not None else 0)

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._by_param

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        tp = self._by_param.get(id(param))
        return tp.master if tp is not None else None

    def _grad_ready(self, layer: TrainedLayer, tp: TrainedParam, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: take the grad off the param; it is sent home with the layer's next
        group (:meth:`_send_group`)."""
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        batch = layer.batch
        if batch is not None and tp.position in batch.params:  # a second grad in one pass: its own batch
            self._close(layer)
            batch = None
        if batch is None:
            if layer.direct is not None:  # a second batch this step: sum on the host after all
                self._accumulate_direct(layer)
            if layer.accumulating is not None:
                self._wait(layer.accumulating)  # the landing is still being read
            batch = layer.batch = GradBatch(layer.index)
        if self._grouping is not layer:  # another layer's grads began: its group goes now, not at its close
            if self._grouping is not None:
                self._send_group(self._grouping)
            self._grouping = layer
        batch.params.add(tp.position)
        layer.group.append((tp, grad))
        layer.group_bytes += grad.nbytes
        if len(batch.params) == len(layer.params):
            self._close(layer)
        elif layer.group_bytes >= SEND_GROUP_BYTES:
            self._send_group(layer)

    def _send_group(self, layer: TrainedLayer) -> None:
        """Send the grads the open batch holds on the device: one stream switch and, where the update reads
        the landings directly, one norm kernel for the group (the norms clipping needs, taken before the
        grads leave the device)."""
        group, layer.group, layer.group_bytes = layer.group, [], 0
        if not group:
            return
        grads = [grad for _, grad in group]
        if self.direct and self.clipping and layer.accumulating is None:  # this batch is read directly
            for (tp, _), norm in zip(group, grad_norms(grads), strict=True):
                tp.direct_norm = norm
        pairs = [(tp.landing, grad) for (tp, _), grad in zip(group, grads)]
        copy = self.transport.submit(Direction.GRADS_HOME, pairs, after_compute=True, late=self._late_grads)
        layer.batch.copies.append(copy)

    def _close(self, layer: TrainedLayer) -> None:
        self._send_group(layer)
        batch, layer.batch = layer.batch, None
        batch.done = self.transport.join(batch.copies)
        last = self._backwards + 1 >= self.accumulation_steps
        if self.direct and layer.accumulating is None and all(tp.fresh for tp in layer.params):
            layer.direct = batch  # the update reads the landings: no host pass over the gradients
        else:
            job = Job(layer.index, "accumulate", partial(self._accumulate, layer, batch, last))
            layer.accumulating = job
            self._submit(job)
        if last and not self.clipping:  # nothing to wait for: update while the backward goes on
            self._queue_update(layer, None, self.lr_source())
            layer.updated_early = True

    def backward_done(self) -> None:
        """The backward pass ended: close the batches of layers that did not get every grad."""
        for layer in self.layers.values():
            if layer.batch is not None:
                self._close(layer)
        self._backwards += 1

    # ---------------------------------------------------------------- jobs
    def _accumulate_direct(self, layer: TrainedLayer) -> None:
        """A layer read straight from its landings got a second batch this step: sum its first one on the
        host (an accumulate job) before the landings are rewritten."""
        batch, layer.direct = layer.direct, None
        for tp in layer.params:
            tp.direct_norm = None
        job = Job(layer.index, "accumulate", partial(self._accumulate, layer, batch, True))
        layer.accumulating = job
        self._submit(job)

    def _land(self, batch: GradBatch) -> None:
        """The host may read the (closed) batch's landings after this (it waits for their copies)."""
        self.transport.land(batch.done)

    def _accumulate(self, layer: TrainedLayer, batch: GradBatch, last: bool) -> None:
        self._land(batch)
        with torch.no_grad():
            for tp in layer.params:
                if tp.position not in batch.params:
                    continue
                acc = self._sum_of(tp)
                if tp.fresh:
                    acc.copy_(tp.landing)
                    tp.fresh = False
                else:
                    acc.add_(tp.landing)
                tp.norm = grad_norms([acc])[0] if last and self.clipping else None

    def _on_device(self, layer: TrainedLayer) -> bool:
        return self.updater is not None and (self.split is None or self.split.on_device[layer.index])

    def _update(self, layer: TrainedLayer, coef: torch.Tensor | None, lr: float | None, on_device: bool) -> None:
        """The update job: ``on_device`` is the side the layer had when the job was queued (without clipping,
        the next step's assignment can change sides before a job queued during backward runs)."""
        if on_device:
            self._update_on_device(layer, coef, lr)
            return
        began = time.perf_counter()
        direct, layer.direct = layer.direct, None
        if direct is not None:  # split updates: read the landings (after their copies)
            layer.accumulating = None
            self._land(direct)
        if layer.update_done is not None:  # the previous update ran on the device: its state must be home
            self.transport.land(layer.update_done)
            layer.update_done = None
        on_worker = self.worker.on_thread()
        offset = 0
        with torch.no_grad(), _threads(update_threads(torch.get_num_threads()) if on_worker else None):
            for tp in layer.params:
                if direct is not None and tp.position in direct.params:
                    grad = tp.landing
                    if grad.dtype != torch.float32:
                        n = grad.numel()
                        grad = self._grads(layer.numel)[offset : offset + n].view(grad.shape).copy_(grad)
                        offset += n
                elif not tp.fresh:
                    grad = tp.acc
                else:
                    tp.master.grad = None
                    continue
                if coef is not None:
                    grad.mul_(coef)
                tp.master.grad = grad
            if lr is not None:
                for group in layer.optimizer.param_groups:
                    group["lr"] = lr
            layer.optimizer.step()
            for tp in layer.params:
                if tp.master.grad is not None:
                    tp.master.grad = None
                    if tp.packed is not None:
                        tp.packed.copy_(tp.master)
                tp.fresh, tp.norm, tp.direct_norm = True, None, None
        if self.split is not None:
            self._host_work.append((layer.numel, time.perf_counter() - began))

    def _grads(self, numel: int) -> torch.Tensor:
        """The reused fp32 buffer a host update converts a layer's gradient landings into."""
        if self._grad_buffer is None or self._grad_buffer.numel() < numel:
            largest = max(layer.numel for layer in self.layers.values())
            self._grad_buffer = torch.empty(max(numel, largest), dtype=torch.float32)
        return self._grad_buffer

    def _update_on_device(self, layer: TrainedLayer, coef: torch.Tensor | None, lr: float | None) -> None:
        """The layer's AdamW step on the device (:mod:`.device_update`), in the optimizer's param order."""
        direct, layer.direct = layer.direct, None
        layer.accumulating = None  # done (waited for, or run before this job): the next step may read directly
        after = (direct.done,) if direct is not None else ()  # the landings are read after their copies
        began = time.perf_counter()
        previous = layer.update_done
        if layer.flat is not None and direct is not None and len(direct.params) == len(layer.params):
            layer.update_done = self.updater.update_flat(layer.optimizer, layer.flat, coef, lr, after, previous)
        else:
            work = []
            for tp, group in layer.in_groups:
                if direct is not None and tp.position in direct.params:
                    work.append(ParamUpdate(tp.master, tp.landing, tp.packed, group))
                elif not tp.fresh:
                    work.append(ParamUpdate(tp.master, tp.acc, tp.packed, group))
            layer.update_done = self.updater.update(layer.optimizer, work, coef, lr, after, previous)
        if self.split is not None and not self.updater.cuda:  # on CUDA the step's span is timed on the device
            self._device_work.append((layer.numel, time.perf_counter() - began))
        for tp in layer.params:
            tp.fresh, tp.norm, tp.direct_norm = True, None, None

    def _submit(self, job: Job) -> None:
        job.done = self.worker.put(partial(self._run, job))

    def _wait(self, job: Job) -> None:
        if job.done.is_set():
            return
        began = time.perf_counter()
        try:
            self.worker.wait(job.done)
        finally:
            self.waited_s += time.perf_counter() - began

    def _run(self, job: Job) -> None:
        began = time.perf_counter()
        job.run()
        self.job_s[job.kind] += time.perf_counter() - began

    def check(self) -> None:
        self.worker.check()

    def finish(self) -> None:
        """Run every job submitted so far, and bring every device update home (state dicts, removal)."""
        jobs = [j for layer in self.layers.values() for j in (layer.accumulating, layer.update) if j is not None]
        for job in jobs:
            self._wait(job)
        self.transport.synchronize(Direction.GRADS_HOME)
        if self.updater is not None:
            self.updater.synchronize()

    # ---------------------------------------------------------------- what the trainer calls
    def wait_update(self, idx: int) -> Copy | None:
        """Before layer ``idx``'s packed copy is streamed: its latest update must be written. Host updates
        are waited for here; for a device update on CUDA the event its copy must wait for is returned."""
        layer = self.layers.get(idx)
        if layer is None:
            return None
        if layer.update is not None:
            self._wait(layer.update)
            layer.update = None
        return layer.update_done

    def clip_grad_norm_(
        self,
        params: Iterable[torch.Tensor],
        max_norm: float,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One gradient norm over ``params`` (host-trained ones from their accumulators, the others from
        ``.grad``), in their order; device grads are scaled now, host ones in :meth:`step`. ``reduce`` sums
        the squared norm over other processes that hold other layers (pipeline stages). Returns the total
        norm (a CPU float32 tensor)."""
        if not self.clipping:
            raise DGLSUserError(
                "gradient clipping was asked for, but DGLS was told there is none (clip_grads = False), so the host "
                "updates of streamed layers ran during backward: set clip_grads = True"
            )
        for layer in self.layers.values():
            if layer.accumulating is not None:
                self._wait(layer.accumulating)
        norms: list[torch.Tensor | int] = []  # a host norm, or the index of a device one
        on_device: list[torch.Tensor] = []
        device_grads = []
        for p in params:
            tp = self._by_param.get(id(p))
            if tp is not None:
                if tp.direct_norm is not None:
                    norms.append(len(on_device))
                    on_device.append(tp.direct_norm)
                elif not tp.fresh:
                    norms.append(tp.norm if tp.norm is not None else grad_norms([tp.acc])[0])
            elif p.grad is not None:
                norms.append(len(on_device))
                on_device.append(torch.linalg.vector_norm(p.grad.detach().float(), 2))
                device_grads.append(p.grad)
        if on_device:  # one copy home for all of them
            fetched = torch.stack([n.to(on_device[0].device) for n in on_device]).cpu().unbind()
            norms = [fetched[n] if isinstance(n, int) else n for n in norms]
        squared = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float32)
        if reduce is not None:
            squared = reduce(squared)
        total = squared.sqrt()
        coef = torch.clamp(torch.tensor(float(max_norm), dtype=torch.float32) / (total + 1e-6), max=1.0)
        for grad in device_grads:
            grad.detach().mul_(coef.to(grad.device))
        self._coef = coef
        return total

    def step(self, lr: float | None = None) -> None:
        """Queue every layer's update (layer order); ``lr`` overrides the spec's (a schedule's current lr)."""
        coef, self._coef = self._coef, None
        timed = self._rebalance()
        queued = 0
        for layer in self.layers.values():
            for tp in layer.params:
                tp.param.grad = None  # a trainer may have zero-filled it (DeepSpeed's gradient reduction)
            if layer.updated_early:
                layer.updated_early = False
            else:
                self._queue_update(layer, coef, lr)
                queued += layer.numel if self._on_device(layer) else 0
        if timed is not None and queued:
            self._device_span = (timed, self.updater.mark(end=True), queued)
        self._backwards = 0

    def _rebalance(self) -> torch.cuda.Event | None:
        """Split updates: fold the last step's measured rates in and assign this step's sides; on CUDA with
        clipping (every update queued now) returns the event that starts timing the device's share."""
        if self.split is None:
            return None
        work, self._host_work = self._host_work, []
        if work:
            self.split.record_host(sum(n for n, _ in work), sum(s for _, s in work))
        work, self._device_work = self._device_work, []
        if work:
            self.split.record_device(sum(n for n, _ in work), sum(s for _, s in work))
        span, self._device_span = self._device_span, None
        if span is not None and span[1].query():
            self.split.record_device(span[2], span[0].elapsed_time(span[1]) / 1000)
        if self.updater.timeline is not None:  # read steps whose chunks all went home; later ones next time
            self._timelines.append(self.updater.timeline)
            self.updater.timeline = []
            while self._timelines:
                if self._timelines[0]:
                    busy = timeline_busy(self._timelines[0])
                    if busy is None:
                        break
                    self.split.record_device(*busy)
                self._timelines.pop(0)
        self.split.assign(self.layers)
        return self.updater.mark(end=False) if self.clipping else None

    def _queue_update(self, layer: TrainedLayer, coef: torch.Tensor | None, lr: float | None) -> None:
        on_device = self._on_device(layer)
        if on_device and self.updater.cuda:  # enqueued on the device's streams now
            if layer.accumulating is not None:
                self._wait(layer.accumulating)  # its host sum is what the update copies in
            if layer.update is not None:  # split: the previous update ran on the host and writes the state
                self._wait(layer.update)
                layer.update = None
            self._update_on_device(layer, coef, lr)
            return
        job = Job(layer.index, "update", partial(self._update, layer, coef, lr, on_device))
        layer.update = job
        self._submit(job)

    def state_dict(self) -> dict:
        """The optimizer state of every host-trained layer (the masters are in the model's state dict)."""
        self.finish()
        return {idx: layer.optimizer.state_dict() for idx, layer in self.layers.items()}

    def state_problem(self, state: object) -> str | None:
        """Why ``state`` (a :meth:`state_dict` read back from a checkpoint) cannot be loaded into these layers, or
        None: it must hold the optimizer state of exactly these layers, each param's moments of that param's shape
        and of this optimizer's kind. torch's own ``load_state_dict`` checks only the number of params, so a
        checkpoint saved with another placement or optimizer would load into the wrong layers, or be dropped."""
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
            if any(("betas" in g) != (self.spec.type == "adamw") for g in groups):
                saved_kind = "AdamW" if "betas" in groups[0] else "SGD"
                return f"holds {saved_kind} state for layer {idx}, and [optimizer] type is {self.spec.type!r} here"
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
        if (problem := self.state_problem(state)) is not None:
            raise DGLSUserError(f"the host optimizer state {problem}")
        self.finish()
        for idx, layer in self.layers.items():
            replaced = [t for s in layer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            settings = [{k: v for k, v in g.items() if k != "params"} for g in layer.optimizer.param_groups]
            layer.optimizer.load_state_dict(state[idx] if idx in state else state[str(idx)])
            if keep_hyper_parameters:
                for group, kept in zip(layer.optimizer.param_groups, settings):
                    group.update(kept)
            if self.updater is not None:
                self.updater.adopt_state(layer.optimizer, layer.flat, replaced)

    def close(self) -> None:
        """Finish the queued work (the transport stops its worker thread itself) and remove the hooks."""
        try:
            if self.worker.threaded and self.worker.error is None:
                self.finish()
        finally:
            self.remove_hooks()


def _initial(p, packed: torch.Tensor) -> torch.Tensor:
    """A param's starting value for its fp32 master (its packed copy while it is streamed out)."""
    return p.param.data if p.param.numel() else packed


def _before_accumulate(grad_arriving: Callable[[int], None], idx: int, grad: torch.Tensor) -> None:
    grad_arriving(idx)


def host_training_bytes(
    layouts: list[LayerLayout], streamed: Iterable[int], spec: HostOptimizerSpec, sums: bool = True
) -> dict[str, int]:
    """Host bytes full fine-tuning of the streamed layers needs beyond their packed copies (the start-up
    report and the RAM check use this). ``sums``: fp32 gradient sums (kept with several micro-batches a
    step; with one, the updates read the landings)."""
    masters = gradients = optimizer = 0
    for idx in streamed:
        for p in layouts[idx].params:
            if not p.param.requires_grad:
                continue
            n = p.param.numel()
            masters += 0 if p.dtype == torch.float32 else 4 * n
            gradients += 4 * n * sums + aligned(p.nbytes)
            optimizer += spec.state_bytes_per_param * n
    return {"masters": masters, "gradients": gradients, "optimizer": optimizer}


def check_host_training(
    layouts: list[LayerLayout], streamed: Iterable[int], spec: HostOptimizerSpec, accumulation_steps: int = 1
) -> str:
    """Refuse, with the numbers, when the host cannot hold the masters, gradients and optimizer state and
    still keep its reserve (a tenth of its RAM, 2 GiB at least: the weight store's rule; much of this is
    page-locked, which the host cannot swap out); otherwise the start-up line that says how much they take."""
    sums = accumulation_steps != 1  # with one micro-batch a step the updates read the landings
    parts = host_training_bytes(layouts, streamed, spec, sums)
    need = sum(parts.values())
    memory = psutil.virtual_memory()
    reserve = ram_reserve(memory.total)
    described = ", ".join(f"{name} {human_bytes(n)}" for name, n in parts.items())
    if need > memory.available - reserve:
        raise DGLSUserError(
            f"full fine-tuning of the streamed layers needs {human_bytes(need)} of host RAM ({described}) beyond "
            f"their packed weights, and {human_bytes(memory.available)} is free, of which "
            f"{human_bytes(reserve)} stays for the rest of the host: stream fewer layers (blocks_to_swap), or free RAM"
        )
    return f"DGLS host training: {human_bytes(need)} of host RAM ({described})"
