"""Gradient copier: the device-to-host direction, gradients of host-trained params into pinned landings.

Vocabulary (one :class:`GradBatch` per layer per backward pass):

- ``send(batch, landings, grads)``: copy each of ``grads`` (on the device) into its landing (host
  memory), a group at once. The caller drops its references to the grads at once; nothing waits on the
  host.
- ``close(batch)``: the layer's backward is done; no more grads join the batch.
- ``land(batch)``: the host may read every landing of the batch after this (it blocks until the bytes
  are there). Reading a landing without ``land`` is the bug this module makes visible.

Mechanics:

- :class:`CudaGradCopier`: one copy stream of its own (PCIe is full duplex, so these copies run beside
  the host-to-device weight copies). A send makes that stream wait for the compute stream (the grad was
  just produced there), enqueues the copies, and marks each grad as used on the copy stream
  (``record_stream``) so the caching allocator keeps its memory until its copy ran. ``close`` records
  an event; ``land`` synchronises on it. ``delay_cycles`` (tests) puts a ``torch.cuda._sleep`` before
  every group of copies, to widen any race.
- :class:`DeferredGradCopier` (CPU): a send fills the landing with NaN at once and keeps the grad;
  the bytes land only in ``land``. A host read that skips ``land`` reads NaN, so CI catches a gradient
  read before its copy. With ``eager`` (the ``--threading`` path) the copy is made at once instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class GradBatch:
    """One layer's gradients from one backward pass."""

    layer: int
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # CPU: (landing, grad)
    done: torch.cuda.Event | None = None
    params: set[int] = field(default_factory=set)  # positions of the params whose grads were sent


class GradCopier:
    def send(self, batch: GradBatch, landings: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def close(self, batch: GradBatch) -> None:
        """No more grads join ``batch`` (CUDA: mark where its copies end)."""

    def land(self, batch: GradBatch) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Block until every copy sent so far has landed."""


class DeferredGradCopier(GradCopier):
    """CPU: landings are NaN until :meth:`land` (see the module doc)."""

    def __init__(self, eager: bool = False) -> None:
        self.eager = eager

    def send(self, batch: GradBatch, landings: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        for landing, grad in zip(landings, grads, strict=True):
            if self.eager:
                landing.copy_(grad)
            else:
                landing.fill_(float("nan"))
                batch.pending.append((landing, grad))

    def land(self, batch: GradBatch) -> None:
        for landing, grad in batch.pending:
            landing.copy_(grad)
        batch.pending.clear()


class CudaGradCopier(GradCopier):
    """A device-to-host copy stream (see the module doc)."""

    def __init__(self, device: torch.device, delay_cycles: int = 0) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.delay_cycles = delay_cycles

    def send(self, batch: GradBatch, landings: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            for landing, grad in zip(landings, grads, strict=True):
                landing.copy_(grad, non_blocking=True)
        for grad in grads:
            grad.record_stream(self.stream)

    def close(self, batch: GradBatch) -> None:
        batch.done = torch.cuda.Event()
        batch.done.record(self.stream)

    def land(self, batch: GradBatch) -> None:
        if batch.done is not None:
            batch.done.synchronize()

    def finish(self) -> None:
        self.stream.synchronize()
