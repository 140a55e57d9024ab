"""Disk I/O: how the disk tier's bytes are read from its file into page-aligned host buffers.

Two readers, one interface (:class:`DiskReader`), chosen once at start-up by :func:`open_reader`, which says
which one runs:

- :class:`AioReader`: DeepSpeed's asynchronous I/O op (``AsyncIOBuilder``, the one ZeRO-Infinity reads NVMe
  with): libaio, ``O_DIRECT``, many requests in flight. It is a dependency already; it builds only where
  libaio's headers are installed (``apt install libaio-dev``), which :func:`open_reader` checks before trying.
- :class:`ThreadReader`: the fallback. ``os.preadv`` from ``threads`` threads (the syscall releases the GIL),
  each a chunk of the read, with ``O_DIRECT`` (no page-cache double copy) where the file system allows it,
  else plain buffered reads (tmpfs refuses ``O_DIRECT``).

Invariants
    - A read's destination starts on a page and spans whole pages; a read's offset is a whole number of pages
      (the disk tier lays its file out that way): what ``O_DIRECT`` needs.
    - :meth:`DiskReader.read` returns when every byte is in the destination (it raises on a short file).
    - :meth:`DiskReader.submit` runs jobs one at a time in submission order on the reader's own thread (the
      transport's disk reads: each one waits for its gates, then reads); the chunks of one read run in parallel.
    - :meth:`DiskReader.write` (the training state's write-backs, :mod:`..training.disk_state`) writes through a
      plain descriptor, one thread: a later direct read of the range sees the bytes (the kernel writes the range's
      dirty pages back before a direct read of it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

PAGE = 4096
CHUNK = 16 * 1024 * 1024  # one request of a threaded read
DEFAULT_THREADS = 8


class DiskReader(Protocol):
    name: str  # what the start-up line says runs

    def read(self, dst: torch.Tensor, offset: int) -> None: ...
    def write(self, src: torch.Tensor, offset: int) -> None: ...
    def submit(self, job: Callable[[], None]) -> Future: ...
    def close(self) -> bool: ...


class _Ordered:
    """The one thread that runs a reader's jobs in submission order."""

    def __init__(self) -> None:
        self._order = ThreadPoolExecutor(1, thread_name_prefix="dgls-disk-reads")
        self.closed = False

    def submit(self, job: Callable[[], None]) -> Future:
        return self._order.submit(job)

    def close(self) -> bool:
        """Wait for the submitted jobs and stop; False if it was closed before (closing twice is harmless)."""
        if self.closed:
            return False
        self.closed = True
        self._order.shutdown(wait=True)
        return True


class ThreadReader(_Ordered):
    """``os.preadv`` in chunks from ``threads`` threads; ``direct``: through an ``O_DIRECT`` descriptor."""

    def __init__(self, fd: int, threads: int = DEFAULT_THREADS, direct: bool = True) -> None:
        super().__init__()
        self.direct = False
        try:  # a second descriptor of the same (maybe unlinked) file, for direct reads
            if direct:
                self.fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT)
                self.direct = True
        except (OSError, AttributeError):
            pass
        if not self.direct:
            self.fd = os.dup(fd)
        self.write_fd = os.dup(fd)  # writes (the training state's write-backs) go through the page cache
        self.threads = max(1, threads)
        self._chunks = ThreadPoolExecutor(self.threads, thread_name_prefix="dgls-disk-chunks")
        mode = "direct I/O (O_DIRECT)" if self.direct else "buffered reads"
        mode += " (the file system refuses direct I/O)" if direct and not self.direct else ""
        self.name = f"os.preadv, {mode}, {self.threads} threads"

    def read(self, dst: torch.Tensor, offset: int) -> None:
        nbytes = dst.numel()
        if self.threads == 1 or nbytes <= CHUNK:
            _pread_all(self.fd, dst, offset)
            return
        futures = [
            self._chunks.submit(_pread_all, self.fd, dst[o : min(o + CHUNK, nbytes)], offset + o)
            for o in range(0, nbytes, CHUNK)
        ]
        for future in futures:
            future.result()

    def write(self, src: torch.Tensor, offset: int) -> None:
        _pwrite_all(self.write_fd, src, offset)

    def close(self) -> bool:
        if not super().close():
            return False
        self._chunks.shutdown(wait=True)
        os.close(self.fd)
        os.close(self.write_fd)
        return True


