"""Disk tier: streamed layers that do not fit the host RAM budget live in a file on a local disk.

Why: streaming moved the wall from VRAM to host RAM; a machine with less RAM than the model could not
train at all. Disk is the transport's third memory (:mod:`.transport`, ``Direction.DISK_IN``): a spilled
layer's bytes are read into a ring of pinned staging buffers, and its host->device copy reads from there.

Parts
    - :func:`check_directory`: the directory is a writable directory with room for the file, checked before
      anything is written (one clear :class:`~..errors.DGLSUserError` line otherwise).
    - :class:`DiskFile`: one file that has no name (``O_TMPFILE``; where the file system lacks it, a named
      file unlinked at once): it is gone when the process ends, however it ends (normal exit, Ctrl-C,
      ``kill -9``). Named files carry the process id (``dgls-disk-<pid>-*``); the next start removes those whose
      process is gone, and nothing else. Each layer has an extent of whole pages, reached through a shared
      ``mmap`` (the master's bytes for state dicts and packing) and read by the reader (:mod:`.disk_io`) with
      direct I/O for the copies.
    - :class:`StagingRing`: ``count`` page-aligned buffers (page-locked on CUDA) the reads land in.
    - :class:`DiskTier`: the file, the ring and :meth:`DiskTier.read`, what the weight copier calls before the
      host->device copy of a spilled layer. :meth:`DiskTier.stage`: the read ahead the engine issues for the
      spilled layers the step uses next (:meth:`..engine.swapper.LayerSwapper.read_ahead`) as soon as a ring
      buffer is free, so the disk keeps reading while the copies and compute before them run, not only from a
      layer's fetch (``prefetch`` layers ahead); a fetch takes its layer's read ahead, or reads now.
      :meth:`DiskTier.measure` reads up to 512 MiB of the packed layers for the disk's bandwidth where the builder
      has no figure from :func:`probe_read_gbps` (said in the start-up line).
    - :func:`probe_read_gbps`: the disk's read bandwidth before any layer is packed (a small unnamed file written and
      read back through the same reader), which the disk plan (:mod:`..planning.disk_plan`) chooses the spilled
      layers with.

Invariants
    - A read ahead goes only into a buffer whose last copy was submitted, never one that holds a read ahead not
      taken yet: so no read waits for a fetch that may not come (a step that turns another way). A fetch of a layer
      without a read ahead takes the next buffer, dropping the read ahead it held (after that read).
    - A read into ring buffer ``k`` waits for the weight copy that read buffer ``k`` before (a gate), and a
      weight copy from buffer ``k`` waits for its read (the copier's gate): so the CPU transport, which poisons
      a read's destination until the read is waited for, fails a test when either wait is missing.
    - A layer's bytes are on the disk (``msync``), unmapped from this process (``MADV_DONTNEED``) and out of the
      page cache (``POSIX_FADV_DONTNEED``) once packed, so no RAM holds a second copy of what was spilled to save
      RAM (reads use direct I/O where the file system allows it; a state dict reads through the mapping).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from ..errors import DGLSUserError
from .disk_io import DiskReader, open_reader
from .layout import human_bytes
from .pinned import REGISTER_CHUNK, Registrations, page_aligned_empty, whole_pages
from .transport import Copy, Transport

PREFIX = "dgls-disk-"
NAMED = re.compile(rf"^{PREFIX}(\d+)-")
FREE_MARGIN = 256 * 1024 * 1024  # left free on the disk beside the file
MEASURE_BYTES = 512 * 1024 * 1024  # read at start-up to measure the disk's bandwidth
PROBE_BYTES = 256 * 1024 * 1024  # written and read back (timed) before packing, for the disk plan
PROBE_WARM = 32 * 1024 * 1024  # read first, untimed (:func:`probe_read_gbps`)
RAM_FILE_SYSTEMS = ("tmpfs", "ramfs")


def default_directory() -> Path:
    return Path(tempfile.gettempdir())


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use in ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def file_system(directory: Path) -> str:
    """The type of the file system ``directory`` is on (from /proc/mounts; "" if unknown)."""
    best, kind = "", ""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    target = str(directory.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) >= 3:
            mount = parts[1]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, parts[2]
    return kind


def check_directory(
    directory: str | Path | None, nbytes: int, purpose: str = "the layers that do not fit the host RAM budget"
) -> Path:
    """The directory for a ``nbytes`` file, made if missing; one clear line (saying what needs it: ``purpose``) if it
    cannot take the file."""
    path = Path(directory).expanduser() if directory else default_directory()
    hint = "name another directory with --disk_dir, or raise --host_ram_budget"
    if path.exists() and not path.is_dir():
        raise DGLSUserError(f"disk_dir {path} is not a directory: {hint}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DGLSUserError(f"disk_dir {path} cannot be made ({exc.strerror}): {hint}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise DGLSUserError(f"disk_dir {path} is not writable: {hint}")
    free = free_bytes(path)
    if free < nbytes + FREE_MARGIN:
        raise DGLSUserError(
            f"disk_dir {path} has {human_bytes(free)} free; {purpose} need {human_bytes(nbytes)} (and "
            f"{human_bytes(FREE_MARGIN)} left free): {hint}"
        )
    return path


def precheck_directory(directory: str | Path | None) -> None:
    """The start-up check, before any slow work and without writing anything: ``directory`` (or, while it does not
    exist, the folder it would be made in) is a writable directory with more than the margin free."""
    path = Path(directory).expanduser() if directory else default_directory()
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    hint = "name another directory with --disk_dir, or raise --host_ram_budget"
    if not existing.is_dir():
        raise DGLSUserError(f"disk_dir {path}: {existing} is not a directory: {hint}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DGLSUserError(f"disk_dir {path} is not writable: {hint}")
    if (free := free_bytes(existing)) < FREE_MARGIN:
        raise DGLSUserError(f"disk_dir {path} has {human_bytes(free)} free: {hint}")


def remove_stale(directory: Path) -> list[Path]:
    """Remove the named files of earlier runs whose process is gone (``dgls-disk-<pid>-*`` only)."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = NAMED.match(name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        try:
            (directory / name).unlink()
            removed.append(directory / name)
        except OSError:
            pass
    return removed


