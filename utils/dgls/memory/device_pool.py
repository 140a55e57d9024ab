"""Device pool: the fixed slots that streamed layers occupy while they are on the device.

Allocated once, sized from the layouts of the streamed layers, so no allocation happens per
fetch and the pool's share of peak memory is known before step 1. A slot only holds bytes and
says which layer owns them; the ordering of writes and reads on it is the copier's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Slot:
    """One reusable device buffer (uint8) and the streamed layer that owns it, if any."""

    index: int
    buffer: torch.Tensor
    owner: int | None = None
    last_used: int = 0  # the swapper's use clock when the owner was last in use or protected


class DevicePool:
    """The slots, and the map from storage pointers back to slots (for saved-tensor references)."""

    def __init__(self, device: torch.device, count: int, nbytes: int) -> None:
        self.device = device
        self.slot_bytes = nbytes
        self.slots = [Slot(i, torch.empty(nbytes, dtype=torch.uint8, device=device)) for i in range(count)]
        self._by_pointer = {s.buffer.untyped_storage().data_ptr(): s for s in self.slots}

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.slot_bytes

    def slot_of(self, tensor: torch.Tensor) -> Slot | None:
        """The slot whose memory this tensor views, if any."""
        if tensor.device != self.device or tensor.layout != torch.strided:
            return None
        try:
            return self._by_pointer.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return None

    def free_slot(self) -> Slot | None:
        return next((s for s in self.slots if s.owner is None), None)

    def release(self) -> None:
        """Free the slots' memory now: a slot still referenced elsewhere (a copier token, a reference cycle
        the garbage collector has not reached yet) no longer holds it, so a swapper's VRAM is back after
        ``remove()`` (a tensor still viewing a slot keeps only its own storage alive)."""
        for slot in self.slots:
            slot.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
            slot.owner = None
        self.slots.clear()
        self._by_pointer.clear()