class AioReader(_Ordered):
    """DeepSpeed's async I/O op: ``O_DIRECT`` reads through libaio, ``queue_depth`` requests in flight. It opens
    the file by name: the unlinked file is reached through ``/proc/self/fd``."""

    def __init__(self, fd: int, handle, threads: int) -> None:
        super().__init__()
        self.fd = os.dup(fd)
        self.path = f"/proc/self/fd/{self.fd}"
        self.handle = handle
        self.name = f"DeepSpeed async I/O (libaio, O_DIRECT), {threads} threads"

    def read(self, dst: torch.Tensor, offset: int) -> None:
        done = self.handle.sync_pread(dst, self.path, offset)
        if done < 0:
            raise OSError(f"DeepSpeed async I/O read of {dst.numel()} bytes at {offset} failed ({done})")

    def write(self, src: torch.Tensor, offset: int) -> None:
        _pwrite_all(self.fd, src, offset)  # a plain descriptor: buffered writes (a direct read sees them)

    def close(self) -> bool:
        if not super().close():
            return False
        os.close(self.fd)
        return True


def aio_handle(threads: int) -> tuple[object | None, str]:
    """DeepSpeed's aio handle, or None and why not (the op cannot build here, e.g. no libaio headers, or load)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, "DeepSpeed's async I/O op cannot build here (apt install libaio-dev)"
        module = builder.load(verbose=False)
        return module.aio_handle(1024 * 1024, 32, False, True, threads), ""
    except Exception as exc:  # noqa: BLE001 - any failure to build or load means the fallback, said at start-up
        return None, f"DeepSpeed's async I/O op failed to load ({type(exc).__name__}: {exc})"


def open_reader(fd: int, threads: int = DEFAULT_THREADS, use_aio: bool = True) -> DiskReader:
    """The reader for the file ``fd``: DeepSpeed's async I/O where it builds and ``use_aio`` (CUDA runs), else
    threads; its ``name`` says which, and why not the first. The async I/O op reads with ``O_DIRECT`` only: where
    the file system refuses it (tmpfs before Linux 6.6), every read would fail, so the threads read, buffered."""
    handle, why = (None, "")
    if use_aio and not _direct_allowed(fd):
        why = "the file system refuses direct I/O, which DeepSpeed's async I/O op needs"
    elif use_aio:
        handle, why = aio_handle(threads)
    if handle is not None:
        return AioReader(fd, handle, threads)
    reader = ThreadReader(fd, threads)
    if why:
        reader.name += f" ({why})"
    return reader


def pread_into(fd: int, dst: torch.Tensor, offset: int) -> None:
    """Read ``dst``'s bytes (a contiguous tensor of any dtype) at ``offset`` of a buffered descriptor (any offset)."""
    _pread_all(fd, dst.view(torch.uint8) if dst.dim() else dst.reshape(1).view(torch.uint8), offset)


def _direct_allowed(fd: int) -> bool:
    """Whether the file ``fd`` opens for ``O_DIRECT`` reads."""
    try:
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT))
    except (OSError, AttributeError):
        return False
    return True


def _pread_all(fd: int, dst: torch.Tensor, offset: int) -> None:
    """Read ``dst.numel()`` bytes at ``offset`` (short reads continue; end of file raises)."""
    view = memoryview(dst.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"disk tier: read {done} of {len(view)} bytes at offset {offset}: the file ended")
        done += n


def _pwrite_all(fd: int, src: torch.Tensor, offset: int) -> None:
    """Write ``src.numel()`` bytes at ``offset`` (short writes continue)."""
    view = memoryview(src.numpy()).cast("B")
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)
