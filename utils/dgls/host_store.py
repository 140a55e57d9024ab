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
from .precision import ParamCast, dequantize, quantize

GiB = 1024**3
PAGE = 4096
REGISTER_CHUNK = 1 * GiB  # registrations above 2 GiB are reported to fail; stay well under
COPY_CHUNK = REGISTER_CHUNK


@dataclass
class ParamSlot:
    """Where one frozen param lives: ``offset``/``nbytes`` in the device slot (``dtype``, what the
    layer computes with), ``host_offset``/``host_nbytes`` in the host master (``stored``, what is copied).
    The two differ only for fp8 storage, which also keeps fp32 ``scale``s (per row) on the device."""

    param: torch.nn.Parameter
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    original_device: torch.device
    stored: torch.dtype
    host_offset: int
    host_nbytes: int
    scale: torch.Tensor | None = None  # fp32, on the swapper's device (fp8 storage only)
    scale_host: torch.Tensor | None = None  # the same scales on the CPU, for state dicts

    @property
    def scaled(self) -> bool:
        return self.stored != self.dtype


@dataclass
class HostLayer:
    """One streamed layer's master bytes and how they are copied to a device slot.

    Layout: params copied as they are come first, at the same offsets in the host buffer and
    in the slot (``direct_bytes`` of them), so they travel straight into the slot. fp8-stored
    params follow; on CUDA their bytes land in a per-stream landing buffer and are upcast
    into the slot on the copy stream (:meth:`upcast`), on the CPU they are upcast from the master.
    """

    params: list[ParamSlot]
    nbytes: int  # slot bytes: every param in its compute dtype
    buffer: torch.Tensor  # uint8, CPU: host_nbytes of stored bytes
    pinned: bool
    packed: bool
    host_nbytes: int  # bytes copied per fetch
    direct_bytes: int  # the prefix copied straight into the slot
    registered: list[int] = field(default_factory=list)  # base pointers registered with CUDA

    @property
    def landing_bytes(self) -> int:
        """Stored bytes that are upcast on the device (0 without fp8 storage)."""
        return self.host_nbytes - self.direct_bytes

    def copies(self, slot: torch.Tensor, landing: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host bytes, device bytes) pairs to copy: chunks when packed, per param if not.

        Without ``landing`` the fp8-stored part is not copied (the CPU upcasts from the master).
        """
        pairs = []
        if self.packed:
            for o in range(0, self.direct_bytes, COPY_CHUNK):
                end = min(o + COPY_CHUNK, self.direct_bytes)
                pairs.append((self.buffer[o:end], slot[o:end]))
            if landing is not None:
                for o in range(self.direct_bytes, self.host_nbytes, COPY_CHUNK):
                    end = min(o + COPY_CHUNK, self.host_nbytes)
                    pairs.append((self.buffer[o:end], landing[o - self.direct_bytes : end - self.direct_bytes]))
            return pairs
        for p in self.params:
            src = self.buffer[p.host_offset : p.host_offset + p.host_nbytes]
            if not p.scaled:
                pairs.append((src, slot[p.offset : p.offset + p.nbytes]))
            elif landing is not None:
                start = p.host_offset - self.direct_bytes
                pairs.append((src, landing[start : start + p.host_nbytes]))
        return pairs

    def upcast(self, slot: torch.Tensor, landing: torch.Tensor | None) -> None:
        """Write the fp8-stored params into the slot in their compute dtype (times their scales)."""
        for p in self.params:
            if not p.scaled:
                continue
            if landing is not None:
                start = p.host_offset - self.direct_bytes
                source = landing[start : start + p.host_nbytes]
            else:
                source = self.buffer[p.host_offset : p.host_offset + p.host_nbytes]
            out = slot[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape)
            dequantize(source.view(p.stored).view(p.shape), p.scale, p.dtype, out=out)

    def master_view(self, p: ParamSlot) -> torch.Tensor:
        """The stored bytes as a typed view into host memory (fp8 for fp8-stored params)."""
        return self.buffer[p.host_offset : p.host_offset + p.host_nbytes].view(p.stored).view(p.shape)

    def value(self, p: ParamSlot) -> torch.Tensor:
        """The param's true value in its compute dtype: the master itself, or its dequantized copy."""
        if not p.scaled:
            return self.master_view(p)
        return dequantize(self.master_view(p), p.scale_host, p.dtype)

    def store_value(self, p: ParamSlot, value: torch.Tensor) -> None:
        """Write a new value into the master (re-quantized for fp8 storage, scales updated)."""
        with torch.no_grad():
            if not p.scaled:
                self.master_view(p).copy_(value)
                return
            q, scale = quantize(value.to(p.scale.device, p.dtype), p.stored)
            self.master_view(p).copy_(q)
            p.scale.copy_(scale)
            p.scale_host.copy_(scale)


