"""Activation offload: the inputs a checkpointed layer keeps for its recompute wait in host memory.

Why
    With activation checkpointing, what stays on the device between a layer's forward and its backward is
    the layer's inputs (the checkpoint keeps them to run the layer again). For a Wan-14B LoRA at 81 frames
    those are about 13 GiB, far more than the weights DGLS streams. They are written once in the forward
    and read once, in reverse order, in the backward: the same shape of traffic as streamed weights,
    in the other direction first (device to host, which LoRA training otherwise leaves idle).

What is offloaded
    :meth:`ActivationOffloader.wrap` wraps the trainer's checkpoint function (``torch.utils.checkpoint``,
    reentrant or not, diffusion-pipe's ``'unsloth'``, DeepSpeed's pipeline ``activation_checkpoint_func``).
    Each call with grad enabled is a *segment*: its tensor arguments on the device are what the checkpoint
    keeps. A segment's tensors go home once ``keep`` later segments were called, except those that a later
    call still takes (a tensor every block takes, such as a timestep vector, stays until the blocks that
    take it are past); so the inputs of the last ``keep`` segments of a forward never leave. ``keep`` is
    at least the prefetch depth, more when the VRAM-budget planner has room for more (it offloads only
    what the budget needs, see planner.py; a ``keep`` past the forward's segment count offloads nothing).
    Offloading is by storage: its bytes are copied to a pinned host buffer and the storage is resized to
    nothing, so every tensor and view on it holds no device memory until it is restored (and reads of it
    fail).

When it comes back
    The checkpoint calls the function again in backward (the recompute). The wrapper runs first: it
    restores the segment's storages (waiting for their copies), then starts the restores of the ``ahead``
    segments before it (the prefetch depth), which the backward reaches next. A call that takes a tensor
    already sent home (not expected from a pipeline, where each layer passes on what later ones need)
    restores it first.

Recompute offload (``recompute=True``, :mod:`.recompute_offload`) also sends home what each recompute
saves for its layer's backward, through :meth:`ActivationOffloader.send` and the same transport and pool; the
wrapper of the checkpointed function pushes its saved-tensor hooks in both runs.

Mechanics
    - Every copy goes through the transport (:mod:`..memory.transport`): an offload is a copy of the
      activations-out direction gated on the compute stream's marker (the tensor was just produced),
      after which the device storage is freed (the transport keeps it alive for the copy). A restore
      allocates on the compute stream and submits an activations-in copy gated on the offload's copy; the
      recompute acquires it (a timed wait where the transport times restores: the step stats' activation
      waits and ``--profile``). Host buffers are pinned and pooled by size; one goes back to the pool with
      the copy that last read it.
    - CPU: the transport's CPU backend fills a restored storage with NaN bytes at once and writes the
      saved bytes only when the recompute acquires it, so a recompute that reads its inputs without
      waiting computes with NaN and a CPU test fails.

Hazards handled
    - A storage shared by a later call's argument is never offloaded early (checked by storage, so a
      view counts as its base).
    - Segments whose graph was dropped without a backward (no recompute comes) are found by weak
      references and their host buffers reclaimed.
    - The same storage in two segments is offloaded once, by the segment that sees it last.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from ..errors import DGLSUserError
from ..memory.host_store import ram_short
from ..memory.layout import human_bytes
from ..memory.pinned import PinnedMemory
from ..memory.transport import Copy, Direction, Transport, make_transport
from ..streaming.feature import Feature
from ..torch_private import in_backward, storage_key
from .recompute_offload import Recomputed, RecomputeOffload, function_kind

if TYPE_CHECKING:
    from ..streaming.placement import Placement

MIN_BYTES = 64 * 1024  # on CUDA smaller tensors stay: not worth a copy each way (on the CPU, where offload
# only exercises the mechanics for tests, every size goes)


@dataclass(eq=False)
class Offload:
    """One storage sent home."""

    tensor: weakref.ref  # a tensor on the storage (the storage object is rebuilt from it)
    nbytes: int
    host: torch.Tensor  # pinned uint8 buffer of the pool
    sent: Copy | None = None  # the device-to-host copy
    restoring: Copy | None = None  # the host-to-device copy, once issued
    restored: bool = False  # waited for
    output: bool = False  # a checkpointed piece's kept output (comes back one segment later than inputs)
    key: int = 0  # its storage's identity (:func:`_storage_key`), for the index of what is at home


@dataclass(eq=False)
class Segment:
    """One checkpointed call of a forward pass."""

    storages: dict[int, weakref.ref]  # storage identity -> a tensor on it (those eligible to go home)
    previous: Segment | None  # the call before it in the forward (cut once this one was recomputed)
    position: int = 0  # its place among the forward's checkpointed calls
    outputs: set[int] = field(default_factory=set)  # storages in ``storages`` that are pieces' kept outputs
    offloads: list[Offload] = field(default_factory=list)
    done: bool = False


class ActivationOffloader(Feature):
    """Sends the inputs of checkpointed calls home during forward, brings them back before recompute."""

    def __init__(
        self,
        device: torch.device,
        keep: int = 2,
        min_bytes: int | None = None,
        pin: bool | None = None,
        recompute: bool = False,
        transport: Transport | None = None,
    ) -> None:
        self.device = device
        # activations out and in (its own, for tests that use an offloader alone)
        self.transport = transport if transport is not None else make_transport(device)
        self.keep = max(1, keep)  # the last ``keep`` segments of a forward stay on the device
        self.ahead = self.keep  # restores issued this many segments before their recompute
        self.cuda = device.type == "cuda"
        self.min_bytes = (MIN_BYTES if self.cuda else 0) if min_bytes is None else min_bytes
        self.pin = self.cuda if pin is None else pin
        self._pool: dict[int, list[tuple[torch.Tensor, Copy | None]]] = {}  # a buffer, the copy that last read it
        self._memory = PinnedMemory(self.pin, "drop --keep_piece_outputs, then --offload_recompute, or free RAM")
        self._recent: list[Segment] = []  # segments not yet offloaded, oldest first
        self._live: list[Segment] = []  # segments with offloads not yet restored and released
        # Bookkeeping per checkpointed call independent of how many calls came before (a layer-major step has N times
        # one forward's): the inputs' offloads not yet restored by storage (a later call that takes one finds it
        # here), and the live segments that may have become reclaimable (a tensor of theirs died, or a later call
        # restored one of their offloads) for :meth:`_reclaim`, instead of scanning every live segment per call
        self._home: dict[int, tuple[Offload, Segment]] = {}
        self._check: set[Segment] = set()
        self._last: Segment | None = None
        self.offloaded_bytes = 0  # totals, for the stats line and tests
        self.restored_bytes = 0
        self.dropped_bytes = 0  # sent home, then every tensor on them was freed: nothing to bring back
        self.demand_restores = 0  # restores issued only when the recompute needed them (prefetch misses)
        # Segments that sent something home, and the bytes of the largest so far (of any batch shape seen: what
        # the planner weighs keeping a segment on the device with)
        self.segments_sent = 0
        self.largest_segment = 0
        # What checkpointed layers' recomputes save goes home too (recompute_offload.py), on these streams
        self.recompute = RecomputeOffload(self) if recompute else None
        self.calling: CheckpointedCall | None = None  # the checkpointed call whose function runs now
        self._floor = 0  # the least kept in the last step (:meth:`keeping`)
        self._depths_set = 0  # calls of :meth:`set_depth` so far (:meth:`keeping` leaves a new depth in place)

    # ---------------------------------------------------------------- public
    def wrap(self, checkpoint: Callable) -> Callable:
        """``checkpoint(function, *args, **kwargs)`` with this offloader around it."""

        def dgls_checkpoint(function: Callable, *args, **kwargs):
            if not torch.is_grad_enabled() or in_backward():
                return checkpoint(function, *args, **kwargs)
            segment = self._enter(args, kwargs)
            return checkpoint(CheckpointedCall(self, segment, function), *args, **kwargs)

        dgls_checkpoint.__wrapped__ = checkpoint  # type: ignore[attr-defined]
        return dgls_checkpoint

    def host_bytes(self) -> int:
        """Host buffers held: pooled, and holding inputs, kept outputs or recomputed tensors not yet restored."""
        pooled = sum(buf.numel() for bufs in self._pool.values() for buf, _ in bufs)
        waiting = sum(o.nbytes for s in self._live for o in s.offloads if not o.restored)
        return pooled + waiting + (self.recompute.pinned_bytes() if self.recompute is not None else 0)

    def pinned_bytes(self) -> int:
        """Page-locked host buffers (0 when not pinning)."""
        return self.host_bytes() if self.pin else 0

    @contextmanager
    def keeping(self, count: int) -> Iterator[None]:
        """At least the last ``count`` segments of a forward stay on the device inside the block. A layer-major step
        (:mod:`..engine.layer_major`) calls its last checkpointed layer once per micro-batch, and the layer after it
        (not checkpointed: no segment of its own) reads what those calls took (a vector every block passes on): all
        ``count`` of them stay, as the last call of a forward does in one micro-batch. A depth set inside the block
        (:meth:`set_depth`: a placement change) is the new depth and stays after it."""
        keep, depths = self.keep, self._depths_set
        self.keep = self._floor = max(keep, count)
        try:
            yield
        finally:
            if self._depths_set == depths:  # else set_depth ran inside: its depth stands
                self.keep = keep

    @property
    def kept_last_step(self) -> int:
        """Calls whose inputs stayed on the device in the last step: ``keep``, or what :meth:`keeping` raised it to
        (the planner's probe reads it)."""
        return max(self.keep, self._floor)

    def set_depth(self, keep: int, ahead: int) -> None:
        """Keep the last ``keep`` segments of each forward on the device, and restore ``ahead`` segments before
        their recompute. Pooled host buffers are dropped when more stays (fewer will go home)."""
        if keep > self.keep:
            for buf, _ in (entry for bufs in self._pool.values() for entry in bufs):
                self._memory.free(buf)
            self._pool.clear()
        self.keep, self.ahead = max(1, keep), max(1, ahead)
        self._depths_set += 1

    def synchronize(self) -> None:
        self.transport.synchronize(Direction.ACTIVATIONS_OUT, Direction.ACTIVATIONS_IN)

    # ---------------------------------------------------------------- as a feature of the engine
    def wrap_checkpoint(self, checkpoint: Callable) -> Callable:
        return self.wrap(checkpoint)

    def placement_changed(self, placement: Placement, kept_activations: int | None) -> None:
        """Restores run as far ahead as weights are prefetched; at least that many segments stay."""
        depth = max(1, placement.prefetch)
        self.set_depth(max(depth, kept_activations or 0), depth)

    def close(self) -> None:
        self.synchronize()

    # ---------------------------------------------------------------- forward
    def _enter(self, args: tuple, kwargs: dict) -> Segment:
        self._reclaim()
        tensors = [t for t in _tensors(args, kwargs) if t.device.type == self.device.type]
        taken = {_storage_key(t) for t in tensors}
        for key in taken:  # a storage sent home that this call takes again: back first
            found = self._home.get(key)
            if found is None:
                continue
            offload, owner = found
            tensor = offload.tensor()
            if not offload.restored and tensor is not None and _storage_key(tensor) == key:
                self.demand_restores += self.start_restore(offload)
                self.wait(offload)
                self._check.add(owner)  # all of it may be back now
        eligible = {_storage_key(t): weakref.ref(t) for t in tensors if self.eligible(t)}
        previous = self._last if self._last is not None and not self._last.done else None
        segment = Segment(eligible, previous, previous.position + 1 if previous is not None else 0)
        self._last = segment
        for older in self._recent:  # storages a later call takes are not theirs to send
            for key in taken:
                older.storages.pop(key, None)
        self._recent.append(segment)
        while len(self._recent) > self.keep:
            self._offload(self._recent.pop(0))
        return segment

    def eligible(self, tensor: torch.Tensor) -> bool:
        """Worth a copy each way and able to go: floating point, on this device, a storage of at least
        ``min_bytes`` (and not empty) that can be resized."""
        storage = tensor.untyped_storage()
        return (
            tensor.is_floating_point()
            and tensor.device.type == self.device.type
            and max(1, self.min_bytes) <= storage.nbytes()
            and storage.resizable()
        )

    def keep_output(self, segment: Segment, tensors: list[torch.Tensor]) -> None:
        """A piece's outputs, kept for the recompute of ``segment`` (:mod:`.unit_checkpoints`), go home with the
        segment's inputs (those worth a copy; the rest stay on the device)."""
        for tensor in tensors:
            if self.eligible(tensor):
                key = _storage_key(tensor)
                segment.storages[key] = weakref.ref(tensor)
                segment.outputs.add(key)

    def _offload(self, segment: Segment) -> None:
        for key, ref in segment.storages.items():
            tensor = ref()
            if tensor is None or tensor.untyped_storage().nbytes() == 0:
                continue
            offload = self.send(tensor)
            offload.output = key in segment.outputs
            # its death puts the segment up for reclaiming (a weak reference to the segment: no cycle holds the
            # pinned buffer)
            offload.tensor = weakref.ref(tensor, partial(_died, weakref.ref(segment), self._check))
            offload.key = key
            self._home[key] = (offload, segment)
            segment.offloads.append(offload)
        segment.storages.clear()
        if segment.offloads:
            self._live.append(segment)
            self.segments_sent += 1
            self.largest_segment = max(self.largest_segment, sum(o.nbytes for o in segment.offloads))

    def send(self, tensor: torch.Tensor) -> Offload:
        """``tensor``'s storage home: its bytes copied to a pooled host buffer (on the device-to-host stream, after
        the compute stream's work so far), then the storage resized to nothing (on CUDA the caching allocator
        reuses the memory only after the copy ran)."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        host, free_after = self._take_buffer(nbytes)
        source = _bytes_of(storage, self.device)
        offload = Offload(weakref.ref(tensor), nbytes, host)
        # after the buffer's previous restore read it; the bytes land at once on the CPU (the storage goes now)
        pairs = [(host, source)]
        offload.sent = self.transport.submit(
            Direction.ACTIVATIONS_OUT, pairs, (free_after,), after_compute=True, late=False
        )
        del source, pairs
        storage.resize_(0)
        self.offloaded_bytes += nbytes
        return offload

    # ---------------------------------------------------------------- backward
    def before_recompute(self, segment: Segment) -> None:
        """The checkpoint runs ``segment``'s function again: its inputs (and its pieces' kept outputs) must be on
        the device; the segments before it (the backward's next) start coming back: the inputs of ``ahead`` of
        them, the kept outputs of one fewer (they are read only by the recompute, not before it, and a segment's
        outputs can outweigh its inputs: a Wan block's three pieces' outputs are 1.5 times its input)."""
        if segment in self._recent:  # its inputs never left (one of the last ``keep``)
            self._recent.remove(segment)
        for offload in segment.offloads:
            self.demand_restores += self.start_restore(offload)
            self.wait(offload)
        self._release(segment)
        ahead, earlier = 0, segment.previous
        while earlier is not None and ahead < self.ahead:
            ahead += 1
            if not earlier.done:
                for offload in earlier.offloads:
                    if not offload.output or ahead < self.ahead:
                        self.start_restore(offload)
            earlier = earlier.previous
        segment.previous = None  # the chain of a long run stays as short as one forward

    def start_restore(self, offload: Offload) -> bool:
        """Issue the restore unless it was issued already; True if it was issued now."""
        if offload.restoring is not None or offload.restored:
            return False
        self._restore(offload)
        return True

    def _restore(self, offload: Offload) -> None:
        tensor = offload.tensor()
        if tensor is None:  # freed meanwhile ('unsloth' keeps its own host copies, not the inputs)
            self.dropped_bytes += offload.nbytes
            offload.restored = True
            self._back(offload)
            return
        storage = tensor.untyped_storage()
        storage.resize_(offload.nbytes)  # allocated on the compute stream
        pairs = [(_bytes_of(storage, self.device), offload.host)]  # (CPU: NaN until waited for)
        offload.restoring = self.transport.submit(Direction.ACTIVATIONS_IN, pairs, (offload.sent,), after_compute=True)
        self.restored_bytes += offload.nbytes

    def wait(self, offload: Offload) -> None:
        """The compute side may read ``offload``'s storage from now on (its restore was issued)."""
        if offload.restored:
            return
        if offload.restoring is not None:  # timed where the transport times restores: the stats and --profile
            self.transport.acquire(offload.restoring, timed=Direction.ACTIVATIONS_IN in self.transport.timed)
        offload.restored = True
        self._back(offload)

    def _back(self, offload: Offload) -> None:
        """``offload`` is no longer at home (restored, or its tensors gone): out of the index."""
        found = self._home.get(offload.key)
        if found is not None and found[0] is offload:
            del self._home[offload.key]

    # ---------------------------------------------------------------- host buffers
    def give_back(self, offload: Offload) -> None:
        """``offload``'s host buffer back to the pool, free once its last copy (the restore, else the send) ran."""
        self._pool.setdefault(offload.nbytes, []).append((offload.host, offload.restoring or offload.sent))

    def _release(self, segment: Segment) -> None:
        """The segment's restores are waited for: its host buffers go back to the pool."""
        segment.done = True
        for offload in segment.offloads:
            self._back(offload)
            self.give_back(offload)
        segment.offloads.clear()
        if segment in self._live:
            self._live.remove(segment)

    def _reclaim(self) -> None:
        """Segments whose tensors are gone (their graph was dropped before a backward) give back their
        buffers; so do segments whose every offload was restored by a later call. Only segments where one of
        those happened since the last call are looked at (``_check``)."""
        while self._check:
            segment = self._check.pop()  # (one at a time: a tensor may die on another thread meanwhile)
            if segment.done or not segment.offloads:
                continue
            if all(o.tensor() is None or o.restored for o in segment.offloads):
                unissued = (o for o in segment.offloads if not (o.restored or o.restoring))
                self.dropped_bytes += sum(o.nbytes for o in unissued)
                self._release(segment)
                segment.previous = None
        self._recent = [s for s in self._recent if any(r() is not None for r in s.storages.values())]

    def _take_buffer(self, nbytes: int) -> tuple[torch.Tensor, Copy | None]:
        free = self._pool.get(nbytes)
        if free:
            return free.pop()
        self._check_ram(nbytes)
        return self._memory.empty((nbytes,), torch.uint8), None  # exact size (:mod:`..memory.pinned`)

    def _check_ram(self, nbytes: int) -> None:
        """A new host buffer must leave the host its reserve (a tenth of its RAM, at least 2 GiB): page-locked
        memory cannot be swapped, and an allocation that fails deep in CUDA says nothing of what to change."""
        short = ram_short(nbytes)
        if short is None:
            return
        available, reserve = short
        raise DGLSUserError(
            f"activation offload ran out of host RAM: it holds {human_bytes(self.host_bytes())} of activations, needs "
            f"{human_bytes(nbytes)} more, and the host has {human_bytes(available)} available (keeping "
            f"{human_bytes(reserve)} free): drop --keep_piece_outputs (its pieces' outputs), then --offload_recompute, "
            "or train fewer frames or a lower resolution, or free RAM"
        )


class CheckpointedCall:
    """One checkpointed call: the function the checkpoint runs, with the restore in front of its second run
    (the recompute), and with recompute offload (:mod:`.recompute_offload`) the saved-tensor hooks of both
    runs. While either run is on, it is the offloader's ``calling``: pieces under checkpoints of their own
    (:mod:`.unit_checkpoints`) keep their outputs in ``outputs`` in the first run and take them back, in the same
    order, in the recompute. It lives as long as the checkpoint's graph, so kept outputs of a graph dropped
    without a backward are freed with it."""

    def __init__(self, offloader: ActivationOffloader, segment: Segment, function: Callable) -> None:
        self.offloader, self.segment, self.function = offloader, segment, function
        self.record: list[Recomputed | None] = [None]  # the recompute's saved tensors, once it ran
        self.recomputing = False
        self.outputs: deque = deque()  # the pieces' kept runs (unit_checkpoints.KeptRun), in forward order

    def keep(self, kept, tensors: list[torch.Tensor]) -> None:
        """A piece's output from the first run, for the recompute; its ``tensors`` go home with the inputs."""
        self.outputs.append(kept)
        self.offloader.keep_output(self.segment, tensors)

    def __call__(self, *args, **kwargs):
        recompute = self.offloader.recompute
        recomputing = in_backward()  # the recompute
        if recomputing:
            self.offloader.before_recompute(self.segment)
        if recompute is None:
            hooks = nullcontext()
        elif recomputing:
            hooks = recompute.recomputing((self.segment.position, function_kind(self.function)), self.record)
        else:
            hooks = recompute.forwarding(self.record)
        outer, self.offloader.calling, self.recomputing = self.offloader.calling, self, recomputing
        try:
            with hooks:
                return self.function(*args, **kwargs)
        finally:
            self.offloader.calling = outer


def _died(segment: weakref.ref, check: set[Segment], _tensor: weakref.ref) -> None:
    """A weak reference's callback: a tensor an offload of ``segment`` was sent for is gone (any thread)."""
    owner = segment()
    if owner is not None:
        check.add(owner)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    visit(args)
    visit(kwargs)
    return found


def _storage_key(tensor: torch.Tensor) -> int:
    """The storage's identity: the same for every view of it, and before and after a resize."""
    return storage_key(tensor)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
