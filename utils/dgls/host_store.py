"""Host store: the CPU masters of streamed layers, packed and (where the budget allows) pinned.

Each streamed layer's frozen params live in one contiguous byte buffer, so a layer
travels as one large copy instead of hundreds of small ones. Buffers are allocated
as plain memory and page-locked with ``cudaHostRegister`` in chunks, which avoids
the power-of-two rounding of PyTorch's pinned caching allocator. Layers past the
pinned-RAM budget stay pageable and are staged through a few pinned buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil
import torch

from .errors import DGLSUserError
from .placement import aligned

GiB = 1024**3
PAGE = 4096
REGISTER_CHUNK = 1 * GiB  # registrations above 2 GiB are reported to fail; stay well under
COPY_CHUNK = REGISTER_CHUNK


@dataclass
class ParamSlot:
    """Where one frozen param lives inside its layer's packed bytes."""

    param: torch.nn.Parameter
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    original_device: torch.device


@dataclass
class HostLayer:
    """One streamed layer's master bytes and how they are copied to a device slot."""

    params: list[ParamSlot]
    nbytes: int
    buffer: torch.Tensor  # uint8, CPU
    pinned: bool
    packed: bool
    registered: list[int] = field(default_factory=list)  # base pointers registered with CUDA

    def segments(self) -> list[tuple[torch.Tensor, int]]:
        """(host bytes, destination offset) pieces to copy: one per chunk when packed, per param if not."""
        if self.packed:
            return [(self.buffer[o : o + COPY_CHUNK], o) for o in range(0, self.nbytes, COPY_CHUNK)]
        return [(self.buffer[p.offset : p.offset + p.nbytes], p.offset) for p in self.params]

    def master_view(self, p: ParamSlot) -> torch.Tensor:
        """The param's true value, as a typed view into host memory."""
        return self.buffer[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape)


def layout_params(params: list[torch.nn.Parameter]) -> tuple[list[ParamSlot], int]:
    """Assign aligned byte offsets to a layer's frozen params."""
    slots, offset = [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        slots.append(ParamSlot(p, offset, nbytes, p.dtype, p.shape, p.device))
        offset += aligned(nbytes)
    return slots, offset


def _page_aligned_empty(nbytes: int) -> torch.Tensor:
    """Plain (pageable) bytes starting on a page boundary, sized to whole pages."""
    size = (nbytes + PAGE - 1) // PAGE * PAGE
    raw = torch.empty(size + PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    return raw[start : start + size]


def default_pinned_budget(streamable_on_cpu: int) -> int:
    """What can be page-locked without starving the host: available RAM, plus the RAM
    the original CPU params give back as they are packed, less a reserve."""
    vm = psutil.virtual_memory()
    reserve = max(2 * GiB, vm.total // 10)
    return max(0, vm.available + streamable_on_cpu - reserve)


class HostStore:
    """Owns the packed host masters, the pinned registrations and the staging buffers."""

    def __init__(self, device: torch.device, pinned_budget: int | None, packing_threshold: int) -> None:
        self.device = device
        self.use_pinning = device.type == "cuda"
        self.pinned_budget = pinned_budget
        self.packing_threshold = packing_threshold
        self.layers: dict[int, HostLayer] = {}
        self.pinned_bytes = 0
        self.pageable_layers: list[int] = []
        self.staging: list[torch.Tensor] = []
        self._registered_staging: list[int] = []

    def check_ram(self, total_bytes: int, streamable_on_cpu: int) -> None:
        """Fail before packing if the host can't hold the streamed layers at all."""
        vm = psutil.virtual_memory()
        need = total_bytes - streamable_on_cpu  # bytes that are not yet in RAM
        if need > vm.available:
            raise DGLSUserError(
                f"too little RAM to hold the streamed layers: need {need / GiB:.1f} GiB more, "
                f"{vm.available / GiB:.1f} GiB available; stream fewer layers (blocks_to_swap) or free RAM"
            )

    def add_layer(self, index: int, params: list[torch.nn.Parameter]) -> HostLayer:
        """Pack one layer's frozen params into host memory and pin it while the budget lasts."""
        slots, nbytes = layout_params(params)
        budget = self.pinned_budget
        pin = self.use_pinning and (budget is None or self.pinned_bytes + nbytes <= budget)
        packed = nbytes >= self.packing_threshold
        buffer = _page_aligned_empty(nbytes) if self.use_pinning else torch.empty(nbytes, dtype=torch.uint8)
        layer = HostLayer(slots, nbytes, buffer[:nbytes], pinned=False, packed=packed)
        with torch.no_grad():
            for p in slots:
                layer.master_view(p).copy_(p.param.data)
        if pin:
            layer.registered = _register(buffer)
            layer.pinned = True
            self.pinned_bytes += buffer.numel()
        elif self.use_pinning:
            self.pageable_layers.append(index)
        self.layers[index] = layer
        return layer

    def ensure_staging(self, count: int, nbytes: int) -> None:
        """Pinned bounce buffers for pageable layers (only if some layer is pageable)."""
        if not self.pageable_layers or self.staging:
            return
        for _ in range(count):
            buf = _page_aligned_empty(nbytes)
            self._registered_staging += _register(buf)
            self.staging.append(buf)
            self.pinned_bytes += buf.numel()

    def release(self) -> None:
        """Unpin and drop every buffer (masters must have been copied out first)."""
        for layer in self.layers.values():
            _unregister(layer.registered)
            layer.registered = []
        _unregister(self._registered_staging)
        self._registered_staging = []
        self.layers.clear()
        self.staging.clear()
        self.pinned_bytes = 0


def _register(buffer: torch.Tensor) -> list[int]:
    """Page-lock a page-aligned CPU buffer in chunks below 2 GiB; return the registered pointers."""
    cudart = torch.cuda.cudart()
    base, total, done = buffer.data_ptr(), buffer.numel(), []
    for offset in range(0, total, REGISTER_CHUNK):
        size = min(REGISTER_CHUNK, total - offset)
        err = cudart.cudaHostRegister(base + offset, size, 0)
        if int(err) != 0:
            _unregister(done)
            raise DGLSUserError(
                f"could not pin {size / GiB:.2f} GiB of host RAM (cudaHostRegister error {int(err)}); "
                "lower pinned_ram_budget_gb or free RAM"
            )
        done.append(base + offset)
    return done


def _unregister(pointers: list[int]) -> None:
    if not pointers:
        return
    cudart = torch.cuda.cudart()
    for ptr in pointers:
        cudart.cudaHostUnregister(ptr)
