"""Device pool: fixed slots that streamed layers occupy while resident.

Allocated once, sized from the real layer sizes, so there is no allocation per swap
and the pool's share of peak memory is known before step 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Slot:
    """One reusable device buffer and what it holds now."""

    index: int
    buffer: torch.Tensor  # uint8 on the device
    layer: int | None = None
    # Compute-stream event behind the last kernel that read the current contents.
    released: torch.cuda.Event | None = None
    # Copy-stream event behind the last write into this slot.
    written: torch.cuda.Event | None = None
    last_used: int = 0


class DevicePool:
    """The slots, and the map from storage pointers back to slots (for saved-tensor refs)."""

    def __init__(self, device: torch.device, count: int, nbytes: int) -> None:
        self.device = device
        self.slots = [Slot(i, torch.empty(nbytes, dtype=torch.uint8, device=device)) for i in range(count)]
        self.by_pointer = {s.buffer.untyped_storage().data_ptr(): s for s in self.slots}
        self.nbytes = count * nbytes

    def slot_of(self, tensor: torch.Tensor) -> Slot | None:
        """The slot whose memory this tensor views, if any."""
        if tensor.device != self.device or tensor.layout != torch.strided:
            return None
        try:
            return self.by_pointer.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return None

    def free_slot(self) -> Slot | None:
        return next((s for s in self.slots if s.layer is None), None)

    def release(self) -> None:
        self.slots.clear()
        self.by_pointer.clear()
