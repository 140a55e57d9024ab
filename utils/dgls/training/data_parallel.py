"""Data-parallel full fine-tuning over shared host memory (ZeRO-1 style, one machine).

Data-parallel processes on one machine already stream from one host copy of the streamed layers' weights
(:mod:`..memory.peers`). To train those layers, each process updates only its *share* of them:

- Ownership (:class:`Ownership`): every host-trained layer has one owner, the same on every process (assigned
  in layer order to the process with the fewest trained params so far; the entries of one module share an owner).
  Only the owner builds the layer's fp32 master, gradient landings and optimizer state, so the machine holds one
  copy of each; for an fp32 model the shared packed copy is the master itself.
- Gradients (:class:`SharedGradients`): a post-accumulate-grad hook on every trained param of a streamed layer,
  installed before the host training's own, takes the param's gradient into its layer's *bucket*, and once the
  layer's gradients are all in, launches one asynchronous ``torch.distributed.reduce`` (SUM) of the bucket to the
  layer's owner; the owner divides by the number of processes (the mean, as DeepSpeed's data-parallel reduction of
  the resident params' gradients) and hands each param's mean to its host training (landings, sums, norms, update).
  Why a reduce to the owner, not a reduce-scatter: every layer has exactly one owner, so the reduce *is* a
  reduce-scatter of the model's gradients with layer-sized shards, launched layer by layer as the backward makes
  them (one collective per layer, the owner gets its layer's exact sum, in the backend's order); with the owners
  balanced each process sends about what one reduce-scatter of the whole model's gradients would. Splitting each
  layer over the processes would need a layer's update split too, and the ownership is per layer.
- Layer-major steps (:mod:`..engine.layer_major`): the hook first adds each micro-batch's gradient to the step's
  device sum (:mod:`.device_sums`, the host training's same object); only the layer's last micro-batch's sum goes
  into the bucket (a param without a gradient in that micro-batch: its sum, when the schedule flushes the sums after
  the layer's micro-batches, through the same ``_into_bucket``): one reduction per layer a step, not one per
  micro-batch; the owner's host training gets the reduced sum as the step's one gradient.
- Clipping: the host part of the squared gradient norm is summed over the processes (each owner counts its own
  layers once); the resident params' gradients are already the same everywhere and count once.
- Publication, per layer (:meth:`SharedGradients.publish`, :meth:`SharedGradients.wait_published`): the shared
  host copy has a *version* per layer (:attr:`~..streaming.masters.Masters.versions`, int64 in shared memory: the
  number of the step whose update it holds). After the step's updates are queued, each process counts the step
  (``step``) and has its host training write each owned layer's version once that layer's update is written
  (:meth:`~.host_training.HostTraining.when_written`: a job after the layer's update, redo included, on the one job
  queue). Before a foreign layer's packed copy is fetched, a process waits until its version reaches its own step
  count; a read of the true weights (a save, ``true_weights``, removal: the feature's flush) waits for every foreign
  layer's. So the next forward's fetches read updated weights, and a process goes on to the next step's forward
  while the owners still write the updates of layers it uses later. (With a barrier after each step every process
  waited for every update: an SDXL step on 2x H200 spent 684 ms after its gradient all-reduce, against 1.28 s for
  the whole step on one GPU, benchmarks/results/scaling_sdxl_full_12.md; published per layer, 2 GPUs train 2.13x
  and 4 GPUs 4.36x one GPU's samples per second, each process updating its share, scaling_sdxl_full_124.md.)
  Every streamed trained layer is evicted when a backward ends, so no slot keeps an old copy.

Buckets (layout)
    - A layer's bucket is flat, one segment per dtype (a layer computes in one, so one segment and one collective),
      each param at a fixed offset in layout order (:class:`BucketSlot`, from the layout's shapes: a streamed param
      is an empty placeholder while it is out), the same on every process.
    - Buckets are pool buffers of the largest layer's size: ``in_flight + 1`` per dtype (one open, ``in_flight``
      reducing), so the device memory of the reduction is that many layers' gradients whatever the depth, during
      the backward only (the pool goes back to the allocator at its end, after every wait). A placement that leaves
      less device memory free than that during the backward runs out of it: the placement is the user's here (a
      VRAM budget's planner is refused, below), and the start-up placement line says how much the pool takes
      (:attr:`SharedGradients.pool_bytes`).

Mechanics
    1. A gradient arriving is copied into its layer's open bucket (the param keeps none; its own tensor is freed).
       One bucket is open: the layer whose gradients arrived last. It is launched when it holds every param's
       gradient, when another layer's gradients begin (a param without one this pass: every process runs the same
       backward, so the bucket misses it everywhere), when a param it holds gets a second gradient in one pass
       (reentrant checkpointing), or when the backward ends.
    2. Launch: where ``in_flight`` buckets already reduce, the oldest is waited for first (step 3); then one
       ``reduce(async_op=True)`` per segment. Layer k's reduction runs beside the backward of the layers before it.
    3. Completion, oldest first (the processes wait in one order): wait for the bucket's works; on the owner each
       param's mean is a new tensor (``view / size``), handed to its host training
       (:meth:`~.grad_return.GradReturn.receive`); the buffers go back to the pool. The backward's end completes
       every bucket, before the host training closes the step's batches.
    4. On the CPU (gloo) a reduction runs only when waited for (:class:`LateReduce`, as the CPU transport lands its
       copies late): a missing wait, or a bucket rewritten before its wait, changes the numbers in a CPU test.

Streams (NCCL)
    - A reduction runs on NCCL's stream after the compute stream's copies into its bucket (NCCL orders it after the
      current stream); waiting makes the compute stream wait for it, so the owner's division (and the copy home,
      ordered after the compute stream) reads the sum, and the next copy into the buffer comes after the send.

Hazards handled
    - A foreign layer is fetched only once its owner wrote this step's update into the shared copy (its version;
      else: the weights a step old, about 1e-2 off in tests/test_data_parallel_full.py). An owner's next update
      of a layer needs the layer's next reduction, so every process has finished with the layer's current weights
      (its forward and its backward's recompute) before they are rewritten. The version is stored after the
      update's writes on the job thread (a device update's copy home landed first); on x86-64 a reader that sees
      the version sees those writes (stores are not reordered with stores, nor loads with loads).
    - A process that waits for a version whose owner is gone (killed, crashed) stops with one line, as a collective
      whose partner is gone does (:func:`peer_failure`); an owner still running is waited for however long.
    - An owner reads a bucket only after waiting for its reduction (else: its own gradient, unreduced).
    - A bucket's buffer is rewritten only after its reduction was waited for (else another layer's bytes are sent).
    - The owner's means are tensors of their own, not views of the bucket: the buffer is reused while the host
      training's copy home may still read them.
    - Every launched reduction is waited for before the step's norm and updates read the gradients
      (:meth:`SharedGradients.backward_done`, before the host training's).

Refused (one line each)
    - An optimizer whose step sums over every param (Prodigy's d): each instance would see one share.
    - A VRAM budget's planner: it may make layers resident after its probe, and owners are fixed at start-up.
    - Processes that do not all map the one host copy (several machines, no ``/dev/shm``, pipeline stages).
    - A collective whose partner process is gone (killed, crashed): :func:`peer_failure`, instead of a traceback.
    - Under diffusion-pipe's train.py, ``gradient_release`` (train.py asserts one data-parallel process for it).

Saves (:mod:`.shared_saves`)
    A trainer saves from data-parallel rank 0 (diffusion-pipe: ``Saver.save_full_model`` and DeepSpeed's layer
    files), which holds fp32 masters only for its own share: for a save every owner sends it its own masters (on the
    CPU, over a gloo group every rank makes at start-up: ``SharedGradients.save_group``), and each process writes its
    share of the host optimizer state to a file of its own (a resume merges them, with any number of processes).
    Tested end to end in tests/test_diffusion_pipe_data_parallel_real.py.

Invariants
    - Every process runs the same backward (the same layers, the same params with gradients, in the same order):
      the buckets are the same on every process, and their reductions are collectives matched by launch order
      (waited for in that order too). A param without a gradient on one process must have none on all (the demo's
      and diffusion-pipe's models give every trained param one).
    - Equal to one process with the global batch up to the order of summation (each process's mean over its rows,
      then the mean over processes).
    - The processes of the job are the processes that host these layers, all on one machine (one pipeline stage);
      checked at start-up.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn

from ..errors import DGLSUserError
from .device_sums import DeviceSums
from .host_optimizer import HostOptimizerSpec


@dataclass(frozen=True)
class Ownership:
    """Which process updates each host-trained layer (entry index -> rank of the default group)."""

    rank: int
    size: int
    owners: dict[int, int]

    @classmethod
    def assign(cls, numels: Mapping[int, int], groups: Mapping[int, int], rank: int, size: int) -> Ownership:
        """Owners for the layers ``numels`` (entry -> trained params) in layer order: each module (``groups``:
        entry -> its module) goes to the process with the fewest trained params so far (the lowest rank on ties).
        The same on every process: it reads only the layers' sizes."""
        load = [0] * size
        by_module: dict[int, int] = {}
        owners = {}
        for idx in sorted(numels):
            module = groups.get(idx, idx)
            if module not in by_module:
                by_module[module] = min(range(size), key=lambda r: (load[r], r))
            owners[idx] = by_module[module]
            load[owners[idx]] += numels[idx]
        return cls(rank, size, owners)

    @property
    def owned(self) -> list[int]:
        return [idx for idx, owner in self.owners.items() if owner == self.rank]

    @property
    def foreign(self) -> list[int]:
        return [idx for idx, owner in self.owners.items() if owner != self.rank]

    def line(self) -> str:
        counts = [sum(1 for o in self.owners.values() if o == r) for r in range(self.size)]
        return (
            f"DGLS data parallel: each of the {self.size} processes updates its share of the {len(self.owners)} "
            f"host-trained layers ({'/'.join(map(str, counts))}), with one copy of their masters and optimizer state "
            "on this machine; gradients are reduced to each layer's owner during the backward, and each layer's "
            "update is published to the others as soon as it is written"
        )


