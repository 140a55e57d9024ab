"""Pinned host memory of exact size.

Why: PyTorch's pinned allocator (``pin_memory=True``, ``Tensor.pin_memory()``) rounds every block up to
a power of two, so a 566 MB fp32 master page-locks 1 GiB. A full fine-tune's gradient landings,
masters and moments were all allocated that way, and the start-up report (which counts what they
hold) said less than the host then gave (the Flux-width full fine-tune's peak RSS before and after:
benchmarks/results/full_flux.md, full_flux_exact_pinning.md). Page-locked RAM cannot be swapped, so
every rounded byte is a byte the host loses.

How: a buffer here is plain page-aligned memory, page-locked with one ``cudaHostRegister`` call.
Copies from it run asynchronously like copies from PyTorch's pinned blocks (``Tensor.is_pinned()``
knows only the latter, and says False).

Hazard: one copy must not span two registrations (CUDA refuses it: "invalid argument"). The host
store registers its layers in 1 GiB chunks and splits its copies at them; a :class:`PinnedMemory`
buffer, whose views are copied at any offset, is registered whole, so it is registered here only up
to :data:`WHOLE_MAX` (registrations above 2 GiB are reported to fail); a larger one comes from
PyTorch's pinned allocator, rounded up as it rounds (a layer's fp32 buffers pass 2 GiB only past
512M params).

Invariant and hazard: registered memory must be unregistered before it is freed. A
:class:`Registrations` keeps each registered buffer alive until it is dropped; :class:`PinnedMemory`,
the allocator its owners use, drops them all on :meth:`PinnedMemory.release` or, through a
``weakref.finalize``, when it is collected. A tensor handed out stays valid after its buffer is
dropped (it keeps the storage alive), only no longer page-locked.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch

from ..errors import DGLSUserError

PAGE = 4096
GiB = 1 << 30
REGISTER_CHUNK = 1 * GiB  # registrations above 2 GiB are reported to fail; stay well under
WHOLE_MAX = 2 * GiB  # the largest buffer registered in one call (see the module doc)
WEIGHTS_HINT = "lower pinned_ram_budget_gb or free RAM"


def whole_pages(nbytes: int) -> int:
    return (nbytes + PAGE - 1) // PAGE * PAGE


def page_aligned_empty(nbytes: int) -> torch.Tensor:
    """Plain (pageable) bytes starting on a page boundary, sized to whole pages."""
    size = whole_pages(nbytes)
    raw = torch.empty(size + PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    return raw[start : start + size]


def register(buffer: torch.Tensor, hint: str = WEIGHTS_HINT, chunk: int = REGISTER_CHUNK) -> list[int]:
    """Page-lock a page-aligned CPU buffer in registrations of ``chunk`` bytes; return the registered pointers.
    ``hint``: what to change when the host refuses."""
    cudart = torch.cuda.cudart()
    base, total, done = buffer.data_ptr(), buffer.numel(), []
    for offset in range(0, total, chunk):
        size = min(chunk, total - offset)
        err = cudart.cudaHostRegister(base + offset, size, 0)
        if int(err) != 0:
            unregister(done)
            raise DGLSUserError(
                f"could not pin {size / GiB:.2f} GiB of host RAM (cudaHostRegister error {int(err)}); {hint}"
            )
        done.append(base + offset)
    return done


def unregister(pointers: list[int]) -> None:
    if not pointers:
        return
    cudart = torch.cuda.cudart()
    for ptr in pointers:
        cudart.cudaHostUnregister(ptr)


class Registrations:
    """CUDA host registrations and the buffers they pin (kept alive until unregistered)."""

    def __init__(self, hint: str = WEIGHTS_HINT) -> None:
        self.hint = hint
        self.entries: dict[int, tuple[torch.Tensor, list[int]]] = {}  # key -> (buffer, registered pointers)

    def add(self, key: int, buffer: torch.Tensor, chunk: int = REGISTER_CHUNK) -> None:
        self.entries[key] = (buffer, register(buffer, self.hint, chunk))

    def drop(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            unregister(entry[1])

    def drop_all(self) -> None:
        for key in list(self.entries):
            self.drop(key)


class PinnedMemory:
    """Exact-size host tensors for one owner: page-locked when ``pin`` (a CUDA device), plain otherwise;
    ``hint`` says what to change when the host refuses to pin more.

    ``nbytes`` counts what is page-locked now (whole pages). Buffers are dropped one by one
    (:meth:`free`) or all together (:meth:`release`, or when this object is collected)."""

    def __init__(self, pin: bool, hint: str) -> None:
        self.pin = pin
        self.nbytes = 0
        self._sizes: dict[int, int] = {}  # data_ptr -> page-locked bytes
        self._registrations = Registrations(hint)
        self._finalizer = weakref.finalize(self, Registrations.drop_all, self._registrations)

    def empty(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if not self.pin:
            return torch.empty(tuple(shape), dtype=dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > WHOLE_MAX:  # PyTorch's pinned allocator: rounded up to a power of two
            tensor = torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
            size = 1 << (nbytes - 1).bit_length()
        else:
            raw = page_aligned_empty(max(nbytes, 1))
            self._registrations.add(raw.data_ptr(), raw, chunk=raw.numel())
            tensor, size = raw[:nbytes].view(dtype).view(tuple(shape)), raw.numel()
        self._sizes[tensor.data_ptr()] = size
        self.nbytes += size
        return tensor

    def zeros(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of a CPU tensor (as ``tensor.pin_memory()``, without the rounding)."""
        return self.empty(tensor.shape, tensor.dtype).copy_(tensor)

    def free(self, tensor: torch.Tensor) -> None:
        """Unpin the buffer ``tensor`` was handed out as (nothing if it was not; one of PyTorch's pinned
        blocks goes back to its cache when the last tensor on it goes)."""
        size = self._sizes.pop(tensor.data_ptr(), None)
        if size is not None:
            self._registrations.drop(tensor.data_ptr())
            self.nbytes -= size

    def release(self) -> None:
        """Unpin every buffer (the tensors stay valid, pageable)."""
        self._registrations.drop_all()
        self._sizes.clear()
        self.nbytes = 0
