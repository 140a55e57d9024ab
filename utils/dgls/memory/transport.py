"""Transport: the one owner of DGLS's copy streams, events and worker threads, for every direction.

A copy is a copy whatever it carries. Clients keep their policies (which bytes move, and when) and
say what to move in one vocabulary:

- ``submit(direction, [(dst, src), ...], gates) -> Copy``: copy after every gate (a :class:`Copy`
  or a :class:`Marker`); nothing waits on the host. The returned :class:`Copy` is the token.
- ``acquire(copy)``: from now on the compute stream may read the destination (it waits for the
  copy on the device; the host does not). With ``timed`` (CUDA) it returns timing events around the wait.
- ``land(copy_or_marker)``: the host may read the destination (it blocks until the bytes are there).
- ``mark(direction=None) -> Marker``: stands for everything enqueued so far on the compute stream
  (or on a direction's stream), e.g. every kernel that reads a buffer: a later write waits for it.
- ``issue(direction, gates) -> Copy`` (a context): arbitrary work (copies, an fp8 upcast, an
  optimizer kernel) enqueued on the direction's stream behind the gates; the copy is ready after it.
  ``issue_work(direction, gates, work, *args)``: the same for one call ``work(*args)``, without a context
  manager per copy (the weight copier's hot path: one per fetch).
- ``read(dst, offset, gates) -> Copy``: disk -> host memory, the disk tier's third memory
  (:mod:`.disk_tier`): read ``dst.numel()`` bytes of the disk file at ``offset`` after the gates. A read
  is host work (:mod:`.disk_io`'s reader thread), not stream work: whoever waits for it (``land``, or
  the issuing of a copy gated on it) waits on the host; the returned token carries the read's future.
  ``disk=`` names another file's reader (the training state's, :mod:`..training.disk_state`).
- ``write(src, offset, gates, disk) -> Copy``: host memory -> disk (the training state's write-backs), the
  same way: host work on the reader's ordered thread, after its gates.

Who owns what:

- Every CUDA stream DGLS creates is created in :meth:`CudaTransport.__init__`, one (or, for
  weights, ``weight_lanes``) per :class:`Direction`, each with a comment saying why.
- Every event is recorded here (:meth:`mark`, :meth:`issue` and :meth:`issue_work`, a timed :meth:`acquire`).
- The worker threads (:class:`Worker`), two of them, each for one kind of work, in submission order:
  ``copy_worker`` issues the weight copier's copies (``--threading``), ``job_worker`` runs the host
  optimizer's jobs (gradient sums, updates). Two, because an item cannot be interrupted: on one
  thread a copy the next layer needs would wait for the host update that is running, which takes
  many times a copy's issuing.
- One delay hook for tests (:attr:`Transport.delay`, CUDA): a GPU sleep
  (:func:`~..torch_private.sleep_on_stream`) before the work of every copy of a direction, so every GPU
  ordering test widens every race the same way; disk reads have no stream: their delay is a host sleep of
  as many nanoseconds on the reader thread before each read (the same order of magnitude at ~1 GHz).
- One listener event per copy (``copied(copy)``), with its direction and bytes, for the stats, the
  profiler and the planner's probe; and one per timed wait of the compute stream (``acquired(copy, before,
  after)``: a timed :meth:`acquire` of another direction than weights, whose waits the engine reports with
  their layer), so the stats and the profiler see waits of every direction.
- ``torch.profiler`` ranges (:func:`profiler_range`): ``DGLS <direction>`` around every copy's work (CUDA:
  its enqueue on the direction's stream, where the profiler links the kernels to it; CPU: the bytes
  landing), ``DGLS host waits for <direction>`` around every host wait (CUDA ``land``), and each worker
  item in its worker's range (``DGLS host optimizer job``, ``DGLS issue weight copies``), on the thread
  that runs it. While no profiler records, a range is one bool read and a shared no-op context.

Backends:

- :class:`CudaTransport`: the streams above, one CUDA event per copy (``ready``), the compute
  stream waits with ``wait_event``; device memory read or written on a copy stream is marked as
  used there (``record_stream``), so the caching allocator keeps it until the copy ran.
- :class:`Transport` (CPU): a late copy fills its destinations with NaN bytes at once and writes
  the bytes only when something waits for it (``acquire``, ``land``, or a later copy gated on it),
  so a missing wait in any direction computes with NaN and a CPU test fails. Work issued with
  :meth:`issue` runs at once (after its gates landed). A disk read is late the same way: its
  destination holds NaN bytes until something waits for it. A disk write is late too: the file keeps
  its old bytes until something waits for the write (a read that does not wait for it reads them), and
  its gates land only then, where the CUDA backend's disk job waits for them (a write not gated on the
  copy that fills its source writes that copy's NaN bytes, or the source's stale ones).

Invariants:

- A gate is waited for on the device before the gated work (CUDA), or landed before it (CPU).
- A copy is reported to the listeners once, when it is enqueued (CUDA) or submitted (CPU).
- Streams are never shared between directions: a direction's copies run in submission order.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Protocol

import torch
from torch.autograd import profiler as autograd_profiler

from ..errors import DGLSUserError, SwapWorkerError
from ..torch_private import profiler_recording, sleep_on_stream
from .disk_io import DiskReader

POISON = 0xFF  # a NaN in every float dtype DGLS moves (fp32, bf16, fp16, fp8 e4m3fn/e5m2)


class Direction(Enum):
    """What a copy carries (and so which stream it runs on)."""

    WEIGHTS_IN = "weights in"  # packed host masters into device slots
    GRADS_HOME = "gradients home"  # host-trained params' gradients into pinned landings
    ACTIVATIONS_OUT = "activations out"  # checkpointed inputs and recomputed tensors to pinned buffers
    ACTIVATIONS_IN = "activations in"  # and back before their recompute or backward reads them
    STATE_IN = "optimizer state in"  # device updates: masters, moments and gradients in, and the step
    STATE_OUT = "optimizer state out"  # device updates: masters, moments and the compute-dtype copy home
    DISK_IN = "disk reads"  # the disk tier's file into pinned staging buffers (host work: no stream)
    DISK_OUT = "disk writes"  # the training state's write-backs to its file (host work: no stream)

    # A key of the transport's tables on every copy: members are singletons, so identity hashing is correct, and
    # it runs no Python frame (``Enum.__hash__`` does).
    __hash__ = object.__hash__


ON_DISK = (Direction.DISK_IN, Direction.DISK_OUT)
STREAMED = tuple(d for d in Direction if d not in ON_DISK)  # the directions with CUDA streams


# The ranges' names, made once (a range's name is built per call only when a profiler records).
RANGES = {d: f"DGLS {d.value}" for d in Direction}
HOST_WAITS = {d: f"DGLS host waits for {d.value}" for d in Direction}
HOST_WAITS_MARKER = "DGLS host waits for a marker"
NO_RANGE: AbstractContextManager = nullcontext()  # stateless: one object serves every unprofiled range


def profiler_range(name: str) -> AbstractContextManager:
    """A ``record_function`` range named ``name`` while a profiler records; otherwise a shared no-op context
    (``record_function`` itself calls into the dispatcher even with no profiler running)."""
    return autograd_profiler.record_function(name) if profiler_recording() else NO_RANGE


@dataclass(eq=False)
class Marker:
    """A point on a stream: everything enqueued there before it (on the compute stream: every kernel that
    reads some buffer so far). A copy gated on it waits for it. ``event`` is None on the CPU, where compute
    is synchronous."""

    event: torch.cuda.Event | None = None


@dataclass(eq=False, kw_only=True)
class Copy:
    """One submitted copy (or piece of stream work): the token its consumer acquires or lands."""

    direction: Direction
    nbytes: int = 0
    ready: torch.cuda.Event | None = None  # CUDA: recorded after the work on its stream
    start: torch.cuda.Event | None = None  # CUDA, timed: recorded once its gates were met
    lane: int = 0  # which of the direction's streams (weights have several)
    pending: Callable[[], None] | None = None  # CPU: the bytes still to land
    span: tuple[float, float] | None = None  # CPU: perf_counter() around the landing (and disk reads on CUDA)
    io: Future | None = None  # CUDA: a disk read running on the reader's thread
    issued: threading.Event | None = None  # a token handed out before its work is issued: set once it is


Gate = Copy | Marker | None


class CopyListener(Protocol):
    def copied(self, copy: Copy) -> None: ...


class Transport:
    """The CPU backend (see the module doc); :class:`CudaTransport` overrides the mechanics."""

    cuda = False

    def __init__(self, device: torch.device, *, timed: Iterable[Direction] = ()) -> None:
        self.device = device
        # CUDA: the directions whose copies record timing events (weights for the stats' GB/s; all of them
        # while the profiler records)
        self.timed: set[Direction] = set(timed)
        self.listeners: list[CopyListener] = []
        # Tests (CUDA): GPU sleep cycles before the work of every copy of a direction (the one delay hook)
        self.delay: dict[Direction, int] = {}
        self.poison = False  # tests (CUDA): device destinations of a submit hold NaN bytes until the copy lands
        self.copy_worker = Worker("dgls-copies", "DGLS issue weight copies")  # --threading: never behind an update
        self.job_worker = Worker("dgls-jobs", "DGLS host optimizer job")  # gradient sums and updates
        self.reader: DiskReader | None = None  # the disk tier's reader and its threads (:meth:`read_from`)

    def read_from(self, reader: DiskReader) -> None:
        """Disk reads go through ``reader`` (the disk tier's file); the transport closes it."""
        self.reader = reader

    # ---------------------------------------------------------------- vocabulary
    def submit(
        self,
        direction: Direction,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        gates: Iterable[Gate] = (),
        *,
        after_compute: bool = False,
        late: bool = True,
        into: Copy | None = None,
        poison: list[torch.Tensor] | None = None,
        then: Callable[[], None] | None = None,
    ) -> Copy:
        """Copy each ``src`` into its ``dst`` after ``gates`` (and, with ``after_compute``, after the compute
        stream's work so far: the sources were just produced there), then run ``then`` (CPU only: the CUDA
        weights path upcasts inside :meth:`issue`). ``late`` (CPU): the destinations (or ``poison``) hold NaN
        until the copy is acquired or landed; otherwise the bytes land now. ``into``: the token to fill."""
        copy = _token(direction, pairs, into)
        for gate in gates:
            self.land(gate)
        copy.pending = partial(_copy_pairs, pairs, then)
        if late:
            for dst in _poison_targets(pairs, poison):
                _poison(dst)
        else:
            self._perform(copy)
        self._report(copy)
        return copy

    def acquire(self, copy: Copy, timed: bool = False) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The compute side may read ``copy``'s destination from now on. ``timed`` (CUDA): returns the compute
        stream's timing events before and after its wait, which the listeners hear (``acquired``); None on the
        CPU."""
        self._land(copy)
        return None

    def land(self, gate: Gate) -> None:
        """The host may read what ``gate`` stands for (it blocks until then)."""
        if isinstance(gate, Copy):
            self._land(gate)

    def mark(self, direction: Direction | None = None, timed: bool = False) -> Marker:
        """Everything enqueued so far on the compute stream (or on ``direction``'s stream)."""
        return Marker()

    @contextmanager
    def issue(
        self,
        direction: Direction,
        gates: Iterable[Gate] = (),
        *,
        into: Copy | None = None,
        lane: int = 0,
        after_compute: bool = False,
        timed: bool = False,
        host_waits: bool = False,
    ) -> Iterator[Copy]:
        """Work enqueued inside the block runs on ``direction``'s stream (lane ``lane``) after ``gates``; the
        yielded copy (``into`` if given) is ready after it (the block may set its ``nbytes``). With
        ``host_waits`` the host waits for the gates and for the work instead of the stream
        (``--no-event_sync`` or ``--device_sync_mode layer``). On the CPU the work runs now."""
        copy = into if into is not None else Copy(direction=direction)
        copy.lane = lane
        for gate in gates:
            self.land(gate)
        began = time.perf_counter()
        with profiler_range(RANGES[direction]):
            yield copy
        copy.span = (began, time.perf_counter())
        self._report(copy)

    def issue_work(
        self,
        direction: Direction,
        gates: Iterable[Gate],
        work: Callable[..., None],
        *args,
        into: Copy | None = None,
        lane: int = 0,
        host_waits: bool = False,
    ) -> Copy:
        """:meth:`issue` for one call ``work(*args)`` (enqueued on the direction's stream behind ``gates``)."""
        with self.issue(direction, gates, into=into, lane=lane, host_waits=host_waits) as copy:
            work(*args)
        return copy

    def read(
        self, dst: torch.Tensor, offset: int, gates: Iterable[Gate] = (), *, disk: DiskReader | None = None
    ) -> Copy:
        """``dst.numel()`` bytes of the disk file at ``offset`` into ``dst`` (page-aligned host memory), after
        ``gates`` (the copies that still read ``dst``); ``disk``: another file's reader than the weights'. CPU:
        ``dst`` holds NaN bytes until the read is waited for (its old bytes, where a gate is a copy not issued yet:
        that copy still reads them)."""
        copy = Copy(direction=Direction.DISK_IN, nbytes=dst.numel())
        # a gate not issued yet (the ring buffer's previous reader, a weight copy submitted in the same batch) lands
        # when the read is performed, not now (landing it now would do nothing); ``dst`` keeps its bytes for it
        later = [gate for gate in gates if isinstance(gate, Copy) and _unissued(gate)]
        for gate in gates:
            if not any(gate is g for g in later):
                self.land(gate)
        copy.pending = partial(_disk_after, self, later, (disk or self.reader).read, dst, offset)
        if not later:
            _poison(dst)
        self._report(copy)
        return copy

    def write(self, src: torch.Tensor, offset: int, gates: Iterable[Gate] = (), *, disk: DiskReader) -> Copy:
        """``src``'s bytes (page-aligned host memory, whole pages) into ``disk``'s file at ``offset``, after
        ``gates`` (the copies that fill ``src``). CPU: the file keeps its old bytes until the write is waited for
        (``src`` must not change before); its gates land then, not now, as the CUDA backend's disk job waits for
        them on the disk thread: a gate not issued yet (a copy submitted after the write) is waited for, and a
        gate waited for only by the write lands no earlier than it would on the device. (A read lands the gates
        already issued at its submission: it poisons ``dst``, which they still read.)"""
        copy = Copy(direction=Direction.DISK_OUT, nbytes=src.numel())
        copy.pending = partial(_disk_after, self, list(gates), disk.write, src, offset)
        self._report(copy)
        return copy

    def join(self, copies: list[Copy]) -> Copy | None:
        """One token for ``copies`` (one direction's, in submission order): waiting for it waits for all of
        them. On the CPU it lands each one."""
        if not copies:
            return None
        joined = Copy(direction=copies[0].direction, nbytes=sum(c.nbytes for c in copies))
        joined.pending = partial(_land_each, self, list(copies))
        return joined

    def after_compute(self, *directions: Direction) -> None:
        """These directions' streams wait for the compute stream's work so far (memory it freed is reused)."""

    def synchronize(self, *directions: Direction) -> None:
        """Block until everything enqueued on these directions' streams (all, if none given) ran."""

    def close(self) -> None:
        """Stop the worker threads (after the work they were given) and wait for every stream."""
        self.copy_worker.close()
        self.job_worker.close()
        self.synchronize()
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    # ---------------------------------------------------------------- mechanism
    def _land(self, copy: Copy) -> None:
        """A wait for ``copy`` (acquire, land, a gate): its bytes land now (the CPU mutation tests remove it)."""
        self._perform(copy)

    def _perform(self, copy: Copy) -> None:
        pending, copy.pending = copy.pending, None
        if pending is not None:
            with profiler_range(RANGES[copy.direction]):
                began = time.perf_counter()
                pending()
                copy.span = (began, time.perf_counter())

    def _report(self, copy: Copy) -> None:
        for listener in self.listeners:
            listener.copied(copy)

    def _report_wait(self, copy: Copy, before, after) -> None:
        """A timed wait of the compute stream for ``copy``: the listeners that time waits hear it (``acquired``).
        Not a weight copy's: the weight copier's waits reach the listeners with their layer (the engine's
        ``waited``), and this is the per-use hot path."""
        if copy.direction is Direction.WEIGHTS_IN:
            return
        for listener in self.listeners:
            acquired = getattr(listener, "acquired", None)  # a CopyListener need not time waits
            if acquired is not None:
                acquired(copy, before, after)


class CudaTransport(Transport):
    """Streams and CUDA events (see the module doc)."""

    cuda = True

    def __init__(self, device: torch.device, *, weight_lanes: int = 1, timed: Iterable[Direction] = ()) -> None:
        super().__init__(device, timed=timed)
        # Every stream DGLS uses besides the compute stream, created here and nowhere else (FSDP2's comm context):
        # - weights in: ``weight_lanes`` streams used round-robin (--cuda_streams), so a copy can start while
        #   the previous one is still being upcast from its fp8 landing buffer;
        # - gradients home and activations out: device-to-host, each on its own stream, so that neither queues
        #   behind the other or behind the host-to-device streams (PCIe is full duplex);
        # - activations in: host-to-device beside the weights, so a restore never waits for a weight copy;
        # - optimizer state in and out: the two halves of a device update, so chunk k+1 comes in while
        #   chunk k goes home.
        self.streams: dict[Direction, list[torch.cuda.Stream]] = {
            d: [torch.cuda.Stream(device=device) for _ in range(weight_lanes if d is Direction.WEIGHTS_IN else 1)]
            for d in STREAMED
        }

    def stream(self, direction: Direction, lane: int = 0) -> torch.cuda.Stream:
        return self.streams[direction][lane]

    def lanes(self, direction: Direction) -> int:
        return len(self.streams[direction])

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def event(self, timed: bool = False) -> torch.cuda.Event:
        """An event not yet recorded (a token handed out before its work is issued, e.g. by the worker)."""
        return torch.cuda.Event(enable_timing=timed)

    def submit(
        self,
        direction: Direction,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        gates: Iterable[Gate] = (),
        *,
        after_compute: bool = False,
        late: bool = True,
        into: Copy | None = None,
        poison: list[torch.Tensor] | None = None,
        then: Callable[[], None] | None = None,
    ) -> Copy:
        if self.poison:
            for dst in _poison_targets(pairs, poison):
                if dst.device.type == "cuda":
                    _poison(dst)
        copy = _token(direction, pairs, into)
        with self.issue(direction, gates, into=copy, after_compute=after_compute):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            if then is not None:
                then()
        stream = self.stream(direction)
        for dst, src in pairs:  # the allocator keeps device memory a copy reads or writes until the copy ran
            for t in (dst, src):
                if t.device.type == "cuda":
                    t.record_stream(stream)
        return copy

    def join(self, copies: list[Copy]) -> Copy | None:
        # one direction's copies run in submission order on its stream (weights aside, which have lanes):
        # the last one's event comes after all of theirs
        if any(c.direction is Direction.WEIGHTS_IN for c in copies):
            raise ValueError("weight copies run on several streams: join them one by one")
        return copies[-1] if copies else None

    def acquire(self, copy: Copy, timed: bool = False) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        if copy.io is not None:
            copy.io.result()
        if not timed:
            if copy.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(copy.ready)
            return None
        compute = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        if copy.ready is not None:
            compute.wait_event(copy.ready)
        after.record(compute)
        self._report_wait(copy, before, after)
        return before, after

    def land(self, gate: Gate) -> None:
        if isinstance(gate, Copy) and gate.io is not None:
            with profiler_range(HOST_WAITS[gate.direction]):
                gate.io.result()
            return
        event = _event_of(gate)
        if event is not None:
            waits = HOST_WAITS[gate.direction] if isinstance(gate, Copy) else HOST_WAITS_MARKER
            with profiler_range(waits):
                event.synchronize()

    def mark(self, direction: Direction | None = None, timed: bool = False) -> Marker:
        event = torch.cuda.Event(enable_timing=timed)
        event.record(torch.cuda.current_stream(self.device) if direction is None else self.streams[direction][0])
        return Marker(event)

    @contextmanager
    def issue(
        self,
        direction: Direction,
        gates: Iterable[Gate] = (),
        *,
        into: Copy | None = None,
        lane: int = 0,
        after_compute: bool = False,
        timed: bool = False,
        host_waits: bool = False,
    ) -> Iterator[Copy]:
        copy = into if into is not None else Copy(direction=direction)
        copy.lane = lane
        stream = self.streams[direction][lane]
        timed = timed or direction in self.timed
        if copy.ready is None:
            copy.ready = torch.cuda.Event(enable_timing=timed)
        if after_compute:
            stream.wait_stream(self._compute())
        with profiler_range(RANGES[direction]), torch.cuda.stream(stream):  # the stream's device current too
            self._behind(direction, stream, copy, gates, timed, host_waits)
            yield copy
            copy.ready.record(stream)
            if host_waits:
                stream.synchronize()
        self._report(copy)

    def issue_work(
        self,
        direction: Direction,
        gates: Iterable[Gate],
        work: Callable[..., None],
        *args,
        into: Copy | None = None,
        lane: int = 0,
        host_waits: bool = False,
    ) -> Copy:
        # :meth:`issue`'s steps for one call, without its generator and context manager objects
        copy = into if into is not None else Copy(direction=direction)
        copy.lane = lane
        stream = self.streams[direction][lane]
        timed = direction in self.timed
        if copy.ready is None:
            copy.ready = torch.cuda.Event(enable_timing=timed)
        named = autograd_profiler.record_function(RANGES[direction]) if profiler_recording() else None
        if named is not None:
            named.__enter__()
        try:
            with torch.cuda.stream(stream):  # the stream's device current too
                self._behind(direction, stream, copy, gates, timed, host_waits)
                work(*args)
                copy.ready.record(stream)
                if host_waits:
                    stream.synchronize()
        finally:
            if named is not None:
                named.__exit__(None, None, None)
        for listener in self.listeners:
            listener.copied(copy)
        return copy

    def _behind(
        self,
        direction: Direction,
        stream: torch.cuda.Stream,
        copy: Copy,
        gates: Iterable[Gate],
        timed: bool,
        host_waits: bool,
    ) -> None:
        """Inside :meth:`issue` (``stream`` current): the stream waits for ``gates`` (the host, with
        ``host_waits``; disk reads always on the host), then the copy's start event and the tests' delay."""
        for gate in gates:
            if isinstance(gate, Copy):
                if gate.io is not None:  # a disk read: host work, waited for here
                    gate.io.result()
                    continue
                event = gate.ready
            elif isinstance(gate, Marker):
                event = gate.event
            else:
                continue
            if event is None:
                continue
            if host_waits:
                event.synchronize()
            else:
                stream.wait_event(event)
        if timed:
            if copy.start is None:
                copy.start = torch.cuda.Event(enable_timing=True)
            copy.start.record(stream)
        cycles = self.delay.get(direction, 0) if self.delay else 0
        if cycles:
            sleep_on_stream(cycles)

    def after_compute(self, *directions: Direction) -> None:
        compute = self._compute()
        for direction in directions:
            for stream in self.streams[direction]:
                stream.wait_stream(compute)

    def synchronize(self, *directions: Direction) -> None:
        for direction in directions or STREAMED:
            if direction in ON_DISK:
                if self.reader is not None:
                    self.reader.submit(_nothing).result()  # every read submitted so far ran (in order)
                continue
            for stream in self.streams[direction]:
                stream.synchronize()

    def read(
        self, dst: torch.Tensor, offset: int, gates: Iterable[Gate] = (), *, disk: DiskReader | None = None
    ) -> Copy:
        reader = disk or self.reader
        return self._on_disk(Direction.DISK_IN, dst, gates, reader, partial(reader.read, dst, offset))

    def write(self, src: torch.Tensor, offset: int, gates: Iterable[Gate] = (), *, disk: DiskReader) -> Copy:
        return self._on_disk(Direction.DISK_OUT, src, gates, disk, partial(disk.write, src, offset))

    def _on_disk(
        self, direction: Direction, host: torch.Tensor, gates: Iterable[Gate], disk: DiskReader, work: Callable
    ) -> Copy:
        """A read or write on ``disk``'s ordered thread after ``gates``; its span timed (the profiler's lane)."""
        copy = Copy(direction=direction, nbytes=host.numel())
        gates = list(gates)
        delay_ns = self.delay.get(direction, 0)

        def job() -> None:
            for gate in gates:  # the copies that use ``host`` before (their tokens may be issued later)
                _host_wait(gate)
            if delay_ns:
                time.sleep(delay_ns / 1e9)
            began = time.perf_counter()
            with profiler_range(RANGES[direction]):
                work()
            copy.span = (began, time.perf_counter())

        copy.io = disk.submit(job)
        self._report(copy)
        return copy

    def staged_copy(self, dst: torch.Tensor, src: torch.Tensor, bounce: torch.Tensor, done: Marker | None) -> Marker:
        """Inside :meth:`issue`: ``src`` (pageable host memory) into ``dst`` through the pinned ``bounce``
        buffer, after its previous copy (``done``) read it; returns the marker of this one."""
        if done is not None and done.event is not None:
            done.event.synchronize()  # the bounce buffer is still being read (the only host wait here)
        bounce.copy_(src)
        dst.copy_(bounce, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Marker(event)


def make_transport(device: torch.device, *, weight_lanes: int = 1, timed: Iterable[Direction] = ()) -> Transport:
    """The backend for ``device``: streams and events on CUDA, late landings on the CPU."""
    if device.type == "cuda":
        return CudaTransport(device, weight_lanes=weight_lanes, timed=timed)
    return Transport(device, timed=timed)


def _event_of(gate: Gate) -> torch.cuda.Event | None:
    if isinstance(gate, Copy):
        return gate.ready
    if isinstance(gate, Marker):
        return gate.event
    return None


def _host_wait(gate: Gate) -> None:
    """CUDA, off the main thread: block until ``gate`` ran (a token issued later by the copy worker: until it is
    issued first, since a wait on an event not yet recorded would not wait)."""
    if isinstance(gate, Copy):
        if gate.issued is not None:
            gate.issued.wait()
        if gate.io is not None:
            gate.io.result()
    event = _event_of(gate)
    if event is not None:
        event.synchronize()


def _nothing() -> None:
    pass


def _unissued(copy: Copy) -> bool:
    return copy.issued is not None and not copy.issued.is_set()


def _disk_after(transport: Transport, gates: list[Gate], work: Callable, host: torch.Tensor, offset: int) -> None:
    """The CPU's disk read or write, when performed: after ``gates`` landed (a read's not issued at its submission,
    a write's all of them), as the CUDA backend's disk job waits for them first."""
    for gate in gates:
        transport.land(gate)
    work(host, offset)


def _land_each(transport: Transport, copies: list[Copy]) -> None:
    for copy in copies:
        transport._land(copy)


def _poison(tensor: torch.Tensor) -> None:
    """NaN bytes: what a destination holds while its copy is in flight."""
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(POISON)


def _token(direction: Direction, pairs: list[tuple[torch.Tensor, torch.Tensor]], into: Copy | None) -> Copy:
    """The copy to hand out for ``pairs``: ``into`` (a token given out earlier) or a new one, with its bytes."""
    copy = into if into is not None else Copy(direction=direction)
    if not copy.nbytes:
        copy.nbytes = sum(src.nbytes for _, src in pairs)
    return copy


def _poison_targets(pairs: list[tuple[torch.Tensor, torch.Tensor]], poison: list[torch.Tensor] | None):
    """What holds NaN until a copy lands: ``poison`` where given, else the copy's destinations."""
    return poison if poison is not None else [dst for dst, _ in pairs]


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]], then: Callable[[], None] | None) -> None:
    for dst, src in pairs:
        dst.copy_(src)
    if then is not None:
        then()