def job_ownership(numels: Mapping[int, int], groups: Mapping[int, int]) -> Ownership:
    """The ownership over the processes of this ``torch.distributed`` job (its default group)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise DGLSUserError(
            "data_parallel full fine-tuning shares the streamed layers' training among the processes of a "
            "torch.distributed job, and none is initialized: start the processes with a launcher (deepspeed, "
            "torchrun) and init_process_group before building the swapper, or drop data_parallel"
        )
    return Ownership.assign(numels, groups, dist.get_rank(), dist.get_world_size())


def refuse_whole_step(spec: HostOptimizerSpec) -> None:
    """An optimizer whose step sums over every param (Prodigy's and D-Adaptation's d) would see only one process's
    share of the streamed layers: refused, before anything starts where the caller knows it is data parallel."""
    if spec.whole_step:
        raise DGLSUserError(
            f"[optimizer] type {spec.type!r} steps one instance over every param (its step sums over all of them), "
            "and data-parallel full fine-tuning splits the streamed layers' updates among the processes: train it "
            "with pipeline stages or on one GPU, or pick a per-param type (adamw ...)"
        )


def check_shared(ownership: Ownership, local_ranks: int) -> None:
    """Every process of the job must map the one host copy (one machine, the same layers): an owner's update is
    then every process's weight."""
    if ownership.size > 1 and local_ranks != ownership.size:
        where = (
            "do not share a host copy (no /dev/shm here)"
            if local_ranks == 1
            else f"share a host copy {local_ranks} by {local_ranks}"
        )
        raise DGLSUserError(
            f"data-parallel full fine-tuning runs on one machine, where the processes share one host copy of the "
            f"streamed layers, and the {ownership.size} processes of this job {where}: run them on one machine with "
            "a writable /dev/shm, use pipeline stages (pipeline_stages = number of GPUs), or train a LoRA"
        )


