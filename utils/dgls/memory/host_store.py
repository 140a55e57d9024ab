"""Host store: the CPU masters of streamed layers, packed as :mod:`.layout` says and (within budget) pinned.

Each layer's streamable params live in one contiguous byte buffer, so a layer travels as one
large copy instead of hundreds of small ones. Buffers are plain page-aligned memory,
page-locked with ``cudaHostRegister`` in chunks under 2 GiB (:mod:`.pinned`); that avoids the
power-of-two rounding of PyTorch's pinned caching allocator. Layers past the pinned-RAM budget stay
pageable; the copier stages them through pinned bounce buffers.

Disk tier (:mod:`.disk_tier`): the layers the attached tier spills (``disk.spilled``) get their buffer in its
file (a shared mapping of it) instead of RAM; their host->device copies read from the tier's staging ring
(``copies(..., source=)``), never from the mapping.

fp8 storage: a master holds fp8 bytes, with fp32 scales (one per output row) kept both on the
swapper's device (for the upcast) and on the CPU (for state dicts). Scales are computed on the
swapper's device, the same device that upcasts, so a layer's values are bitwise the same
whether it streams or stays resident.

Hazard handled here: memory registered with CUDA must be unregistered before it is freed. The
registrations live in a :class:`Registrations` object that a ``weakref.finalize`` also holds,
so a store dropped without :meth:`HostStore.release` still unregisters before its buffers go.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil
import torch

from ..errors import DGLSUserError
from .disk_tier import DiskTier
from .layout import GiB, LayerLayout
from .peers import Peers
from .pinned import REGISTER_CHUNK, Registrations, page_aligned_empty, whole_pages
from .precision import dequantize, quantize

COPY_CHUNK = REGISTER_CHUNK


def copy_chunks(start: int, end: int) -> Iterator[tuple[int, int]]:
    """Bytes ``[start, end)`` of a layer's buffer cut at every multiple of :data:`COPY_CHUNK`: the buffer is
    page-locked in registrations of that size from its first byte, and one copy must not span two (:mod:`.pinned`)."""
    o = start
    while o < end:
        stop = min((o // COPY_CHUNK + 1) * COPY_CHUNK, end)
        yield o, stop
        o = stop


@dataclass
class HostLayer:
    """One layer's master bytes (``buffer``, uint8 on the CPU) laid out as ``layout`` says."""

    layout: LayerLayout
    buffer: torch.Tensor
    pinned: bool
    packed: bool  # copied as one block (else param by param: selective_packing)
    scales: dict[int, torch.Tensor] = field(default_factory=dict)  # param position -> fp32 scales on the device
    scales_host: dict[int, torch.Tensor] = field(default_factory=dict)  # the same on the CPU
    on_disk: bool = False  # the buffer maps the disk tier's file: copies read a staging buffer the tier fills

    @property
    def index(self) -> int:
        return self.layout.index

    @property
    def nbytes(self) -> int:
        """Bytes copied per fetch."""
        return self.layout.host_bytes

    def master_view(self, k: int, source: torch.Tensor | None = None) -> torch.Tensor:
        """Param ``k``'s stored bytes as a typed view into host memory (fp8 for fp8-stored params); ``source``:
        a copy of the buffer to view instead (a disk layer's staging buffer)."""
        p = self.layout.params[k]
        buffer = self.buffer if source is None else source
        return buffer[p.host_offset : p.host_offset + p.host_nbytes].view(p.stored).view(p.shape)

    def value(self, k: int, device: torch.device | None = None) -> torch.Tensor:
        """Param ``k``'s true value in its compute dtype: a view of the master, or its dequantized copy
        (computed on ``device`` with the device scales, the same way the copier upcasts into a slot)."""
        p = self.layout.params[k]
        if not p.scaled:
            return self.master_view(k)
        if device is None or device.type == "cpu":
            return dequantize(self.master_view(k), self.scales_host[k], p.dtype)
        return dequantize(self.master_view(k).to(device), self.scales[k], p.dtype)

    def store_value(self, k: int, value: torch.Tensor) -> None:
        """Write a new value into the master (re-quantized for fp8 storage, scales updated)."""
        p = self.layout.params[k]
        with torch.no_grad():
            if not p.scaled:
                self.master_view(k).copy_(value)
                return
            q, scale = quantize(value.to(self.scales[k].device, p.dtype), p.stored)
            self.master_view(k).copy_(q)
            self.scales[k].copy_(scale)
            self.scales_host[k].copy_(scale)

    def copies(
        self, slot: torch.Tensor, landing: torch.Tensor | None, source: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host bytes, device bytes) pairs to copy: chunks when packed, per param if not. fp8-stored
        bytes go to ``landing`` (for the upcast), or are left out without one (the CPU upcasts from here).
        ``source``: where the bytes are read from instead of the buffer (a disk layer's staging buffer)."""
        layout, pairs = self.layout, []
        buffer = self.buffer if source is None else source
        if self.packed:
            for o, end in copy_chunks(0, layout.direct_bytes):
                pairs.append((buffer[o:end], slot[o:end]))
            if landing is not None:
                for o, end in copy_chunks(layout.direct_bytes, layout.host_bytes):
                    base = o - layout.direct_bytes
                    pairs.append((buffer[o:end], landing[base : base + end - o]))
            return pairs
        for p in layout.params:
            src = buffer[p.host_offset : p.host_offset + p.host_nbytes]
            if not p.scaled:
                pairs.append((src, slot[p.offset : p.offset + p.nbytes]))
            elif landing is not None:
                base = p.host_offset - layout.direct_bytes
                pairs.append((src, landing[base : base + p.host_nbytes]))
        return pairs


def ram_reserve(total: int) -> int:
    """Host RAM left unpinned for everything else: a tenth of it, at least 2 GiB."""
    return max(2 * GiB, total // 10)


def ram_room() -> tuple[int, int]:
    """The host RAM available now and the reserve it keeps (:func:`ram_reserve`), in bytes."""
    memory = psutil.virtual_memory()
    return memory.available, ram_reserve(memory.total)


def ram_short(need: int) -> tuple[int, int] | None:
    """Where ``need`` more bytes of host RAM would cut into the reserve (:func:`ram_reserve`): the bytes available
    now and the reserve, for the caller's one line; None where they fit."""
    available, reserve = ram_room()
    return (available, reserve) if need > available - reserve else None


def default_pinned_budget(streamable_on_cpu: int) -> int:
    """What can be page-locked without starving the host: available RAM, plus the RAM the
    original CPU params give back as they are packed, less a reserve."""
    vm = psutil.virtual_memory()
    return max(0, vm.available + streamable_on_cpu - ram_reserve(vm.total))


def check_ram(new_bytes: int) -> None:
    """Fail before packing if the host cannot hold the masters at all."""
    available = psutil.virtual_memory().available
    if new_bytes > available:
        raise DGLSUserError(
            f"too little RAM to hold the streamed layers: need {new_bytes / GiB:.1f} GiB more, "
            f"{available / GiB:.1f} GiB available; stream fewer layers (blocks_to_swap), free RAM, or (LoRA) set "
            "host_ram_budget to keep what does not fit on disk"
        )


class HostStore:
    """Owns the packed host masters, their pinned registrations and the staging buffers."""

    def __init__(
        self, device: torch.device, pinned_budget: int | None, packing_threshold: int, peers: Peers | None = None
    ) -> None:
        self.device = device
        self.peers = peers or Peers()
        self.use_pinning = device.type == "cuda"
        self.pinned_budget = pinned_budget
        self.packing_threshold = packing_threshold
        self.layers: dict[int, HostLayer] = {}
        self.pinned_bytes = 0
        self.staging: list[torch.Tensor] = []
        self.disk: DiskTier | None = None  # the disk tier: the layers it spills get their buffer in its file
        # closed with the store, after the model's true values were read back (full fine-tuning's disk state)
        self.closing: list[Callable[[], None]] = []
        self._registrations = Registrations()
        self._finalizer = weakref.finalize(self, Registrations.drop_all, self._registrations)

    @property
    def pageable_layers(self) -> list[int]:
        return [i for i, h in self.layers.items() if self.use_pinning and not h.pinned and not h.on_disk]

    @property
    def disk_layers(self) -> list[int]:
        return [i for i, h in self.layers.items() if h.on_disk]

    def add_layer(self, layout: LayerLayout, memory: str = "private") -> HostLayer:
        """Pack one layer's streamable params (their current data), cast as the layout says, and pin the
        buffer while the budget lasts. ``memory``: "private"; "create", a shared segment this process fills
        (the leader of :mod:`.peers`); or "attach", the leader's segment, already filled (fp8 scales are
        still computed here: they live on this process's device)."""
        nbytes = layout.host_bytes
        budget = self.pinned_budget
        spill = self.disk is not None and layout.index in self.disk.spilled and memory == "private"
        pin = not spill and self.use_pinning and (budget is None or self.pinned_bytes + whole_pages(nbytes) <= budget)
        if spill:
            offset, buffer = self.disk.file.allocate(layout.index, nbytes)
        elif memory == "private":
            buffer = page_aligned_empty(nbytes) if self.use_pinning else torch.empty(nbytes, dtype=torch.uint8)
        else:
            make = self.peers.create if memory == "create" else self.peers.attach
            buffer = make(layout.index, whole_pages(nbytes))
        layer = HostLayer(layout, buffer[:nbytes], pin, nbytes >= self.packing_threshold, on_disk=spill)
        with torch.no_grad():
            for k, p in enumerate(layout.params):
                if p.scaled:
                    q, scale = quantize(p.param.data.to(self.device), p.stored)
                    layer.scales[k], layer.scales_host[k] = scale, scale.cpu()
                    if memory != "attach":
                        layer.master_view(k).copy_(q)
                elif memory != "attach":
                    layer.master_view(k).copy_(p.param.data)
        if pin:
            self._registrations.add(layout.index, buffer)
            self.pinned_bytes += buffer.numel()
        if spill:
            self.disk.file.flush(offset, nbytes)
        self.layers[layout.index] = layer
        return layer

    def attach_disk(self, disk: DiskTier) -> None:
        """Spill ``disk.spilled`` into the disk tier as they are added; its pinned ring counts as this store's."""
        self.disk = disk
        self.pinned_bytes += disk.pinned_bytes

    def remove_layer(self, index: int) -> None:
        """Unpin and drop one layer's master (it became resident: the device copy is the weight now)."""
        layer = self.layers.pop(index)
        if layer.pinned:
            self._registrations.drop(index)
            self.pinned_bytes -= whole_pages(layer.nbytes)

    def ensure_staging(self, count: int, nbytes: int) -> None:
        """Pinned bounce buffers for pageable layers, each ``nbytes`` (made or grown only if some layer is pageable)."""
        if not self.pageable_layers or (self.staging and self.staging[0].numel() >= nbytes):
            return
        self._drop_staging()
        for k in range(count):
            buf = page_aligned_empty(nbytes)
            self._registrations.add(-1 - k, buf)
            self.staging.append(buf)
            self.pinned_bytes += buf.numel()

    def _drop_staging(self) -> None:
        for k, buf in enumerate(self.staging):
            self._registrations.drop(-1 - k)
            self.pinned_bytes -= buf.numel()
        self.staging = []

    def release(self) -> None:
        """Unpin and drop every buffer (masters must have been copied out first), and close the disk tier."""
        self._registrations.drop_all()
        self.layers.clear()
        if self.disk is not None:
            self.disk.close()
        for close in self.closing:
            close()
        self.closing.clear()
        self.staging.clear()
        self.pinned_bytes = 0