# -------------------------------------------------------------------- the worker threads
@dataclass(eq=False)
class _Item:
    run: Callable[[], None]
    done: threading.Event = field(default_factory=threading.Event)
    failed: Callable[[], None] | None = None  # wakes the item's waiters when it raised


class Worker:
    """A worker thread: runs work in submission order, work marked ``urgent`` ahead of queued jobs (the
    transport has one for copies to issue and one for host optimizer jobs, so neither waits for the other).

    Until :meth:`start` (a client that wants the thread), nothing runs by itself: :meth:`wait` runs the
    queued work in order on the calling thread up to what it waits for (deferred, the CPU tests' mode, where
    a missing wait leaves work undone and changes the numbers).

    Invariants:
    - Work runs one item at a time, urgent items in their order, jobs in theirs.
    - A failure stops the thread; every later :meth:`check` and :meth:`wait` raises it in the caller.
    """

    def __init__(self, name: str = "dgls-worker", label: str = "DGLS worker item") -> None:
        self.name = name
        self.label = label  # the torch.profiler range around each item it runs
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._urgent: deque[_Item] = deque()
        self._jobs: deque[_Item] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def on_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def put(self, run: Callable[[], None], *, urgent: bool = False, failed: Callable[[], None] | None = None):
        """Queue ``run``; returns the ``threading.Event`` set once it ran."""
        self.check()
        item = _Item(run, failed=failed)
        with self._cond:
            (self._urgent if urgent else self._jobs).append(item)
            self._cond.notify()
        return item.done

    def wait(self, done: threading.Event) -> None:
        """Until ``done`` is set (deferred: run queued work in order until it is)."""
        if self._thread is None:
            while not done.is_set():
                with self._cond:
                    queue = self._urgent if self._urgent else self._jobs
                    if not queue:
                        break
                    item = queue.popleft()
                self._run(item)
                self.check()
            return
        while not done.wait(timeout=1.0):
            self.check()
            if not self._thread.is_alive():
                raise SwapWorkerError("the DGLS worker thread stopped with work pending")
        self.check()

    def check(self) -> None:
        """Surface a failure of the worker in the calling thread: a user mistake found there (a setting a job
        refuses) as itself, one line; anything else as a :class:`SwapWorkerError`, a bug."""
        if isinstance(self.error, DGLSUserError):
            raise self.error
        if self.error is not None:
            raise SwapWorkerError(f"DGLS worker thread failed: {self.error!r}") from self.error

    def drain(self) -> None:
        """Until everything queued so far ran."""
        with self._cond:
            items = [*self._urgent, *self._jobs]
        for item in items:
            self.wait(item.done)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        if self._thread is None:
            return
        try:
            if self.error is None:
                self.drain()
        finally:
            with self._cond:
                self._stopping = True
                self._cond.notify()
            self._thread.join(timeout=60)
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._urgent or self._jobs or self._stopping):
                    self._cond.wait()
                if not (self._urgent or self._jobs):
                    return
                item = (self._urgent if self._urgent else self._jobs).popleft()
            if not self._run(item):
                return

    def _run(self, item: _Item) -> bool:
        try:
            with profiler_range(self.label):
                item.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
            if item.failed is not None:
                item.failed()
            item.done.set()
            return False
        item.done.set()
        return True