IN_FLIGHT = 2  # layers' buckets whose reduction runs beside the backward; the oldest is waited for before another


@dataclass(frozen=True)
class BucketSlot:
    """Where one trained param's gradient goes in its layer's bucket: the segment of its dtype, at ``offset``
    (elements), in layout order; the same on every process (it reads only the layers' layouts)."""

    position: int  # in the layer's trained params (layout order)
    param: nn.Parameter
    dtype: torch.dtype
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(eq=False)
class Bucket:
    """One layer's gradients of one backward pass (or, layer-major, of one step), flat, one buffer per dtype (a
    pool buffer: only its first ``sizes[dtype]`` elements are the layer's). Open while its gradients arrive, then in
    flight: ``works`` are its reductions, one per dtype (one: a layer computes in one dtype)."""

    layer: int
    buffers: dict[torch.dtype, torch.Tensor]
    sizes: dict[torch.dtype, int]
    filled: dict[int, BucketSlot] = field(default_factory=dict)  # position -> slot, for the params it holds
    works: list = field(default_factory=list)

    def flat(self, dtype: torch.dtype) -> torch.Tensor:
        return self.buffers[dtype][: self.sizes[dtype]]

    def view(self, slot: BucketSlot) -> torch.Tensor:
        return self.buffers[slot.dtype][slot.offset : slot.offset + slot.numel].view(slot.shape)