def _user_error(path: Path, exc: OSError, nbytes: int) -> DGLSUserError:
    hint = "name another directory with --disk_dir, or raise --host_ram_budget"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DGLSUserError(f"disk_dir {path} has no room for {human_bytes(nbytes)} of spilled layers: {hint}")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return DGLSUserError(f"disk_dir {path} is not writable ({exc.strerror}): {hint}")
    return DGLSUserError(f"disk_dir {path}: cannot make the disk tier's file ({exc.strerror}): {hint}")


class DiskFile:
    """An unnamed file of ``nbytes`` (whole pages) in ``directory``, its extents and a shared mapping of it."""

    use_tmpfile = True  # False: a named file, unlinked at once (file systems without O_TMPFILE; tests)

    def __init__(self, directory: Path, nbytes: int) -> None:
        self.directory = directory
        self.nbytes = whole_pages(max(nbytes, 1))
        self.named = False
        self.fd = self._create()
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)  # room reserved now: a full disk fails here, not mid-run
            self._map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(self.fd)
            raise _user_error(directory, exc, self.nbytes) from None
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.used = 0
        self.extents: dict[int, tuple[int, int]] = {}  # layer index -> (offset, whole-page size)

    def _create(self) -> int:
        try:
            if self.use_tmpfile:
                return os.open(self.directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise _user_error(self.directory, exc, self.nbytes) from None
        try:  # no O_TMPFILE here: a named file, unlinked at once (a stale one is removed by the next start)
            fd, name = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.directory)
        except OSError as exc:
            raise _user_error(self.directory, exc, self.nbytes) from None
        os.unlink(name)
        self.named = True
        return fd

    def allocate(self, index: int, nbytes: int) -> tuple[int, torch.Tensor]:
        """Layer ``index``'s extent of whole pages (its own again when it streams again after being resident):
        its offset and its mapped bytes."""
        size = whole_pages(nbytes)
        offset, had = self.extents.get(index, (self.used, 0))
        if size > had:
            if self.used + size > self.nbytes:
                raise RuntimeError(f"disk tier: layer {index} does not fit ({self.used} + {size} > {self.nbytes})")
            offset, self.used = self.used, self.used + size
            self.extents[index] = (offset, size)
        return offset, self.bytes[offset : offset + size]

    def offset(self, index: int) -> int:
        return self.extents[index][0]

    def flush(self, offset: int, nbytes: int) -> None:
        """The extent's bytes to the disk, out of this process's pages (packing touched them through the mapping:
        they would count as its RSS) and out of the page cache (which keeps no page a process maps)."""
        size = whole_pages(nbytes)
        self._map.flush(offset, size)
        self._map.madvise(mmap.MADV_DONTNEED, offset, size)  # a shared file mapping: the bytes stay in the file
        os.posix_fadvise(self.fd, offset, size, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close the descriptor and drop this object's hold on the mapping. The mapping is never closed here: a
        tensor viewing it (a state dict's value, a param restored in place) keeps it, and it goes with the last
        of them (closing it would leave them pointing at unmapped memory); the file goes with the mapping."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.bytes = None
        self._map = None


def probe_read_gbps(
    directory: str | Path | None, nbytes: int, pin: bool, threads: int = 8, request: int | None = None
) -> tuple[float, str]:
    """The disk's read bandwidth in GB/s and the reader's name: ``nbytes`` (at most ``PROBE_BYTES``) written to an
    unnamed file in ``directory`` (checked first: one clear line), flushed out of the page cache and read back
    through the reader the tier will use (``pin``: CUDA runs, DeepSpeed's async I/O where it builds), timed in reads
    of ``request`` bytes (the largest spilled layer's, as training reads them; default: one read of it all) after
    one untimed read of ``PROBE_WARM`` bytes before them. Before, one timed read of 128 MiB, the reader's threads
    starting in it: on the lent H200 machine it said 1.29 to 1.63 GB/s where 64 MiB reads ran at 1.89 to 1.95, and
    on a CPU machine's virtual disk 1.23 to 1.60 where 136 to 200 MiB reads ran at 1.86 to 2.02, so the plan counted
    every read about a quarter slower than training reads it. The bytes are not zeros: a file system may skip
    reading unwritten or zero blocks."""
    timed = whole_pages(max(min(nbytes, PROBE_BYTES), 1))
    request = whole_pages(min(max(request or timed, 1), timed))
    warm = whole_pages(min(PROBE_WARM, request))
    size = warm + timed
    file = DiskFile(check_directory(directory, size), size)
    try:
        pattern = (torch.arange(min(size, 16 * 1024 * 1024), dtype=torch.int32) % 251 + 1).to(torch.uint8)
        data = memoryview(pattern.numpy())
        for offset in range(0, size, len(data)):
            os.pwrite(file.fd, data[: min(len(data), size - offset)], offset)
        os.fsync(file.fd)
        os.posix_fadvise(file.fd, 0, size, os.POSIX_FADV_DONTNEED)
        reader = open_reader(file.fd, threads, use_aio=pin)
        try:
            buffer = page_aligned_empty(request)
            reader.read(buffer[:warm], 0)  # untimed: the first request's latency, the threads' start
            read, began = 0, time.perf_counter()
            for offset in range(warm, size - request + 1, request):
                reader.read(buffer, offset)
                read += request
            seconds = time.perf_counter() - began
        finally:
            reader.close()
    finally:
        file.close()
    return (read / seconds / 1e9 if seconds > 0 else 0.0), reader.name


class StagingRing:
    """``count`` page-aligned buffers of ``nbytes`` (page-locked when ``pin``), handed out in turn; each remembers
    the last copy that reads it, so the next read into it waits for that copy."""

    def __init__(self, count: int, nbytes: int, pin: bool) -> None:
        self.nbytes = whole_pages(max(nbytes, 1))
        self._registrations = Registrations("lower --host_ram_budget's ring, or free RAM")
        self.buffers = [page_aligned_empty(self.nbytes) for _ in range(count)]
        if pin:
            for k, buf in enumerate(self.buffers):
                self._registrations.add(k, buf, chunk=REGISTER_CHUNK)  # copies split at the same 1 GiB bounds
        self.pinned_bytes = count * self.nbytes if pin else 0
        self.readers: list[Copy | None] = [None] * count
        self._next = 0

    def take(self) -> int:
        k = self._next
        self._next = (k + 1) % len(self.buffers)
        return k

    @property
    def next(self) -> int:
        """The buffer :meth:`take` hands out next."""
        return self._next

    def release(self) -> None:
        self._registrations.drop_all()
        self.pinned_bytes = 0
        self.readers = [None] * len(self.buffers)


@dataclass(frozen=True)
class Staged:
    """A read issued ahead of its layer's fetch: the ring buffer it lands in, and the read."""

    buffer: int
    view: torch.Tensor
    read: Copy


@dataclass
class DiskTier:
    """The file the spilled layers live in, the ring their reads land in, and the reader."""

    file: DiskFile
    ring: StagingRing
    reader: DiskReader
    spilled: frozenset[int]  # the layer indices whose masters live on disk
    notes: list[str] = field(default_factory=list)
    read_gbps: float = 0.0  # measured at start-up (:func:`probe_read_gbps`, or :meth:`measure`)
    staged: dict[int, Staged] = field(default_factory=dict)  # layer -> its read ahead, until its fetch takes it
    taken: int = 0  # fetches that found their layer's read ahead
    dropped: int = 0  # reads ahead that a fetch of another layer took the buffer of (the step's order changed)

    @classmethod
    def open(
        cls, directory: str | Path | None, spilled: dict[int, int], ring_count: int, pin: bool, threads: int = 8
    ) -> DiskTier:
        """The tier for ``spilled`` (layer index -> host bytes): checks first, then the file and the ring."""
        total = sum(whole_pages(n) for n in spilled.values())
        path = check_directory(directory, total)
        notes = (
            [f"DGLS disk tier: removed {len(gone)} files of earlier runs from {path}"]
            if (gone := remove_stale(path))
            else []
        )
        if (kind := file_system(path)) in RAM_FILE_SYSTEMS:
            notes.append(
                f"DGLS disk tier: {path} is on {kind}, which is RAM: spilling there saves no RAM; name a directory on "
                "a disk with --disk_dir"
            )
        file = DiskFile(path, total)
        try:
            reader = open_reader(file.fd, threads, use_aio=pin)  # CUDA runs; CPU tests need no build
            ring = StagingRing(ring_count, max(spilled.values()), pin)
        except BaseException:
            file.close()
            raise
        return cls(file, ring, reader, frozenset(spilled), notes)

    def stage(self, transport: Transport, index: int, nbytes: int) -> bool:
        """Read layer ``index``'s extent ahead of its fetch, into the next ring buffer, if that buffer holds no read
        ahead a copy has not taken yet (else ``False``: the ring is full of reads ahead). The read waits for the copy
        that read the buffer before, which was submitted (a read ahead never waits for a fetch to come: a step that
        turns another way leaves no read waiting on a copy never submitted)."""
        if index in self.staged:
            return True
        if self._holder(self.ring.next) is not None:
            return False
        k = self.ring.take()
        self.staged[index] = Staged(k, *self._read_into(transport, k, index, nbytes))
        return True

    def read(self, transport: Transport, index: int, nbytes: int) -> tuple[int, torch.Tensor, Copy]:
        """Layer ``index``'s extent in a ring buffer, for its copy to the device: its read ahead (:meth:`stage`) if
        there is one, else a read now into the next ring buffer, after the copy that read that buffer before (and
        after the read ahead it held, which is dropped: its layer is read again when it is fetched). Returns the
        buffer's number (for :meth:`consumed`), the buffer, and the read's token."""
        staged = self.staged.pop(index, None)
        if staged is not None:
            self.taken += 1
            return staged.buffer, staged.view, staged.read
        k = self.ring.take()
        before = None
        if (held := self._holder(k)) is not None:
            before = self.staged.pop(held).read
            self.dropped += 1
        return (k, *self._read_into(transport, k, index, nbytes, before))

    def _holder(self, k: int) -> int | None:
        """The layer whose read ahead ring buffer ``k`` holds, not taken by a fetch yet (a scan of at most the ring's
        few reads ahead)."""
        return next((i for i, staged in self.staged.items() if staged.buffer == k), None)

    def _read_into(
        self, transport: Transport, k: int, index: int, nbytes: int, before: Copy | None = None
    ) -> tuple[torch.Tensor, Copy]:
        buffer = self.ring.buffers[k][: whole_pages(nbytes)]
        gates = [g for g in (self.ring.readers[k], before) if g is not None]
        return buffer, transport.read(buffer, self.file.offset(index), gates)

    def consumed(self, k: int, copy: Copy) -> None:
        """``copy`` reads ring buffer ``k``: the next read into it waits for it."""
        self.ring.readers[k] = copy

    @property
    def pinned_bytes(self) -> int:
        return self.ring.pinned_bytes

    def measure(self, limit: int = MEASURE_BYTES) -> float:
        """The disk's read bandwidth in GB/s, from reading up to ``limit`` bytes of the packed extents into the
        ring as the copies will (before any copy: the ring is free); kept in :attr:`read_gbps`."""
        done, began = 0, time.perf_counter()
        for offset, size in self.file.extents.values():
            n = min(size, self.ring.nbytes, limit - done)
            if n <= 0:
                break
            self.reader.read(self.ring.buffers[0][:n], offset)
            done += n
        seconds = time.perf_counter() - began
        self.read_gbps = done / seconds / 1e9 if done and seconds > 0 else 0.0
        return self.read_gbps

    def describe(self) -> str:
        measured = ""
        if self.read_gbps:
            floor = self.file.used / (self.read_gbps * 1e9)
            measured = (
                f"; measured {self.read_gbps:.2f} GB/s here, so one read of them all takes at least {floor:.2f} s "
                "(a LoRA step reads each in its forward and its backward)"
            )
        return (
            f"DGLS disk tier: {len(self.spilled)} streamed layers ({human_bytes(self.file.used)}) live in an unnamed "
            f"file in {self.file.directory} (gone when the process ends) and are read ahead into "
            f"{len(self.ring.buffers)} staging buffers of {human_bytes(self.ring.nbytes)} through {self.reader.name}"
            + measured
        )

    def close(self) -> None:
        """Stop reading, unpin the ring, close the file (idempotent: the transport closes the reader too)."""
        self.staged.clear()
        self.reader.close()
        self.ring.release()
        self.file.close()
