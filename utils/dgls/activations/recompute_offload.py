"""Recompute offload: what a checkpointed layer's recompute saves for its backward waits in host memory
until that backward reaches it.

Why
    A checkpointed layer's backward first runs the layer again (the recompute), and the recompute saves
    everything the layer's backward needs, all of it alive when that backward starts. For a Wan2.1-14B block
    at 81 frames (32,760 tokens) that is about 9 GiB: its norms' fp32 inputs, the attention's q, k, v and
    output, the MLP's 13,824-wide activations, the LoRA inputs. Once weights stream and checkpointed inputs wait
    in host memory (:mod:`.activation_offload`), it is the largest thing on the card. The backward reads these
    tensors in reverse order of saving, so the first saved wait longest; in LoRA training the device-to-host
    direction of the link is idle during the backward.

What goes home
    Every tensor that autograd saves during a recompute passes through this module's saved-tensor hooks
    (:meth:`RecomputeOffload.recomputing`), pushed by activation offload's wrapper of the checkpointed function
    (``CheckpointedCall``) on top of the checkpoint's own hooks. One is sent home if it is floating point, at least
    ``min_bytes``, not a parameter or a view of one, and saved before the last ``KEEP_SHARE`` of the bytes
    that the previous recompute of the same call saved (the same place among the forward's checkpointed calls,
    the same function). The tail stays, since the backward reads it first. The first recompute of each call
    has nothing to go by and sends every eligible tensor: its backward waits for the copies of the first ones
    it reads, but its memory is never above that of later steps (a first step that kept everything would
    need more than the card the later steps fit on). A tensor sent home is copied first, so that its
    storage is this module's alone (the recompute's own code may read the original again), and the copy is
    offloaded by storage as activation offload does: its bytes go to a pooled pinned buffer on the
    device-to-host stream, and the storage is resized to nothing once the copy is queued (the caching
    allocator reuses the memory only after the copy ran). The checkpoint keeps the copy, with no memory.

When it comes back
    A saved tensor is unpacked by the node of the original graph that saved it in the forward (non-reentrant
    checkpointing; the checkpoint hands out what its recompute kept) or of the recompute's own graph
    (reentrant, ``'unsloth'``). Both unpacks pass through hooks of this module: in the forward, the wrapper
    pushes hooks that only number the saved tensors (:meth:`RecomputeOffload.forwarding`), in the same
    order as the recompute saves them (the checkpoint depends on that order too). An unpack waits for its
    tensor (issuing the restore first if it was not issued), then issues the restores of the sent tensors
    saved before it, newest first, whose distance to it (the bytes saved after them up to it) is at most
    ``ahead_bytes``: the bytes the backward reads in between stand for the time the copy has.

Pace
    On CUDA, at each tensor sent and each one read back, the host waits until the device has reached the
    point where the host stood ``PACE`` such events before (:meth:`RecomputeOffload._keep_pace`). Memory
    that a copy stream used (``record_stream``) is reused only once that stream's work queued before the
    free ran, as the caching allocator sees it when the host next allocates; a host queueing far ahead of
    the device asks for memory long before, and the card held every queued layer's sent and restored tensors
    at once: on the Wan-14B block at 81 frames, without a pace, several times as much memory stayed reserved
    as was allocated.

Invariants
    - Bitwise: a restore writes back the bytes that were sent, into the same storage object (every view of
      it sees them), and the compute stream waits for the copy before the unpack returns.
    - On the CPU (tests), a restore fills the storage with NaN bytes at once and writes the saved bytes only
      when an unpack waits for it, so a backward that reads a saved tensor without waiting computes with NaN.
    - A recompute that is not followed by its backward (a graph dropped) leaves records whose tensors die;
      their host buffers go back to the pool at the next recompute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..memory.transport import Marker
from ..torch_private import top_saved_tensors_hooks, view_base

if TYPE_CHECKING:
    from .activation_offload import ActivationOffloader, Offload

KEEP_SHARE = 1 / 3  # of a recompute's saved bytes, the last third stays on the device: on a Wan-14B block at 81
# frames its backward's first reads (the MLP's), while the rest is still on its way home
# A sent tensor comes back once the backward reads one saved at most this many bytes after it. Restores ahead sit
# on the device through the backward before their reads: on the Wan-14B block at 81 frames (checkpoint_units,
# prefetch 1) 512 MiB peaked lower than 1 GiB at the same step time; benchmarks/results/wan_fit_81f_keep_cap8.md
# ran with 512 MiB.
AHEAD_BYTES = 2**29
PACE = 2  # the host stays at most this many sent or read-back tensors ahead of the device (see Pace)


@dataclass(eq=False)
class Saved:
    """One tensor saved by a recompute, as autograd keeps it: its number in the recompute, and what the
    hooks below gave (the checkpoint's handle, or the tensor itself without outer hooks)."""

    index: int
    inner: Any


@dataclass(eq=False)
class Recomputed:
    """The saved tensors of one recompute that went home, by number, and those whose restores are issued."""

    key: object  # the checkpointed call's place in the forward and its function's kind: the same sizes each step
    sent: dict[int, Offload] = field(default_factory=dict)
    unissued: list[int] = field(default_factory=list)  # numbers of sent tensors not yet on their way back
    ends: list[int] = field(default_factory=list)  # per saved tensor in order: the eligible bytes saved up to it


class RecomputeOffload:
    """Sends the head of each recompute's saved tensors home and brings them back ahead of their reads."""

    def __init__(self, transfers: ActivationOffloader, ahead_bytes: int = AHEAD_BYTES) -> None:
        self.transfers = transfers  # streams, pinned pool, copies (activation offload's)
        self.ahead_bytes = ahead_bytes
        self._marks: list[Marker] = []  # CUDA: the compute stream at the last PACE sends and reads
        self._profiles: dict[object, int] = {}  # per call: the eligible bytes its last recompute saved
        self._live: list[Recomputed] = []
        self.sent_bytes = 0  # totals, for the stats and tests
        self.sent_tensors = 0
        self.restored_bytes = 0
        self.demand_restores = 0  # restores issued only when the backward read their tensor

    # ---------------------------------------------------------------- the forward
    @contextmanager
    def forwarding(self, cell: list[Recomputed | None]) -> Iterator[None]:
        """The checkpointed function's first run: number what it saves (on top of the checkpoint's hooks), so
        that an unpack by the original graph knows which recomputed tensor it gets. ``cell`` is a one-item list
        the recompute fills with its record."""
        outer = top_saved_tensors_hooks()
        if outer is None or not torch.is_grad_enabled():  # nothing is saved for a recompute to replace
            yield
            return
        count = [0]

        def pack(tensor: torch.Tensor) -> Saved:
            count[0] += 1
            return Saved(count[0] - 1, outer[0](tensor))

        def unpack(saved: Saved):
            value = outer[1](saved.inner)  # the first unpack runs the recompute, which fills ``cell``
            if cell[0] is not None:
                self.ready(cell[0], saved.index)
            return value

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    # ---------------------------------------------------------------- the recompute
    @contextmanager
    def recomputing(self, key: object, cell: list[Recomputed | None]) -> Iterator[None]:
        """The recompute of the checkpointed call ``key`` (its place in the forward and its function's kind,
        :func:`function_kind`): what it saves goes through here."""
        self._reclaim()
        record = Recomputed(key)
        cell[0] = record
        self._live.append(record)
        profile = self._profiles.get(key)
        head = profile * (1 - KEEP_SHARE) if profile else float("inf")
        outer = top_saved_tensors_hooks()
        transfers = self.transfers

        def pack(tensor: torch.Tensor) -> Saved:
            index = len(record.ends)
            eligible = self._eligible(tensor)
            nbytes = tensor.untyped_storage().nbytes() if eligible else 0
            record.ends.append((record.ends[-1] if record.ends else 0) + nbytes)
            if eligible and record.ends[-1] <= head:
                own = tensor.detach().clone()  # ours alone: the recompute's code may read ``tensor`` again
                self._keep_pace()
                offload = record.sent[index] = transfers.send(own)  # a view's copy: its own bytes only
                record.unissued.append(index)
                self.sent_bytes += offload.nbytes
                self.sent_tensors += 1
                tensor = own
            return Saved(index, outer[0](tensor) if outer is not None else tensor)

        def unpack(saved: Saved):  # reentrant and 'unsloth' checkpoints: the recompute's graph reads it
            value = outer[1](saved.inner) if outer is not None else saved.inner
            self.ready(record, saved.index)
            return value

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:  # also when the checkpoint stops the recompute after its last saved tensor
            self._profiles[key] = record.ends[-1] if record.ends else 0

    def _keep_pace(self) -> None:
        """CUDA: the host waits for the device to reach where the host stood ``PACE`` sends or reads ago (see
        the module doc's Pace)."""
        transport = self.transfers.transport
        if not transport.cuda:
            return
        if len(self._marks) >= PACE:
            transport.land(self._marks.pop(0))
        self._marks.append(transport.mark())

    def _eligible(self, tensor: torch.Tensor) -> bool:
        """Activation offload's rule, less weights (a parameter, a view of one, a leaf that trains)."""
        if isinstance(tensor, nn.Parameter) or isinstance(view_base(tensor), nn.Parameter):
            return False
        return not (tensor.requires_grad and tensor.is_leaf) and self.transfers.eligible(tensor)

    # ---------------------------------------------------------------- the backward
    def ready(self, record: Recomputed, index: int) -> None:
        """Saved tensor ``index`` of ``record`` is about to be read: on the device, and the sent tensors saved at
        most ``ahead_bytes`` before it on their way back."""
        offload = record.sent.pop(index, None)
        if offload is not None:
            self._keep_pace()
            if index in record.unissued:
                record.unissued.remove(index)
                self.demand_restores += 1
                self._restore(offload)
            self.transfers.wait(offload)
            self.transfers.give_back(offload)
        reached = record.ends[index]
        while record.unissued and record.unissued[-1] < index:
            earlier = record.unissued[-1]
            if reached - record.ends[earlier] > self.ahead_bytes:
                break
            record.unissued.pop()
            self._restore(record.sent[earlier])
        if not record.sent and record in self._live:
            self._live.remove(record)

    def _restore(self, offload: Offload) -> None:
        self.transfers.start_restore(offload)
        self.restored_bytes += offload.nbytes

    def _reclaim(self) -> None:
        """Records whose tensors all died unread (their graph was dropped): host buffers back to the pool."""
        for record in list(self._live):
            if all(o.tensor() is None for o in record.sent.values()):
                for offload in record.sent.values():
                    self.transfers.give_back(offload)
                record.sent.clear()
                self._live.remove(record)

    def pinned_bytes(self) -> int:
        return sum(o.nbytes for r in self._live for o in r.sent.values())


def function_kind(function: Callable) -> object:
    """What the recomputes of one checkpointed call have in common from step to step: a module's class, a
    function's code (a trainer may pass a new closure each step)."""
    target = getattr(function, "__self__", function)
    if isinstance(target, nn.Module):
        return type(target)
    return getattr(getattr(function, "__func__", function), "__code__", type(function))