class LateReduce:
    """The CPU's reduction, as the CPU transport's copies: it runs only when waited for (a blocking
    ``torch.distributed.reduce`` in :meth:`wait`), so in a CPU test an owner that reads its bucket without waiting
    reads its own unreduced bytes, and a bucket rewritten before its wait sends another layer's. The processes wait
    in one order (the buckets' launch order), so the deferred collectives still match."""

    def __init__(self, tensor: torch.Tensor, dst: int) -> None:
        self.tensor, self.dst, self.done = tensor, dst, False

    def wait(self) -> bool:
        if not self.done:
            dist = torch.distributed
            dist.reduce(self.tensor, dst=self.dst, op=dist.ReduceOp.SUM)
            self.done = True
        return True


class SharedGradients:
    """The reduce hooks of every trained param of the streamed layers, their buckets, and the step's publication (see
    the module doc). ``params``: entry -> its trained params (layout order), for every host-trained layer; ``shapes``:
    entry -> each param's (shape, dtype) in the layout (a streamed param is an empty placeholder while it is out;
    None: the params' own). ``in_flight``: buckets reducing beside the backward at once. ``late``: reductions run
    when waited for (:class:`LateReduce`); None: for CPU tensors, as the CPU transport's copies. For the saves
    (:mod:`.shared_saves`): ``own_masters``, the ``id`` of each param whose owner holds an fp32 master of its own
    (the layout's flag, the same on every process; None: every param), and ``save_group``, the process group they
    send masters over (None: the default group)."""

    def __init__(
        self,
        ownership: Ownership,
        params: Mapping[int, Sequence[nn.Parameter]],
        shapes: Mapping[int, Sequence[tuple[torch.Size, torch.dtype]]] | None = None,
        *,
        in_flight: int = IN_FLIGHT,
        late: bool | None = None,
        own_masters: frozenset[int] | None = None,
        save_group: object | None = None,
    ) -> None:
        self.ownership = ownership
        self.own_masters = own_masters
        self.save_group = save_group
        self.params = dict(params)
        self.in_flight = in_flight
        self.late = late
        self._hooks: list = []
        self._slots: dict[int, BucketSlot] = {}  # id(param) -> its slot
        self._sizes: dict[int, dict[torch.dtype, int]] = {}  # entry -> elements of each dtype's segment
        for idx, layer in self.params.items():
            laid = shapes[idx] if shapes is not None else [(p.shape, p.dtype) for p in layer]
            sizes = self._sizes[idx] = {}
            for position, (param, (shape, dtype)) in enumerate(zip(layer, laid, strict=True)):
                self._slots[id(param)] = BucketSlot(position, param, dtype, torch.Size(shape), sizes.get(dtype, 0))
                sizes[dtype] = sizes.get(dtype, 0) + self._slots[id(param)].numel
        self._largest: dict[torch.dtype, int] = {}  # a pool buffer's elements, per dtype: the largest layer's segment
        for sizes in self._sizes.values():
            for dtype, numel in sizes.items():
                self._largest[dtype] = max(self._largest.get(dtype, 0), numel)
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}  # pool buffers not in a bucket
        self._allocated: dict[tuple[torch.dtype, torch.device], int] = {}
        self._open: Bucket | None = None  # the bucket collecting (the layer whose gradients arrived last)
        self._flight: deque[Bucket] = deque()  # launched, not waited for; oldest first
        self._deliver: Callable[[nn.Parameter, torch.Tensor], None] = _nowhere
        self.collectives = 0  # reductions launched (one per bucket and dtype)
        # The layer-major schedule's (the host training's same object): a layer's gradients summed on the device over
        # the step's micro-batches, reduced once at its last (:mod:`.device_sums`)
        self.device_sums: DeviceSums | None = None
        # the publication: the shared copy's versions and the sharing processes' liveness (attach_versions), and
        # the steps this process has published (a foreign layer is fetched once its version reaches it)
        self.versions: np.ndarray | None = None  # a view of the shared int64s: a read or store is one element's
        self._running: Callable[[int], bool] = lambda rank: True
        self.step = 0

    def install(
        self, grad_arriving: Callable[[int], None], deliver: Callable[[nn.Parameter, torch.Tensor], None]
    ) -> None:
        """Hooks on every trained param; call before the host training installs its own (post-accumulate-grad
        hooks run in the order they were registered: the host training's find no ``.grad``). A foreign layer's
        gradient arriving is a use of it, as the host training makes it for its own layers. ``deliver(param, grad)``:
        an owned param's reduced mean goes into the host training (:meth:`~.grad_return.GradReturn.receive`)."""
        self._deliver = deliver
        owned = set(self.ownership.owned)
        for idx, params in self.params.items():
            for param in params:
                if idx not in owned:
                    self._hooks.append(param.register_hook(partial(_arriving, grad_arriving, idx)))
                self._hooks.append(param.register_post_accumulate_grad_hook(partial(self._reduce, idx)))

    def _reduce(self, idx: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: the gradient goes into its layer's open bucket (the param keeps none); a full
        bucket is launched."""
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        if self.device_sums is not None:  # None: summed on the device until the layer's last micro-batch
            # a sum flushed after the layer's micro-batches comes back into the bucket as this one would
            send = partial(self._into_bucket, idx, param)
            grad = self.device_sums.add(param, grad, send, (idx, self._slots[id(param)].position))
            if grad is None:
                return
        self._into_bucket(idx, param, grad)

    def _into_bucket(self, idx: int, param: nn.Parameter, grad: torch.Tensor) -> None:
        """``grad`` into layer ``idx``'s open bucket (another layer's, or a second gradient of ``param`` in one
        pass, launches the open one first); a full bucket is launched."""
        slot = self._slots[id(param)]
        with peer_failure("the reduction of the streamed layers' gradients"):
            bucket = self._open
            if bucket is not None and (bucket.layer != idx or slot.position in bucket.filled):
                self._launch(bucket)  # another layer's gradients began, or a second one of this param in one pass
                bucket = None
            if bucket is None:
                bucket = self._open = self._new_bucket(idx, grad.device)
            with torch.no_grad():
                bucket.view(slot).copy_(grad)
            bucket.filled[slot.position] = slot
            if len(bucket.filled) == len(self.params[idx]):
                self._launch(bucket)

    def shape_of(self, param: nn.Parameter) -> torch.Size:
        """A trained param's full shape (its layout's: a streamed param is an empty placeholder while it is out)."""
        return self._slots[id(param)].shape

    @property
    def pool_bytes(self) -> int:
        """Device bytes of the bucket pool at its largest (``in_flight + 1`` buffers of each dtype, each the largest
        layer's segment), held during the backward: the start-up placement line counts them."""
        return sum((self.in_flight + 1) * n * dtype.itemsize for dtype, n in self._largest.items())

    def _new_bucket(self, idx: int, device: torch.device) -> Bucket:
        """A bucket for layer ``idx`` from the pool (at most ``in_flight`` buckets are in flight and none is open
        here, so one of its ``in_flight + 1`` buffers of each dtype is free)."""
        buffers = {}
        for dtype in self._sizes[idx]:
            key = (dtype, device)
            free = self._free.setdefault(key, [])
            if not free:
                if self._allocated.get(key, 0) > self.in_flight:
                    raise AssertionError("a bucket buffer was asked for with every pool buffer in a bucket")
                self._allocated[key] = self._allocated.get(key, 0) + 1
                free.append(torch.empty(self._largest[dtype], dtype=dtype, device=device))
            buffers[dtype] = free.pop()
        return Bucket(idx, buffers, self._sizes[idx])

    def _launch(self, bucket: Bucket) -> None:
        """One asynchronous reduction per dtype of ``bucket`` to its layer's owner, after the oldest in flight was
        waited for where ``in_flight`` are."""
        self._open = None
        while len(self._flight) >= self.in_flight:
            self._complete(self._flight.popleft())
        owner = self.ownership.owners[bucket.layer]
        dist = torch.distributed
        for dtype in bucket.sizes:
            flat = bucket.flat(dtype)
            late = self.late if self.late is not None else flat.device.type == "cpu"
            work = (
                LateReduce(flat, owner) if late else dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM, async_op=True)
            )
            bucket.works.append(work)
            self.collectives += 1
        self._flight.append(bucket)

    def _complete(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s reductions; on its owner each param's mean (a tensor of its own: the buffer goes
        back to the pool) goes into the host training. Then its buffers may be rewritten."""
        for work in bucket.works:
            work.wait()
        if self.ownership.owners[bucket.layer] == self.ownership.rank:
            with torch.no_grad():
                for position in sorted(bucket.filled):
                    slot = bucket.filled[position]
                    self._deliver(slot.param, bucket.view(slot).div(self.ownership.size))
        for dtype, buffer in bucket.buffers.items():
            self._free[(dtype, buffer.device)].append(buffer)
        bucket.buffers = {}

    def backward_done(self) -> None:
        """The backward ended: the open bucket (a layer that did not get every gradient) is launched, and every
        bucket in flight waited for (an owner's gradients are in its host training before it closes them). The pool
        goes back to the allocator: the next forward's activations may use that memory."""
        with peer_failure("the reduction of the streamed layers' gradients"):
            if self._open is not None:
                self._launch(self._open)
            while self._flight:
                self._complete(self._flight.popleft())
        self._free.clear()
        self._allocated.clear()

    def norm_sum(self, squared: torch.Tensor) -> torch.Tensor:
        """The host part of the squared gradient norm, summed over the processes (each owner holds its layers')."""
        dist = torch.distributed
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        value = squared.to(device, torch.float32)
        with peer_failure("the gradient norm"):
            dist.all_reduce(value)
        return value.cpu()

    def attach_versions(self, versions: torch.Tensor, running: Callable[[int], bool]) -> None:
        """The shared copy's versions (:attr:`~..streaming.masters.Masters.versions`), and whether the process of a
        rank still runs (:meth:`~..memory.peers.Peers.running`)."""
        self.versions = versions.numpy()  # the same memory: an element read is a lookup on the fetch path
        self._running = running

    def publish(self, when_written: Callable[[Callable[[int], None]], None]) -> None:
        """After the step's updates were queued: the step counted, and each owned layer's version set to it once its
        update is written (``when_written(written)``: the host training calls ``written(idx)`` then,
        :meth:`~.host_training.HostTraining.when_written`). A foreign layer's params lose any gradient a trainer
        zero-filled (DeepSpeed's reduction does), as the host training's own do."""
        if self.versions is None:
            raise AssertionError("data-parallel full fine-tuning publishes through the shared copy's versions")
        for idx in self.ownership.foreign:
            for param in self.params[idx]:
                param.grad = None
        self.step += 1
        when_written(partial(_store, self.versions, self.step))

    def wait_published(self, idx: int) -> None:
        """Before a foreign layer's packed copy is fetched: until its owner published this process's last step's
        update (its version reaches :attr:`step`). Polls the shared version (the owners' job threads write it, and a
        process has no event another can set); a gone owner is one line (see Hazards)."""
        versions = self.versions
        if versions is None or idx not in self.ownership.owners or versions[idx] >= self.step:
            return
        owner = self.ownership.owners[idx]
        pause, checked = 1e-5, time.monotonic()
        while versions[idx] < self.step:
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
            if time.monotonic() - checked >= 1.0:
                checked = time.monotonic()
                if not self._running(owner) and versions[idx] < self.step:
                    raise DGLSUserError(peer_gone(f"the update of layer {idx}, which it owns", "its process is gone"))

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def agree(problem: str | None) -> None:
    """Every process of the job raises the first problem any of them found (or none does): a check whose answer can
    differ between processes (free RAM, a file one of them reads) must not stop one while the others go on into a
    collective and wait for it."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    if problem:
        raise DGLSUserError(problem)


PEER_GONE = re.compile(r"peer|connection|timed out|timeout|NCCL", re.IGNORECASE)  # a collective's partner is gone


@contextmanager
def peer_failure(what: str) -> Iterator[None]:
    """A collective that fails because another process of the job is gone (killed, crashed: its connections
    closed) is one line: the processes share each step, so none can go on alone, and nothing of the step is kept."""
    try:
        yield
    except RuntimeError as exc:  # gloo's (plain RuntimeErrors) and NCCL's (DistBackendError is one)
        if not (isinstance(exc, torch.distributed.DistError) or PEER_GONE.search(str(exc))):
            raise
        raise DGLSUserError(peer_gone(what, _first_sentence(exc))) from None


def peer_gone(what: str, how: str) -> str:
    """The line of a process whose partner process stopped during ``what``."""
    return (
        f"another process of this data-parallel job stopped during {what} ({how}): the processes train each step "
        "together, so this one stops too; see that process's own error for why"
    )


def _store(versions: np.ndarray, step: int, idx: int) -> None:
    """Layer ``idx``'s update of ``step`` is in the shared copy (on the thread that wrote it, after its writes)."""
    versions[idx] = step


def _first_sentence(exc: Exception) -> str:
    """gloo's and NCCL's message without its source location and advice: 'Read error ...: Connection reset by peer'."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip().split("\n")[0])
    return text.split(". ")[0].rstrip(".") or type(exc).__name__


def _nowhere(param: nn.Parameter, grad: torch.Tensor) -> None:
    raise AssertionError("a reduced gradient arrived before install gave it a destination")


def _arriving(grad_arriving: Callable[[int], None], idx: int, grad: torch.Tensor) -> None:
    grad_arriving(idx)