def layout_params(
    params: list[torch.nn.Parameter], casts: dict[int, ParamCast] | None = None
) -> tuple[list[ParamSlot], int, int, int]:
    """Aligned offsets for a layer's frozen params: (slots, slot bytes, host bytes, direct bytes)."""
    casts = casts or {}
    direct = [p for p in params if not (id(p) in casts and casts[id(p)].scaled)]
    scaled = [p for p in params if id(p) in casts and casts[id(p)].scaled]
    slots, offset = [], 0
    for p in direct:
        dtype = casts[id(p)].dtype if id(p) in casts else p.dtype
        nbytes = p.numel() * dtype.itemsize
        slots.append(ParamSlot(p, offset, nbytes, dtype, p.shape, p.device, dtype, offset, nbytes))
        offset += aligned(nbytes)
    direct_bytes = host_offset = offset
    for p in scaled:
        cast = casts[id(p)]
        nbytes, host_nbytes = p.numel() * cast.dtype.itemsize, p.numel() * cast.stored.itemsize
        slots.append(ParamSlot(p, offset, nbytes, cast.dtype, p.shape, p.device, cast.stored, host_offset, host_nbytes))
        offset += aligned(nbytes)
        host_offset += aligned(host_nbytes)
    return slots, offset, host_offset, direct_bytes


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

    def add_layer(
        self, index: int, params: list[torch.nn.Parameter], casts: dict[int, ParamCast] | None = None
    ) -> HostLayer:
        """Pack one layer's frozen params into host memory (cast as ``casts`` says) and pin it while the budget lasts.

        fp8 scales are computed on the swapper's device (fast, and the same device reproduces them).
        """
        slots, nbytes, host_nbytes, direct = layout_params(params, casts)
        budget = self.pinned_budget
        pin = self.use_pinning and (budget is None or self.pinned_bytes + host_nbytes <= budget)
        packed = host_nbytes >= self.packing_threshold
        buffer = _page_aligned_empty(host_nbytes) if self.use_pinning else torch.empty(host_nbytes, dtype=torch.uint8)
        layer = HostLayer(slots, nbytes, buffer[:host_nbytes], False, packed, host_nbytes, direct)
        with torch.no_grad():
            for p in slots:
                if p.scaled:
                    q, p.scale = quantize(p.param.data.to(self.device), p.stored)
                    p.scale_host = p.scale.cpu()
                    layer.master_view(p).copy_(q)
                else:
                    layer.master_view(p).copy_(p.param.data)
        if pin:
            layer.registered = _register(buffer)
            layer.pinned = True
            self.pinned_bytes += buffer.numel()
        elif self.use_pinning:
            self.pageable_layers.append(index)
        self.layers[index] = layer
        return layer

    def remove_layer(self, index: int) -> None:
        """Unpin and drop one layer's master (it became resident; the device copy is the weight now)."""
        layer = self.layers.pop(index)
        _unregister(layer.registered)
        if layer.pinned:
            self.pinned_bytes -= (layer.host_nbytes + PAGE - 1) // PAGE * PAGE  # as _page_aligned_empty sized it
        if index in self.pageable_layers:
            self.pageable_layers.remove(index)

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
